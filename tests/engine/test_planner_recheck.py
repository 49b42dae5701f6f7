"""The `plan` request's `recheck`: a recommended plan with the user's changes, re-checked by the engine's planner.

The job wizard sends every change it lets the user make (degrees, micro-batch, checkpointing, sequence length,
LoRA) here; a layout that cannot be is refused with a reason code and its facts, one that does not fit comes
back with `fits` false and the figures recomputed.
"""

from __future__ import annotations

import json
import shutil

import pytest

from rigpilot.engine.api import protocol
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.examples import EXAMPLES
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.planner.overrides import Overrides
from rigpilot.engine.service import planworker

WORK = {"task": "train", "method": "lora", "precision": "bf16", "seq_len": 1024, "global_batch": 16,
        "lora": {"rank": 16, "alpha": 32}}  # fmt: skip
MODEL = "llama-2-7b"


def answer(here, **request) -> dict:
    """What the planner process writes back for one request line."""
    return planworker._answer(here, json.dumps({"model": MODEL, **request}).encode())


@pytest.fixture(scope="module")
def recommended() -> dict:
    here = load_profile("4x-rtxa6000-bridged")
    return answer(here, workload=WORK, gpus=[0, 1, 2, 3], verify=False)["result"]["best"]


def recheck(plan: dict, gpus=(0, 1, 2, 3), model: str = MODEL, **changes) -> dict:
    here = load_profile("4x-rtxa6000-bridged")
    return answer(here, model=model, gpus=list(gpus), recheck={"plan": plan, "overrides": Overrides(**changes).to_dict()})


def test_a_change_is_recomputed_and_says_whether_it_fits(recommended):
    same = recheck(recommended)["result"]
    assert same["fits"] and same["message"].startswith("Fits: the fullest GPU")
    assert same["plan"]["memory"] == recommended["memory"] and same["plan"]["notes"] == recommended["notes"]
    crowded = recheck(recommended, micro_batch=64, checkpointing="none")["result"]
    assert not crowded["fits"] and crowded["message"].startswith("Does not fit: GPU ")
    assert crowded["plan"]["parallelism"]["micro_batch"] == 64
    assert crowded["plan"]["memory"][0]["total"] > recommended["memory"][0]["total"]
    assert any("changed in the wizard" in n for n in crowded["plan"]["notes"])
    offloaded = recheck(recommended, dp=1, tp=1, pp=1, cpu_offload=True)["result"]["plan"]["parallelism"]
    assert (offloaded["backend"], offloaded["offload_params"], offloaded["gpu_indices"]) == ("fsdp", True, [0])


@pytest.mark.parametrize(
    ("changes", "reason", "fields"),
    [
        ({"tp": 3}, "too_few_gpus", {"dp": 4, "tp": 3, "pp": 1, "need": 12, "selected": 4}),
        ({"dp": 1, "tp": 3}, "tp_not_a_divisor", {"tp": 3, "heads": 32, "kv_heads": 32, "max_tp": 8}),
        ({"dp": 1, "pp": 4, "tp": 1}, None, None),  # four stages of 32 layers: a layout that can be
        ({"seq_len": 8192}, "seq_too_long", {"setting": "seq_len", "value": 8192, "limit": 4096}),
        ({"checkpointing": "most"}, "not_a_choice", {"setting": "checkpointing", "value": "most"}),
    ],
)  # fmt: skip
def test_a_change_that_makes_no_layout_is_refused_with_its_code_and_facts(recommended, changes, reason, fields):
    reply = recheck(recommended, **changes)
    if reason is None:
        assert reply["result"]["plan"]["parallelism"]["pp"] == 4
        return
    error = reply["error"]
    assert error["reason"] == reason and "\n" not in error["message"]
    assert fields.items() <= error["fields"].items()


