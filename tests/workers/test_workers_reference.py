"""Every layout trains what a plain single-process PyTorch loop trains: the same loss at every step.

The reference loop (tests/support/reference_loop.py) is written with torch and transformers only: the same initial weights
(a scratch model is `torch.manual_seed(seed)` then `from_config`, as the worker builds it), the
same global batches, and one step = forward, cross-entropy summed over the trained tokens and
divided by the global batch's trained-token count, backward, grad-norm clipping, AdamW, the LR
warmup + cosine lambda re-implemented here. Only the data comes from engine/workers/data.py (the
token blocks, the chat masks, the seeded order of blocks): the point is the loop's semantics, not
the data pipeline. Rank r of a data-parallel degree dp takes, at its p-th micro-batch, the slice
r of the p-th global micro-batch of that order; a step's grad_accum micro-batches are thus one
contiguous chunk of grad_accum x dp x micro_batch x pp_microbatches blocks. Every layout here keeps
that chunk at GLOBAL_BATCH sequences, so one reference serves them all.

Chat data (only the answers trained) runs on every layout: its micro-batches carry different
numbers of trained tokens, which is what a per-micro-batch mean gets wrong. Text data runs on a
subset (DDP with accumulation, 1F1B, FSDP x TP), to keep the file within a few minutes on two cores.
Every job also evaluates at its last step on an eval split smaller than one pipeline batch (padded
eval batches), and checkpoints that step before evaluating.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rigpilot.engine.jobspec.spec import JobSpec

from support.paths import CHAT, SHAKESPEARE, TINY_LLAMA_CONFIG
from support.reference_loop import GLOBAL_BATCH, RECIPE, reference_run
from support.worker_jobs import output_tensors, records, run_job, write_job

pytestmark = pytest.mark.slow

# The eval splits (3 chat blocks, 2 text blocks) are smaller than the GPipe job's pipeline batch of 4.
DATASETS = {"chat": (CHAT, 0.02), "text": (SHAKESPEARE, 0.01)}

# name: (parallelism, ranks, micro_batch, grad_accum); micro_batch x pp_microbatches x dp x grad_accum = 4.
LAYOUTS: dict[str, tuple[dict[str, Any], int, int, int]] = {
    "ddp": ({"dp_replicate": 2}, 2, 1, 2),
    "fsdp": ({"dp_shard": 2}, 2, 2, 1),
    "fsdp-accum": ({"dp_shard": 2}, 2, 1, 2),  # reduce-scattered every micro-batch, summed in the shards
    "tp": ({"tp": 2}, 2, 2, 2),
    "tp-sp": ({"tp": 2, "sequence_parallel": True}, 2, 4, 1),
    "pp-gpipe": ({"pp": 2, "pp_microbatches": 2, "pp_schedule": "GPipe"}, 2, 2, 1),
    "pp-1f1b": ({"pp": 2, "pp_microbatches": 2, "pp_schedule": "1F1B"}, 2, 1, 2),
    "fsdp-tp": ({"dp_shard": 2, "tp": 2}, 4, 1, 2),
    "accum": ({}, 1, 1, 4),
}
CASES = [("chat", name) for name in LAYOUTS] + [("text", name) for name in ("ddp", "pp-1f1b", "fsdp-tp")]


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {name: reference_run(path, fraction) for name, (path, fraction) in DATASETS.items()}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reference")


_jobs: dict[str, Path] = {}


def run_case(root: Path, data: str, layout: str) -> Path:
    """The job of one (data, layout) case, run once per module."""
    name = f"{data}-{layout}"
    if name in _jobs:
        return _jobs[name]
    parallelism, nproc, micro_batch, grad_accum = LAYOUTS[layout]
    path, eval_fraction = DATASETS[data]
    job = write_job(
        root / f"{data}-{layout}",
        kind="train",
        model=str(TINY_LLAMA_CONFIG),
        parallelism=parallelism,
        train={
            **RECIPE,
            "dataset": [str(path)],
            "eval_fraction": eval_fraction,
            "micro_batch": micro_batch,
            "grad_accum": grad_accum,
        },
    )
    run_job(job, nproc)
    _jobs[name] = job
    return job


@pytest.mark.parametrize(("data", "layout"), CASES, ids=[f"{d}-{n}" for d, n in CASES])
def test_every_layout_trains_what_the_plain_loop_trains(
    root: Path, references: dict[str, dict[str, Any]], data: str, layout: str
) -> None:
    parallelism, _, micro_batch, grad_accum = LAYOUTS[layout]
    pipeline_batch = micro_batch * parallelism.get("pp_microbatches", 1)
    dp = parallelism.get("dp_replicate", 1) * parallelism.get("dp_shard", 1)
    assert pipeline_batch * dp * grad_accum == GLOBAL_BATCH
    job = run_case(root, data, layout)
    ref = references[data]
    steps = [r for r in records(job) if r.get("loss") is not None]
    assert [r["step"] for r in steps] == list(range(1, RECIPE["max_steps"] + 1))
    for r in steps:
        s = r["step"]
        assert r["loss"] == pytest.approx(ref["loss"][s], abs=1e-5), f"step {s}: {r['loss']} vs {ref['loss'][s]}"
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"][s], rel=1e-4), f"grad norm at step {s}"
        assert r["lr"] == pytest.approx(ref["lr"][s], rel=1e-9)

    # The last step is checkpointed before it is evaluated; the eval, padded to full batches, covers
    # every eval block once.
    last = [r.get("kind") for r in records(job) if r.get("step") == RECIPE["max_steps"] and r.get("kind")]
    assert "checkpoint" in last and "eval" in last and last.index("checkpoint") < last.index("eval"), last
    assert (job / "checkpoints" / f"step-{RECIPE['max_steps']}" / "COMPLETE").is_file()
    if layout == "pp-gpipe":
        assert ref["eval_blocks"] < pipeline_batch  # the case that used to crash the schedule
    (evaluation,) = [r for r in records(job) if r.get("kind") == "eval"]
    assert evaluation["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)
    assert (job / "output" / "model.safetensors").is_file()


def test_a_job_resumed_from_its_last_step_evaluates_and_exports_again(root: Path) -> None:
    # A job that failed in its final evaluation or export resumes from the last step's checkpoint:
    # nothing is trained again, and the evaluation and the model are what the run would have given.
    job = run_case(root, "chat", "pp-gpipe")
    last = RECIPE["max_steps"]
    again = root / "chat-pp-gpipe-resumed"
    spec = JobSpec.read(job)
    spec.resume = True
    spec.write(again)
    shutil.copytree(job / "checkpoints" / f"step-{last}", again / "checkpoints" / f"step-{last}")
    run_job(again, spec.parallelism.world_size)
    assert not [r for r in records(again) if r.get("loss") is not None]
    (before,) = [r["eval_loss"] for r in records(job) if r.get("kind") == "eval"]
    (after,) = [r["eval_loss"] for r in records(again) if r.get("kind") == "eval"]
    assert after == pytest.approx(before, abs=1e-6)
    for name, tensor in output_tensors(job).items():
        assert torch.equal(tensor, output_tensors(again)[name]), name
