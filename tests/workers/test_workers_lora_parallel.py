"""LoRA jobs split by tensor and pipeline parallelism: the same losses as one rank, adapters peft loads.

Real torchrun jobs (gloo CPU ranks) on a tiny Llama with random weights,
fp32, the same batches in every run (data-parallel degree 1 throughout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from support.worker_jobs import (
    LLAMA_TRAIN,
    assert_loss_falls,
    assert_same_curve,
    losses,
    notes_of,
    records,
    run_job,
    save_random_llama,
    write_job,
)

pytestmark = pytest.mark.slow

LORA_TRAIN: dict[str, Any] = {
    **LLAMA_TRAIN,
    "method": "lora",
    "lora_rank": 8,
    "learning_rate": 2e-2,
    "max_steps": 8,
    "eval_every": 4,
    "checkpoint_every": 0,
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-jobs")


@pytest.fixture(scope="module")
def base_llama(root: Path) -> Path:
    return save_random_llama(root / "base-llama", initializer_range=0.1)


def lora_job(root: Path, base: Path, name: str, parallelism: dict[str, Any], nproc: int, **train: Any) -> Path:
    job = write_job(root / name, kind="train", model=str(base), parallelism=parallelism, train={**LORA_TRAIN, **train})
    run_job(job, nproc)
    return job


@pytest.fixture(scope="module")
def single_run(root: Path, base_llama: Path) -> Path:
    return lora_job(root, base_llama, "lora-1", {}, 1)


def adapter_logits(base: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.arange(3, 3 + 24).reshape(2, 12)
    with torch.no_grad():
        return model(input_ids=ids).logits


def base_logits(base: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 3 + 24).reshape(2, 12)).logits


def assert_same_adapter(job: Path, reference: Path, base: Path) -> None:
    got = adapter_logits(base, job / "output")
    want = adapter_logits(base, reference / "output")
    assert not torch.allclose(got, base_logits(base), atol=1e-3)  # the adapter learned something
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_lora_with_tensor_parallel_equals_one_rank(root: Path, base_llama: Path, single_run: Path) -> None:
    job = lora_job(root, base_llama, "lora-tp", {"tp": 2}, 2)
    assert "the LM head and the loss split the vocabulary 2 ways: no rank holds the whole logits" in notes_of(job)
    curve = assert_loss_falls(job, margin=0.3)
    assert_same_curve(curve, losses(single_run), tol=1e-5)
    assert_same_adapter(job, single_run, base_llama)


def test_lora_with_tensor_and_sequence_parallel_equals_one_rank(root: Path, base_llama: Path, single_run: Path) -> None:
    job = lora_job(root, base_llama, "lora-tp-sp", {"tp": 2, "sequence_parallel": True}, 2)
    assert any(n.startswith("sequence parallel: norms and the residual stream") for n in notes_of(job))
    assert_same_curve(assert_loss_falls(job, margin=0.3), losses(single_run), tol=1e-5)
    assert_same_adapter(job, single_run, base_llama)


def test_lora_with_pipeline_parallel_equals_one_rank(root: Path, base_llama: Path, single_run: Path) -> None:
    # micro_batch 1 x 2 pipeline micro-batches = the 2 sequences per micro-batch the one-rank run sees.
    job = lora_job(
        root, base_llama, "lora-pp", {"pp": 2, "pp_microbatches": 2, "pp_schedule": "1F1B"}, 2, micro_batch=1
    )
    assert_same_curve(assert_loss_falls(job, margin=0.3), losses(single_run), tol=1e-5)
    assert_same_adapter(job, single_run, base_llama)


# Four processes share two cores here: short runs, against runs with the same data-parallel degree.
SHORT = {"max_steps": 3, "eval_every": 3}


def test_lora_with_fsdp_and_tensor_parallel_on_four_ranks_equals_ddp(root: Path, base_llama: Path) -> None:
    ddp = lora_job(root, base_llama, "lora-ddp", {"dp_replicate": 2}, 2, **SHORT)
    job = lora_job(root, base_llama, "lora-fsdp-tp", {"dp_shard": 2, "tp": 2}, 4, **SHORT)
    assert_same_curve(losses(job), losses(ddp), tol=1e-5)
    assert_same_adapter(job, ddp, base_llama)


def test_lora_with_pipeline_and_tensor_parallel_on_four_ranks_equals_one_rank(root: Path, base_llama: Path) -> None:
    one = lora_job(root, base_llama, "lora-1-short", {}, 1, **SHORT)
    job = lora_job(root, base_llama, "lora-pp-tp", {"pp": 2, "tp": 2, "pp_microbatches": 2}, 4, micro_batch=1, **SHORT)
    # The last stage's TP ranks (2 and 3) hold the head, split by vocabulary under the pipeline too.
    head_notes = [r["message"] for r in records(job, rank=2) if r.get("kind") == "note"]
    assert "the LM head and the loss split the vocabulary 2 ways: no rank holds the whole logits" in head_notes
    assert_same_curve(losses(job), losses(one), tol=1e-5)
    evals = [[r["eval_loss"] for r in records(j) if r.get("kind") == "eval"] for j in (job, one)]
    assert len(evals[0]) == 1 and abs(evals[0][0] - evals[1][0]) < 1e-5, evals
    assert_same_adapter(job, one, base_llama)
