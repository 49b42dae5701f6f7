"""The capability contract: one function decides what the engine runs, for the planner and the submission alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigpilot.engine.capability import PIPELINE_TYPES, TENSOR_PARALLEL_TYPES, Layout, layout_of_plan, why_not
from rigpilot.engine.hardware.simulated import list_profiles, load_profile
from rigpilot.engine.models import describe_model
from rigpilot.engine.planner.plan import LoraSettings, Workload
from rigpilot.engine.planner.search import SearchOptions, search
from rigpilot.engine.service.submission import describe, prepare

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"
PRESETS = ("llama-2-7b", "llama-2-13b", "llama-3-70b", "mixtral-8x7b")


def test_every_refusal_is_one_line_naming_what_to_change() -> None:
    cases = {
        Layout("train", "qlora", tp=2): "QLoRA",
        Layout("train", "full", tp=2, cpu_offload=True): "CPU offload",
        Layout("train", "full", pp=2, model_type="gpt2"): "pipeline parallel",
        Layout("train", "full", tp=2, model_type="bert"): "tensor parallel",
        Layout("train", "dpo"): "unknown training method",
        Layout("infer", weight_bits=4): "4-bit inference",
        Layout("train", dp_shard=0): "at least 1",
    }
    for layout, words in cases.items():
        reason = why_not(layout)
        assert reason is not None and words in reason and "\n" not in reason, (layout, reason)
    for ok in (
        Layout("train", "lora", tp=2, model_type="llama"),
        Layout("train", "full", dp_shard=4, cpu_offload=True),
        Layout("train", "qlora", dp_replicate=2, model_type="llama"),
        Layout("train", "scratch", pp=2, model_type=PIPELINE_TYPES[0]),
        Layout("infer", tp=2, model_type=TENSOR_PARALLEL_TYPES[0]),
    ):
        assert why_not(ok) is None, ok


def test_a_plans_layout_is_what_the_submission_maps_it_to() -> None:
    plan = {
        "model_type": "llama",
        "workload": {"task": "train", "method": "lora"},
        "parallelism": {"dp": 4, "tp": 2, "pp": 1, "zero_stage": 3, "shard_degree": 2, "sequence_parallel": True},
    }
    lt = layout_of_plan(plan)
    assert (lt.dp_replicate, lt.dp_shard, lt.tp, lt.method, lt.sequence_parallel) == (2, 2, 2, "lora", True)
    offload = layout_of_plan({"parallelism": {"dp": 2, "zero_stage": 3, "shard_degree": 2, "offload_params": True}})
    assert offload.cpu_offload and offload.dp_shard == 2
    zero2 = layout_of_plan({"parallelism": {"dp": 4, "zero_stage": 2}})
    assert (zero2.dp_replicate, zero2.dp_shard) == (1, 4)


# (workload, the job spec `rigpilot run … --plan FILE --check` sends for it)
TASKS = {
    "full": (dict(task="train"), {"kind": "train", "train": {"method": "scratch", "dataset": [str(SHAKESPEARE)]}}),
    "lora": (dict(task="train", method="lora", lora=LoraSettings()),
             {"kind": "train", "train": {"method": "lora", "dataset": [str(SHAKESPEARE)]}}),
    "qlora": (dict(task="train", method="qlora", lora=LoraSettings()),
              {"kind": "train", "train": {"method": "qlora", "dataset": [str(SHAKESPEARE)]}}),
    "infer": (dict(task="infer", seq_len=2048, global_batch=1, new_tokens=256),
              {"kind": "infer", "infer": {"prompts": ["Once upon a time"]}}),
}  # fmt: skip


@pytest.mark.parametrize("profile", [p["id"] for p in list_profiles()])
def test_every_best_plan_passes_the_submission_check_on_its_machine(profile: str, tmp_path: Path) -> None:
    """`rigpilot run KIND --model PRESET … --plan FILE --check`, in-process, for every task on every profile."""
    machine = load_profile(profile)
    for preset in PRESETS:
        spec_model = describe_model(preset)
        for task, (work, job) in TASKS.items():
            result = search(spec_model, machine, Workload(model=preset, **work), options=SearchOptions())
            if result.best is None:
                continue  # nothing fits at all: the planner's suggestions take over
            plan = result.to_dict()
            where = (profile, preset, task)
            assert plan["best"]["runs_here"], (*where, plan["best"]["runs_here_reason"])
            sub = prepare({**job, "model": preset}, plan, str(tmp_path), job_id="check", machine=machine, max_cpu_ranks=2)
            lines = describe(sub)
            assert lines[0].startswith(f"would run: {job['kind']}"), (*where, lines)
            p, best = sub.spec.parallelism, result.best.parallelism
            assert p.cpu_offload == (best.offload_params or best.offload_optimizer), where
            assert (p.tp, p.pp) == (best.tp, best.pp), where
            if job["kind"] == "train":
                assert sub.spec.train.seq_len == result.best.workload.seq_len, where