def test_malformed_rechecks_are_one_line(recommended):
    here = load_profile("4x-rtx4090")
    for bad, code, says in (
        ({"plan": recommended, "overrides": {"dp": "two"}}, protocol.INVALID, "plan.recheck.overrides.dp: expected"),
        ({"plan": recommended, "overrides": {"zoom": 2}}, protocol.INVALID, "plan.recheck.overrides: unknown field"),
        ({"plan": {**recommended, "parallelism": 7}}, protocol.INVALID, "plan.recheck.plan: not a plan"),
        ({"plan": {"parallelism": 7}}, "user_error", "not a Rigpilot plan"),
        ({"overrides": {}}, protocol.INVALID, "plan.recheck: expected {plan, overrides}"),
    ):
        error = answer(here, recheck=bad)["error"]
        assert error["code"] == code and error["message"].startswith(says) and "\n" not in error["message"], error


def test_a_bare_config_file_is_planned_and_rechecked_by_the_engine(tmp_path):
    """Training from scratch names a config file; the engine plans it (the GUI no longer plans it itself)."""
    config = tmp_path / "my-model.json"
    shutil.copy(EXAMPLES / "models" / "tiny-llama" / "config.json", config)
    here = load_profile("2x-rtx3090-nvlink")
    work = {"task": "train", "method": "full", "precision": "fp32", "seq_len": 128, "global_batch": 8}
    best = answer(here, model=str(config), workload=work, gpus=[0, 1], verify=False)["result"]["best"]
    assert best is not None
    checked = answer(here, model=str(config), gpus=[0, 1], recheck={"plan": best, "overrides": {"micro_batch": 1}})
    assert checked["result"]["fits"] and checked["result"]["plan"]["parallelism"]["micro_batch"] == 1
    error = answer(here, model=str(tmp_path / "notes.txt"), workload=work)["error"]
    assert "notes.txt" in error["message"]


def test_the_engine_rechecks_over_its_socket(engine, recommended):
    engine.start()
    plan = {**recommended, "parallelism": {**recommended["parallelism"], "gpu_indices": [0, 1, 2, 3]}}
    with engine.client() as c:
        checked = c.request("plan", model=MODEL, gpus=[0, 1, 2, 3],
                            recheck={"plan": plan, "overrides": {"micro_batch": 1}})["result"]  # fmt: skip
        assert checked["plan"]["parallelism"]["micro_batch"] == 1 and isinstance(checked["fits"], bool)
        with pytest.raises(EngineError) as e:
            c.request("plan", model=MODEL, gpus=[0, 1], recheck={"plan": plan, "overrides": {"dp": 4}})
        assert e.value.reason == "too_few_gpus" and e.value.fields["selected"] == 2


def test_a_changed_setting_is_bounded_as_the_jobs_own_setting_is_declared() -> None:
    from rigpilot.engine.errors import UserError
    from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
    from rigpilot.engine.planner.overrides import Overrides

    Overrides(micro_batch=int(TRAIN_SETTINGS["micro_batch"].hi)).check()
    with pytest.raises(UserError) as e:
        Overrides(micro_batch=int(TRAIN_SETTINGS["micro_batch"].hi) + 1).check()
    assert e.value.reason == "out_of_range" and e.value.fields["setting"] == "train.micro_batch"
    with pytest.raises(UserError) as e:
        Overrides(new_tokens=0).check()
    assert e.value.reason == "out_of_range" and e.value.fields["setting"] == "infer.max_new_tokens"


def test_a_recipe_change_is_recomputed_and_judged_by_the_contract(recommended):
    """The wizard's recipe drop-downs reach the re-check: the memory follows, and a recipe the engine refuses
    with the layout (the optimizer step in backward with accumulation) comes back not runnable, saying why."""
    assert recommended["workload"]["loss_chunks"] is not None  # the planner's choice, written into the plan
    chunked = recheck(recommended, loss_chunks=16)["result"]["plan"]
    whole = recheck(recommended, loss_chunks=1)["result"]["plan"]
    assert chunked["workload"]["loss_chunks"] == 16 and whole["workload"]["loss_chunks"] == 1
    assert max(m["activations"] for m in chunked["memory"]) < max(m["activations"] for m in whole["memory"])
    in_backward = recheck(recommended, optimizer_in_backward=True, micro_batch=1, grad_accum=4)["result"]["plan"]
    assert not in_backward["runs_here"] and "gradient accumulation 1" in in_backward["runs_here_reason"]
    assert recheck(recommended, loss_chunks=0)["error"]["reason"] == "out_of_range"
