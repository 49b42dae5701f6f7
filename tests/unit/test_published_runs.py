"""The step-time model against published, measured training runs (resources/published_runs.json).

Each run is predicted for the layout its source used, on a simulated node of its GPUs, and the table of
predicted vs published tokens/s/GPU is printed (pytest -s shows it). Bounds, on the runs of a stack like
the engine's ("eager-pytorch"): median |error| <= 15% over at least 10 runs, no prediction more than 30%
above its published figure. The efficiency priors of the classes these runs cover are fitted to them
(benchmarks/published_runs.py --fit), so the test also catches a fit gone stale; tuned-stack runs are
printed for reference and fit nothing.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys

import pytest

from rigpilot import resources
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.planner.links import EFFICIENCY_PRIOR, Topology

from support.paths import REPO

ROOT = REPO


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
    assert len([r for r in runs if r["stack"] == "eager-pytorch"]) >= 10
    assert len({r["id"] for r in runs}) == len(runs)
    for r in runs:
        lay = r["layout"]
        assert r["stack"] in ("eager-pytorch", "tuned") and r["stack_why"], r["id"]
        assert 0 < r["node_gpus"] <= 8 and r["gpus"] % r["node_gpus"] == 0
        if r["node_gpus"] < r["gpus"]:
            # Multi-node: the network binds the sharding ring (FSDP) or the replicas' all-reduce (HSDP).
            assert r["internode_gbits_per_node"] > 0 and r["internode_source"] in ("stated", "assumed"), r["id"]
        assert 0 < lay.get("recompute_fraction", 0.5) < 1
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
    eager = [r for r in rows if r.eager]
    assert len(eager) >= 10
    assert med <= bench.MEDIAN_LIMIT
    assert worst <= bench.OPTIMISTIC_LIMIT, max(eager, key=lambda r: r.error).id


def test_the_fitted_priors_are_the_ones_in_use():
    doc = json.loads(resources.path("speed_priors.json").read_text())
    fitted = {k: v for k, v in doc["efficiency"].items() if v.get("fitted")}
    assert set(fitted) == {"ampere", "hopper"}
    stacks = {r["id"]: r["stack"] for r in json.loads(resources.path("published_runs.json").read_text())["runs"]}
    for cls, f in fitted.items():
        assert EFFICIENCY_PRIOR[cls] == f["efficiency"]
        assert set(f["runs"]) <= set(stacks) and len(f["runs"]) >= 4
        # Only runs of a stack like the engine's: a tuned stack would make the planner promise its speed.
        assert {stacks[r] for r in f["runs"]} == {"eager-pytorch"}


def test_refitting_reproduces_the_recorded_priors(bench):
    fitted = bench.fit()
    doc = json.loads(resources.path("speed_priors.json").read_text())
    for cls, f in fitted.items():
        assert f["efficiency"] == pytest.approx(doc["efficiency"][cls]["efficiency"], abs=0.002)
    # Half the class's runs above, half below: the fit is median-unbiased.
    rows = bench.table()
    for cls in fitted:
        errs = [r.error for r in rows if bench.CLASSES[r.gpu] == cls and r.eager]
        assert abs(statistics.median(errs)) < 0.03


def test_plans_say_which_efficiencies_are_fitted():
    doc = json.loads(resources.path("speed_priors.json").read_text())
    n = len(doc["efficiency"]["hopper"]["runs"])
    h100 = Topology(load_profile("8x-h100-sxm"), list(range(8)))
    share = [f for f in h100.compute_figures([0], "bf16") if f.name.startswith("share of that peak")]
    assert [f.source for f in share] == [f"fitted to {n} published runs"]
    rtx = Topology(load_profile("4x-rtx4090"), [0])
    share = [f for f in rtx.compute_figures([0], "bf16") if f.name.startswith("share of that peak")]
    assert [f.source for f in share] == ["assumed"]
