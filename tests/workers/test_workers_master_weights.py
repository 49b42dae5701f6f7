"""bf16 master weights (`--master-weights bf16`, torchtune's everyday recipe): a job trains what a plain
bf16 PyTorch loop written here trains, keeps its weights and AdamW state in bf16 (half the bytes of the
fp32 recipe, measured on the checkpoint), and a contradictory pair of settings is refused by code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.limits import check_job_settings
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS, JobSpec
from rigpilot.engine.schema import check_group

from support.paths import SHAKESPEARE, TINY_LLAMA_CONFIG
from support.reference_loop import inputs_and_labels, reference_lr
from support.worker_jobs import records, run_job, write_job

RECIPE: dict[str, Any] = {
    "method": "scratch",
    "precision": "bf16",
    "master_weights": "bf16",
    "seq_len": 32,
    "micro_batch": 2,
    "grad_accum": 2,
    "max_steps": 3,
    "learning_rate": 3e-3,
    "warmup_steps": 1,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "eval_every": 0,
    "checkpoint_every": 3,
    "eval_fraction": 0.01,
    "seed": 1234,
}


def plain_bf16_loop(steps: int) -> list[float]:
    """torch, transformers and torchao only: a bf16 model, torchao's bf16 AdamW with stochastic rounding, the
    worker's autocast and fp32 cross-entropy."""
    import torch.nn.functional as F
    from torchao.optim import _AdamW
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rigpilot.engine.workers.data import ShardedBatches, build_dataset, read_dataset
    from rigpilot.engine.workers.optimizers import rounding_seed

    r = RECIPE
    folder = TINY_LLAMA_CONFIG.parent
    files, docs = read_dataset([str(SHAKESPEARE)], "text")
    data = build_dataset(
        files, docs, AutoTokenizer.from_pretrained(folder), r["seq_len"] + 1, r["eval_fraction"], r["seed"],
        train_on_prompts=False,
    )  # fmt: skip
    order = ShardedBatches(len(data.train), r["micro_batch"] * r["grad_accum"], 0, 1, r["seed"])
    torch.manual_seed(r["seed"])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    model.train()
    params = list(model.parameters())
    # Pure bf16's update: torchao's AdamW with bf16 stochastic rounding, its bits seeded per step as the engine does.
    optimizer = _AdamW(
        params, lr=r["learning_rate"], weight_decay=r["weight_decay"], betas=(0.9, 0.95), bf16_stochastic_round=True
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: reference_lr(s, r["warmup_steps"], steps))
    out = []
    for step in range(steps):
        picked = order.next_indices()
        inputs, labels = inputs_and_labels(data.train[picked], None)
        optimizer.zero_grad(set_to_none=True)
        total = (labels != -100).sum()
        step_loss = 0.0
        for chunk in range(r["grad_accum"]):
            part = slice(chunk * r["micro_batch"], (chunk + 1) * r["micro_batch"])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=inputs[part], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels[part].flatten(), reduction="sum") / total
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, r["grad_clip"])
        with rounding_seed(r["seed"], step, 0, torch.device("cpu")):
            optimizer.step()
        schedule.step()
        out.append(step_loss)
    return out


@pytest.mark.slow
def test_bf16_master_weights_train_what_a_plain_bf16_loop_trains_in_half_the_bytes(tmp_path: Path) -> None:
    runs = {}
    for master in ("bf16", "fp32"):
        job = write_job(
            tmp_path / master,
            kind="train",
            model=str(TINY_LLAMA_CONFIG),
            train={**RECIPE, "master_weights": master, "dataset": [str(SHAKESPEARE)]},
        )
        run_job(job, 1)
        runs[master] = job
    steps = [r for r in records(runs["bf16"]) if r.get("loss") is not None]
    reference = plain_bf16_loop(RECIPE["max_steps"])
    assert [r["loss"] for r in steps] == pytest.approx(reference, rel=2e-3)
    notes = [r.get("message", "") for r in records(runs["bf16"]) if r.get("kind") == "note"]
    assert any("bf16 master weights" in n for n in notes), notes

    def state_bytes(job: Path) -> tuple[int, set[torch.dtype]]:
        """Bytes of the float tensors (weights, AdamW's moments) in the last checkpoint, and their dtypes,
        from its DCP metadata (read through the engine's safe reader)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from rigpilot.engine.workers.checkpoint import SafeReader

        folder = job / "checkpoints" / f"step-{RECIPE['max_steps']}"
        meta = SafeReader(str(folder)).read_metadata()
        tensors = [m for m in meta.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)]
        floats = [m for m in tensors if m.properties.dtype.is_floating_point and len(m.size) > 0]
        assert floats
        size = sum(m.size.numel() * m.properties.dtype.itemsize for m in floats)
        return size, {m.properties.dtype for m in floats}

    bf16_bytes, bf16_dtypes = state_bytes(runs["bf16"])
    fp32_bytes, fp32_dtypes = state_bytes(runs["fp32"])
    assert bf16_dtypes == {torch.bfloat16} and fp32_dtypes == {torch.float32}
    assert bf16_bytes * 2 == fp32_bytes


def test_bf16_master_weights_need_bf16_compute_at_submission_and_on_the_rank() -> None:
    spec = JobSpec.from_dict(
        {"id": "x", "kind": "train", "model": "m", "train": {"precision": "fp32", "master_weights": "bf16"}}
    )
    for check in (lambda: check_job_settings(spec), lambda: check_group(spec.train, TRAIN_SETTINGS)):
        with pytest.raises(UserError) as e:
            check()
        assert e.value.reason == "conflicting_settings"
        assert e.value.fields == {
            "setting": "train.master_weights", "value": "bf16", "other": "train.precision", "needs": "bf16",
            "found": "fp32",
        }  # fmt: skip
    check_job_settings(
        JobSpec.from_dict({"id": "y", "kind": "train", "model": "m", "train": {"master_weights": "bf16"}})
    )


def test_adapters_follow_the_master_weights_dtype() -> None:
    from rigpilot.engine.workers.model_loading import trainable_dtype, training_load_dtype

    assert training_load_dtype("full", torch.bfloat16) == torch.float32
    assert training_load_dtype("full", torch.bfloat16, "bf16") == torch.bfloat16
    assert training_load_dtype("lora", torch.bfloat16, "fp32") == torch.bfloat16
    assert trainable_dtype("bf16") == torch.bfloat16 and trainable_dtype("fp32") == torch.float32
