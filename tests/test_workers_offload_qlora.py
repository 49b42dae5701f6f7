"""CPU offload and QLoRA, run as real torchrun jobs on CPU ranks with gloo (see test_workers_jobs.py).

CPU offload on this machine: the ranks are CPU processes, so FSDP2's
CPUOffloadPolicy has nowhere to move anything from; the "device" copies before
each block's compute and after its backward are CPU-to-CPU no-ops. What these
tests check is that the offload code path itself runs (the same fully_shard
call with CPUOffloadPolicy, the same optimizer step, clipping, DCP checkpoint
and final gather a GPU run goes through), that FSDP2 reports every parameter
shard under the policy and in host memory, and that it computes what the same
job without offload computes. Pinned memory (a GPU run's) is not exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_workers_jobs import (
    LLAMA_TRAIN,
    TINY_LLAMA_CONFIG,
    assert_loss_falls,
    assert_same_curve,
    llama_job,
    losses,
    notes_of,
    output_tensors,
    resume_from,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offload-qlora")


@pytest.fixture(scope="module")
def fsdp_run(root: Path) -> Path:
    return llama_job(root, "fsdp", {"dp_shard": 2})


@pytest.fixture(scope="module")
def offload_run(root: Path) -> Path:
    return llama_job(root, "offload", {"dp_shard": 2, "cpu_offload": True})


def offload_note(job: Path) -> str:
    (note,) = [n for n in notes_of(job) if n.startswith("CPU offload (FSDP2 CPUOffloadPolicy")]
    return note


def test_cpu_offload_computes_what_fsdp_does_and_resumes(offload_run: Path, fsdp_run: Path) -> None:
    params = sum(1 for _ in _tiny_llama().parameters())
    assert offload_note(offload_run).startswith(
        f"CPU offload (FSDP2 CPUOffloadPolicy over 2 rank(s)): {params} of {params} parameter shards"
    )
    assert not any(n.startswith("CPU offload") for n in notes_of(fsdp_run))
    curve = assert_loss_falls(offload_run, margin=0.5)
    assert_same_curve(curve, losses(fsdp_run), tol=1e-5)
    for name, tensor in output_tensors(fsdp_run).items():
        assert torch.allclose(tensor, output_tensors(offload_run)[name], atol=1e-5), name
    resumed = resume_from(offload_run, 6)
    assert offload_note(resumed)
    after = losses(resumed)
    assert sorted(after) == list(range(7, 13))
    assert_same_curve(after, {s: curve[s] for s in after}, tol=1e-6)
    for name, tensor in output_tensors(offload_run).items():
        assert torch.allclose(tensor, output_tensors(resumed)[name], atol=1e-6), name


def test_cpu_offload_shards_a_replicated_layout_too(root: Path, fsdp_run: Path) -> None:
    # Offload is FSDP2's policy, so a DDP-shaped layout runs as FSDP2 over its replicate dim.
    job = llama_job(
        root, "offload-replicate", {"dp_replicate": 2, "cpu_offload": True}, max_steps=4, checkpoint_every=0
    )
    assert "over 2 rank(s)" in offload_note(job)
    warmup = LLAMA_TRAIN["warmup_steps"] + 1  # until warm-up ends the LR does not depend on max_steps
    assert_same_curve(
        {s: losses(job)[s] for s in range(1, warmup + 1)}, {s: losses(fsdp_run)[s] for s in range(1, warmup + 1)}, 1e-5
    )


def _tiny_llama() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA_CONFIG.parent))
