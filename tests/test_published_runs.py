"""The step-time model against published, measured training runs (resources/published_runs.json).

Each run is predicted for the layout its source used, on a simulated node of its GPUs, and the table of
predicted vs published tokens/s/GPU is printed (pytest -s shows it). Bounds: median |error| <= 15%, no
prediction more than 30% above its published figure. The efficiency priors of the classes these runs cover
are fitted to this table (benchmarks/published_runs.py --fit), so the test also catches a fit gone stale.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

from rigpilot import resources
from rigpilot.engine.planner.links import EFFICIENCY_PRIOR

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench()


def test_every_run_is_cited_and_complete():
    doc = json.loads(resources.path("published_runs.json").read_text())
    runs = doc["runs"]
    assert len(runs) >= 10
    assert len({r["id"] for r in runs}) == len(runs)
    for r in runs:
        lay = r["layout"]
        assert r["source"]["url"].startswith("https://") and r["source"]["where"]
        assert r["tokens_per_s_per_gpu"] > 0 and r["seq_len"] > 0 and r["precision"] == "bf16"
        assert lay["dp"] * lay["tp"] * lay["pp"] == r["gpus"]
        assert lay["micro_batch"] * lay["grad_accum"] * lay["dp"] == lay["global_batch"], r["id"]
        assert lay["checkpointing"] in ("none", "selective", "full")
        assert r["model"] in doc["models"] or r["model"].startswith("llama")


def test_predictions_match_published_runs(bench, capsys):
    rows = bench.table()
    with capsys.disabled():
        print()
        med, worst = bench.print_table(rows)
    assert med <= bench.MEDIAN_LIMIT
    assert worst <= bench.OPTIMISTIC_LIMIT, max(rows, key=lambda r: r.error).id


def test_the_fitted_priors_are_the_ones_in_use():
    doc = json.loads(resources.path("speed_priors.json").read_text())
    fitted = {k: v for k, v in doc["efficiency"].items() if v.get("fitted")}
    assert set(fitted) == {"ampere", "hopper"}
    runs = {r["id"] for r in json.loads(resources.path("published_runs.json").read_text())["runs"]}
    for cls, f in fitted.items():
        assert EFFICIENCY_PRIOR[cls] == f["efficiency"]
        assert set(f["runs"]) <= runs and len(f["runs"]) >= 5


def test_refitting_reproduces_the_recorded_priors(bench):
    fitted = bench.fit()
    doc = json.loads(resources.path("speed_priors.json").read_text())
    for cls, f in fitted.items():
        assert f["efficiency"] == pytest.approx(doc["efficiency"][cls]["efficiency"], abs=0.002)
    # Half the class's runs above, half below: the fit is median-unbiased.
    rows = bench.table()
    for cls in fitted:
        errs = [r.error for r in rows if bench.CLASSES[r.gpu] == cls]
        assert abs(statistics.median(errs)) < 0.03
