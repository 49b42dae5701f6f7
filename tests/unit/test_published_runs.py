"""The step-time model against published, measured training runs (resources/published_runs.json).

Each run is predicted for the layout its source used, on a simulated node of its GPUs, and the table of
predicted vs published tokens/s/GPU is printed (pytest -s shows it). Eager runs ("eager-pytorch") and
compiled runs ("compiled-pytorch", torch.compile of each block) are fitted apart, each on two thirds of its
runs (a fixed, seeded split); bounds on all runs of each stack: median |error| <= 15%, no prediction more than
30% above its published figure. The test also catches a fit gone stale; tuned-stack runs fit nothing.
The planner's own pick for each run and the held-out goal are the benchmark's to print (it runs the search).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys

import pytest

from rigpilot import resources
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.planner.links import COMPILED_EFFICIENCY_PRIOR, EFFICIENCY_PRIOR, Topology

from support.paths import REPO

ROOT = REPO
STACKS = ("eager-pytorch", "compiled-pytorch")


def _bench():
    spec = importlib.util.spec_from_file_location("published_runs", ROOT / "benchmarks" / "published_runs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench()


def _runs():
    return json.loads(resources.path("published_runs.json").read_text())["runs"]


def test_every_run_is_cited_and_complete():
    doc = json.loads(resources.path("published_runs.json").read_text())
    runs = doc["runs"]
    assert len([r for r in runs if r["stack"] == "eager-pytorch"]) >= 10
    assert len([r for r in runs if r["stack"] == "compiled-pytorch"]) >= 8
    assert len({r["id"] for r in runs}) == len(runs)
    for r in runs:
        lay = r["layout"]
        assert r["stack"] in (*STACKS, "tuned") and r["stack_why"], r["id"]
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


def test_the_split_holds_out_a_third_of_each_stack_and_class(bench):
    runs = _runs()
    held = bench.split(runs)
    assert held == bench.split(list(reversed(runs)))  # fixed: not the file's order, not chance
    for stack in STACKS:
        for cls in ("ampere", "hopper"):
            group = [r["id"] for r in runs if r["stack"] == stack and bench.CLASSES[r["gpu"]] == cls]
            out = [i for i in group if i in held]
            assert len(out) == len(group) - round(len(group) * 2 / 3) and 0 < len(out) < len(group)
    assert not any(r["id"] in held for r in runs if r["stack"] == "tuned")


def test_predictions_match_published_runs(bench, capsys):
    rows = bench.table()
    with capsys.disabled():
        print()
        bench.print_table(rows)
    for stack in STACKS:
        mine = [r for r in rows if r.stack == stack]
        s = bench.summary(rows, stack)
        assert s["median_abs_error"] <= bench.MEDIAN_LIMIT, stack
        assert s["most_optimistic"] <= bench.OPTIMISTIC_LIMIT, max(mine, key=lambda r: r.error).id
        assert s["held_out"]["runs"] >= 3


def test_the_fitted_priors_are_the_ones_in_use(bench):
    doc = json.loads(resources.path("speed_priors.json").read_text())
    stacks = {r["id"]: r["stack"] for r in _runs()}
    held = bench.split(_runs())
    fitted = {k: v for k, v in doc["efficiency"].items() if v.get("fitted")}
    assert set(fitted) == {"ampere", "hopper"}
    for cls, f in fitted.items():
        for stack, entry, prior in (("eager-pytorch", f, EFFICIENCY_PRIOR), ("compiled-pytorch", f["compiled"], COMPILED_EFFICIENCY_PRIOR)):
            assert prior[cls] == entry["efficiency"]
            assert set(entry["runs"]) <= set(stacks) and len(entry["runs"]) >= 3
            # Only runs of that stack, and none of the held-out ones: a held-out error would be no test.
            assert {stacks[r] for r in entry["runs"]} == {stack}
            assert not set(entry["runs"]) & held and set(entry["held_out"]) <= held
    # torch.compile is faster, and a class no compiled run was fitted for takes the fitted classes' gain.
    assert all(COMPILED_EFFICIENCY_PRIOR[c] > EFFICIENCY_PRIOR[c] for c in fitted)
    gain = doc["compile_gain"]["value"]
    assert COMPILED_EFFICIENCY_PRIOR["ada lovelace"] == pytest.approx(EFFICIENCY_PRIOR["ada lovelace"] * gain)


def test_refitting_reproduces_the_recorded_priors(bench):
    fitted = bench.fit()
    doc = json.loads(resources.path("speed_priors.json").read_text())
    for cls, f in fitted["eager-pytorch"].items():
        assert f["efficiency"] == pytest.approx(doc["efficiency"][cls]["efficiency"], abs=0.002)
    for cls, f in fitted["compiled-pytorch"].items():
        assert f["efficiency"] == pytest.approx(doc["efficiency"][cls]["compiled"]["efficiency"], abs=0.002)
    # Half the class's fitting runs above, half below: the fit is median-unbiased.
    rows = bench.table()
    for stack in STACKS:
        for cls in fitted[stack]:
            errs = [r.error for r in rows if bench.CLASSES[r.gpu] == cls and r.stack == stack and not r.held_out]
            assert abs(statistics.median(errs)) < 0.03


def test_plans_say_which_efficiencies_are_fitted():
    doc = json.loads(resources.path("speed_priors.json").read_text())
    n = len(doc["efficiency"]["hopper"]["runs"])
    nc = len(doc["efficiency"]["hopper"]["compiled"]["runs"])
    h100 = Topology(load_profile("8x-h100-sxm"), list(range(8)))
    share = [f for f in h100.compute_figures([0], "bf16") if f.name.startswith("share of that peak")]
    assert [f.source for f in share] == [f"fitted to {n} published runs"]
    share = [f for f in h100.compute_figures([0], "bf16", compile=True) if f.name.startswith("share of that peak")]
    assert [f.source for f in share] == [f"fitted to {nc} published compiled runs"]
    rtx = Topology(load_profile("4x-rtx4090"), [0])
    share = [f for f in rtx.compute_figures([0], "bf16") if f.name.startswith("share of that peak")]
    assert [f.source for f in share] == ["assumed"]
    share = [f for f in rtx.compute_figures([0], "bf16", compile=True) if f.name.startswith("share of that peak")]
    assert share[0].source.startswith("assumed: eager ×")


def test_a_missed_pick_says_why_and_names_the_run_that_bounds_it(bench):
    same = ("llama-2-13b", "a100-sxm-80", 4096)
    sac = bench.Row("sac", "a100-sxm-80", "eager-pytorch", 1904.0, 2000.0, 0.5, 0.0, held_out=True, planned=2226.0,
                    recompute=0.5, planned_recompute=0.0, micro_batch=2, planned_micro_batch=2, same=same)
    noac = bench.Row("noac", "a100-sxm-80", "eager-pytorch", 2162.0, 2315.0, 0.6, 0.0, micro_batch=2, same=same)
    close = bench.Row("close", "a100-sxm-80", "eager-pytorch", 2000.0, 2000.0, 0.5, 0.0, held_out=True,
                      planned=2050.0, planned_recompute=0.0, micro_batch=2, planned_micro_batch=2, same=same)
    [why] = bench.miss_reasons([sac, close], [sac, noac, close])
    assert why.startswith("sac +16.9%") and "recomputes 0%" in why and "layout 50%" in why
    assert "noac measures the same micro-batch without checkpointing at 2,162, the pick +3.0%" in why
    assert bench.recompute_share({"checkpointing": "selective"}) == 0.0  # the engine's policy keeps every matmul
    assert bench.recompute_share({"checkpointing": "selective", "recompute_fraction": 0.3}) == 0.3
