"""One capability contract: every plan the search ranks says whether the engine runs it, and the best one does.

The sweep covers every simulated machine × Llama-2-7B, Llama-2-13B, Llama-3-70B and Mixtral-8x7B ×
full training, LoRA, QLoRA and inference: whenever a plan the engine runs fits, the best plan is one.
"""

from __future__ import annotations

import pytest

from rigpilot.engine.cli.plan import render_text
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner.plan import LoraSettings, Plan, Workload, refusal
from rigpilot.engine.planner.search import SearchOptions, search
from rigpilot.engine.recipe import PLAIN_RECIPE

from support.paths import REPO

PROFILES = sorted(p.stem for p in (REPO / "resources" / "machines").glob("*.json"))
TASKS = [("train", "full"), ("train", "lora"), ("train", "qlora"), ("infer", "full")]


MODELS = ("llama-2-7b", "llama-2-13b", "llama-3-70b", "mixtral-8x7b")  # presets: no network needed


def workload(model: str, task: str, method: str) -> Workload:
    if task == "infer":
        return Workload(model=model, task="infer", seq_len=2048, global_batch=1, new_tokens=256)
    lora = LoraSettings() if method != "full" else None
    return Workload(model=model, method=method, seq_len=2048, global_batch=16, lora=lora, **PLAIN_RECIPE)


@pytest.fixture(scope="module")
def specs():
    return {name: describe_model(name) for name in MODELS}


@pytest.fixture(scope="module")
def machines():
    return {p: load_profile(p) for p in PROFILES}


def _check_contract(r) -> None:
    plans = ([r.best] if r.best else []) + r.runners_up
    for p in plans:
        # The flag the search set from its candidate is the one the plan's own JSON gets from the contract.
        # ... and the one a plan read back from its JSON is judged by anew.
        d = p.to_dict()
        reason = refusal(Plan.from_dict({k: v for k, v in d.items() if k not in ("runs_here", "runs_here_reason")}))
        assert p.runs_here is (not reason)
        assert p.runs_here_reason == reason
    flags = [p.runs_here for p in plans]
    assert flags == sorted(flags, reverse=True), "a plan the engine cannot run is listed above one it runs"


@pytest.mark.parametrize("model", list(MODELS))
def test_best_plan_runs_whenever_a_runnable_plan_fits(specs, machines, model):
    no_runnable = []
    for profile in PROFILES:
        for task, method in TASKS:
            r = search(specs[model], machines[profile], workload(model, task, method), options=SearchOptions(suggest=False))
            _check_contract(r)
            if r.best is None:
                assert r.runnable == 0
                continue
            if r.runnable:
                assert r.best.runs_here, (profile, task, method, r.best.runs_here_reason)
                assert "DeepSpeed" not in r.best.parallelism.describe()
            else:
                no_runnable.append((profile, task, method))
                assert not r.best.runs_here
                assert r.explanation[0].startswith("No plan that fits")
                assert r.best.runs_here_reason in r.explanation[0]
    if model.startswith("llama"):
        assert not no_runnable, no_runnable  # Llama's every layout is in the engine's tables


def test_issue_case_four_4090s_full_fine_tuning_runs_as_fsdp2_offload():
    r = search(describe_model("llama-2-7b"), load_profile("4x-rtx4090"), workload("llama-2-7b", "train", "full"))
    par = r.best.parallelism
    assert r.best.runs_here and r.best.runs_here_reason == ""
    assert par.backend == "fsdp" and par.zero_stage == 3 and par.offload_params and par.offload_optimizer
    assert par.describe().startswith("FSDP2 (ZeRO-3) with CPU offload over 4")
    assert not any("DeepSpeed" in line for line in r.explanation)
    # Nothing the default search offers is DeepSpeed's or ZeRO-1 any more.
    for p in r.runners_up:
        assert p.parallelism.backend != "deepspeed" and p.parallelism.zero_stage != 1
        assert p.parallelism.offload_params == p.parallelism.offload_optimizer


def test_issue_case_mixtral_lora_on_8_a100_pcie_runs_every_listed_plan():
    # Mixtral's tensor- and pipeline-parallel plans run now (experts whole on every rank under TP).
    r = search(describe_model("mixtral-8x7b"), load_profile("8x-a100-pcie"), workload("mixtral-8x7b", "train", "lora"),
               options=SearchOptions(runners_up=8))  # fmt: skip
    assert r.best.runs_here and all(p.runs_here for p in r.runners_up)
    assert any(p.parallelism.tp > 1 or p.parallelism.pp > 1 for p in r.runners_up)


def test_plans_the_engine_cannot_run_are_listed_last_and_marked():
    r = search(describe_model("llama-3-70b"), load_profile("8x-a100-pcie"), workload("llama-3-70b", "train", "qlora"),
               options=SearchOptions(runners_up=8))  # fmt: skip
    assert r.best.runs_here
    refused = [p for p in r.runners_up if not p.runs_here]
    assert refused and all("QLoRA" in p.runs_here_reason for p in refused)
    text = "\n".join(render_text(r))
    assert "✗" in text and "cannot run here: " in text


@pytest.mark.parametrize("profile", ["8x-a100-pcie", "8x-h100-sxm"])
def test_issue_case_llama_3_70b_lora(profile):
    r = search(describe_model("llama-3-70b"), load_profile(profile), workload("llama-3-70b", "train", "lora"))
    assert r.best is not None and r.best.runs_here and r.best.fits


def test_qlora_offload_is_not_offered():
    # 70B in NF4 does not fit one 24 GiB card; offloading QLoRA's base is refused by the engine, so nothing fits.
    r = search(describe_model("llama-3-70b"), load_profile("1x-rtx4090"), workload("llama-3-70b", "train", "qlora"))
    assert r.best is None or r.best.runs_here
    off = next(x for x in r.rejected if x.family == "offload")
    assert "QLoRA" in off.reason
    for s in r.suggestions:
        assert s.plan.runs_here


def test_planner_modules_import_without_cycles():
    """explain reads the search's types from engine.planner.result; no planner module imports one that imports it."""
    import ast

    folder = REPO / "engine" / "planner"
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        if path.stem == "__init__":
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rigpilot.engine.planner."):
                deps.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = deps

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for d in graph.get(start, ()):
            if d == target or (d not in seen and reaches(d, target, seen | {d})):
                return True
        return False

    assert "search" not in graph["explain"] and "result" in graph["explain"]
    assert [m for m in graph if reaches(m, m, set())] == []


def test_every_optimizer_the_planner_offers_is_one_the_workers_step_with(specs, machines):
    """A plan sized for 8-bit AdamW runs as 8-bit AdamW (torchao): the planner offers no optimizer the engine
    cannot run, and the contract's list is the schema's."""
    from rigpilot.engine.capability import TRAIN_OPTIMIZERS
    from rigpilot.engine.planner.settings import OPTIMIZERS

    assert set(OPTIMIZERS) == set(TRAIN_OPTIMIZERS)
    w = Workload(model="llama-2-13b", method="full", seq_len=2048, global_batch=16, optimizer="adamw8bit")
    r = search(specs["llama-2-13b"], machines["4x-rtx4090"], w, options=SearchOptions(suggest=False))
    assert r.runnable > 0 and r.best is not None and r.best.runs_here
