"""The recipe's activation side on every layout that runs it: a job with the loss in chunks, and one with its
activations offloaded (beside full checkpointing), each against the same layout's plain job and the plain
single-process loop (tests/support/reference_loop.py).

Chunked loss: the same losses, gradient norms and eval loss as the whole-logits job to 1e-6 (fp32), and the
plain loop's to the reference tests' tolerance. Activation offloading: bit-identical to the same layout's job
with the activations kept (a copy to host memory and back changes no bit), step by step and in the saved model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from support.paths import SHAKESPEARE, TINY_LLAMA_CONFIG
from support.reference_loop import GLOBAL_BATCH, RECIPE, reference_run
from support.worker_jobs import notes_of, output_tensors, records, run_job, write_job

pytestmark = pytest.mark.slow

EVAL_FRACTION = 0.01
CHUNKS = 3  # does not divide the sequence (32): uneven chunks

# name: (parallelism, ranks, micro_batch, grad_accum); micro_batch x pp_microbatches x dp x grad_accum = 4.
# One rank runs in-process in test_workers_chunked_loss.py and test_workers_activation_offload.py; DDP's ranks
# each run that one-rank path (its gradients are all-reduced after), so the layouts here are those that split
# the model: FSDP2's gathered head, the vocabulary-parallel loss, the last pipeline stage.
LAYOUTS: dict[str, tuple[dict[str, Any], int, int, int]] = {
    "fsdp-accum": ({"dp_shard": 2}, 2, 1, 2),  # the root's gathered head across micro-batches and the eval
    "tp-sp": ({"tp": 2, "sequence_parallel": True}, 2, 4, 1),  # the vocabulary-parallel loss, chunk by chunk
    "pp-1f1b": ({"pp": 2, "pp_microbatches": 2, "pp_schedule": "1F1B"}, 2, 1, 2),
}
# Every job checkpoints its blocks (full): offloading then sends the blocks' inputs to the host, as it runs
# beside checkpointing; the chunked job is held to the same layout's job with the whole logits.
VARIANTS: dict[str, dict[str, Any]] = {
    "kept": {"activation_checkpointing": "full"},
    "chunked": {"activation_checkpointing": "full", "loss_chunks": CHUNKS},
    "offloaded": {"activation_checkpointing": "full", "activation_offload": True},
}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run(SHAKESPEARE, EVAL_FRACTION)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("activation-layouts")


_jobs: dict[tuple[str, str], Path] = {}


def job(root: Path, layout: str, variant: str) -> Path:
    """The job of one (layout, variant), run once per module."""
    if (layout, variant) in _jobs:
        return _jobs[layout, variant]
    parallelism, nproc, micro_batch, grad_accum = LAYOUTS[layout]
    folder = write_job(
        root / f"{layout}-{variant}",
        kind="train",
        model=str(TINY_LLAMA_CONFIG),
        parallelism=parallelism,
        train={**RECIPE, "dataset": [str(SHAKESPEARE)], "eval_fraction": EVAL_FRACTION,
               "micro_batch": micro_batch, "grad_accum": grad_accum, **VARIANTS[variant]},
    )  # fmt: skip
    run_job(folder, nproc)
    _jobs[layout, variant] = folder
    return folder


def figures(folder: Path) -> dict[str, list[float]]:
    steps = [r for r in records(folder) if r.get("loss") is not None]
    (evaluation,) = [r for r in records(folder) if r.get("kind") == "eval"]
    return {
        "loss": [r["loss"] for r in steps],
        "grad_norm": [r["grad_norm"] for r in steps],
        "eval_loss": [evaluation["eval_loss"]],
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_loss_in_chunks_trains_what_the_whole_loss_and_the_plain_loop_train(
    root: Path, reference: dict[str, Any], layout: str
) -> None:
    parallelism, _, micro_batch, grad_accum = LAYOUTS[layout]
    dp = parallelism.get("dp_replicate", 1) * parallelism.get("dp_shard", 1)
    assert micro_batch * parallelism.get("pp_microbatches", 1) * dp * grad_accum == GLOBAL_BATCH
    chunked, whole = figures(job(root, layout, "chunked")), figures(job(root, layout, "kept"))
    for key in chunked:
        assert chunked[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-6), key
    assert chunked["loss"] == pytest.approx([reference["loss"][s] for s in sorted(reference["loss"])], abs=1e-5)
    assert chunked["eval_loss"][0] == pytest.approx(reference["eval_loss"], abs=1e-5)
    assert any("chunked loss" in n for n in notes_of(job(root, layout, "chunked")))


# Tensor parallel's offloaded shards are held bit for bit in-process (test_workers_activation_offload.py).
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "tp-sp"])
def test_offloaded_activations_train_bit_for_bit_what_kept_ones_train(
    root: Path, reference: dict[str, Any], layout: str
) -> None:
    offloaded, kept = job(root, layout, "offloaded"), job(root, layout, "kept")
    assert figures(offloaded) == figures(kept)
    assert figures(offloaded)["loss"] == pytest.approx(
        [reference["loss"][s] for s in sorted(reference["loss"])], abs=1e-5
    )
    a, b = output_tensors(offloaded), output_tensors(kept)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("activation offloading" in n for n in notes_of(offloaded))
