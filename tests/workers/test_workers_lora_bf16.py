"""LoRA in bf16 trains what a user's own transformers + peft loop trains: a bf16 base, fp32 adapters, autocast.

The reference loop below uses transformers, peft and torch only, as their documentation has users
write it: `from_pretrained(dtype=torch.bfloat16)`, `get_peft_model` (which keeps the adapters in
fp32), the forward under `torch.autocast(dtype=torch.bfloat16)`, AdamW on the trainable
parameters. The same seed before loading, the same batches (from engine/workers/data.py, as in
test_workers_reference.py: the point is the loop, not the data pipeline), the same LR lambda.
A base held in fp32 (what the worker used to load) computes a different model: its embeddings,
norms and residual stream stay fp32 under autocast, and the adapters start from other values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from support.paths import SHAKESPEARE
from support.reference_loop import inputs_and_labels, reference_lr
from support.worker_jobs import notes_of, records, run_job, save_random_llama, write_job

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 4
RECIPE: dict[str, Any] = {
    "dataset": [str(SHAKESPEARE)],
    "eval_fraction": 0.01,
    "method": "lora",
    "precision": "bf16",
    "lora_rank": 8,
    "lora_alpha": 16,
    "seq_len": 32,
    "micro_batch": GLOBAL_BATCH,
    "grad_accum": 1,
    "max_steps": 4,
    "learning_rate": 2e-2,
    "warmup_steps": 1,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "eval_every": 4,
    "checkpoint_every": 0,
    "seed": 1234,
}
LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def summed_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def reference_run(base: Path) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rigpilot.engine.workers.data import ShardedBatches, build_dataset, read_dataset

    r = RECIPE
    tokenizer = AutoTokenizer.from_pretrained(base)
    files, docs = read_dataset(r["dataset"], "text")
    data = build_dataset(
        files, docs, tokenizer, r["seq_len"] + 1, r["eval_fraction"], r["seed"], train_on_prompts=False
    )
    order = ShardedBatches(len(data.train), GLOBAL_BATCH, 0, 1, r["seed"])

    torch.manual_seed(r["seed"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    config = LoraConfig(r=r["lora_rank"], lora_alpha=r["lora_alpha"], lora_dropout=0.0,
                        target_modules=LLAMA_PROJECTIONS, task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = {
        "frozen": {p.dtype for p in model.parameters() if not p.requires_grad},
        "trainable": {p.dtype for p in params},
    }
    optimizer = torch.optim.AdamW(params, lr=r["learning_rate"], weight_decay=r["weight_decay"], betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: reference_lr(s, r["warmup_steps"], r["max_steps"])
    )
    out: dict[str, Any] = {"loss": {}, "grad_norm": {}, "dtypes": dtypes}
    for step in range(1, r["max_steps"] + 1):
        inputs, labels = inputs_and_labels(data.train[order.next_indices()], None)
        optimizer.zero_grad(set_to_none=True)
        loss = summed_loss(model, inputs, labels) / (labels != -100).sum()
        loss.backward()
        out["grad_norm"][step] = float(torch.nn.utils.clip_grad_norm_(params, r["grad_clip"]))
        optimizer.step()
        schedule.step()
        out["loss"][step] = float(loss.detach())
    model.eval()
    with torch.no_grad():
        inputs, labels = inputs_and_labels(data.eval, None)
        out["eval_loss"] = float(summed_loss(model, inputs, labels) / (labels != -100).sum())
    return out


def test_a_bf16_lora_job_holds_a_bf16_base_and_trains_what_the_peft_loop_trains(tmp_path: Path) -> None:
    base = save_random_llama(tmp_path / "base-llama", initializer_range=0.1)  # saved in fp32
    ref = reference_run(base)
    assert ref["dtypes"] == {"frozen": {torch.bfloat16}, "trainable": {torch.float32}}
    job = write_job(tmp_path / "job", kind="train", model=str(base), train=RECIPE)
    run_job(job, 1)
    assert "LoRA: the frozen base weights are bfloat16, the trainable adapters float32" in notes_of(job)
    steps = [r for r in records(job) if r.get("loss") is not None]
    assert [r["step"] for r in steps] == list(range(1, RECIPE["max_steps"] + 1))
    # One rank, the same batches, the same ops: the same numbers (an fp32 base is off by ~1e-2).
    for r in steps:
        s = r["step"]
        assert r["loss"] == pytest.approx(ref["loss"][s], abs=1e-5), f"step {s}: {r['loss']} vs {ref['loss'][s]}"
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"][s], rel=1e-4), f"grad norm at step {s}"
    # The worker evaluates in micro-batches, the reference in one batch: bf16 sums in another order.
    (evaluation,) = [r for r in records(job) if r.get("kind") == "eval"]
    assert evaluation["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-3)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 3 + 24).reshape(2, 12)).logits.float()


def test_bf16_lora_and_qlora_under_fsdp_keep_their_dtypes_and_export_what_peft_loads(tmp_path: Path) -> None:
    # FSDP2 units mixing a bf16 frozen base with fp32 adapters (and QLoRA's NF4 linears with bf16 norms).
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = save_random_llama(tmp_path / "base-llama", initializer_range=0.1)
    untrained = logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval())
    for method, frozen in (("lora", "bfloat16"), ("qlora", "bfloat16/nf4")):
        train = {**RECIPE, "method": method, "micro_batch": 2, "save_merged": method == "lora"}
        job = write_job(tmp_path / method, kind="train", model=str(base), parallelism={"dp_shard": 2}, train=train)
        run_job(job, 2)
        assert f"LoRA: the frozen base weights are {frozen}, the trainable adapters float32" in notes_of(job)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapted = logits(PeftModel.from_pretrained(model, job / "output").eval())
        assert not torch.allclose(adapted, untrained, atol=1e-3), method  # the adapter learned something
        if method == "lora":
            # Merged into the base as saved (fp32 here), not into the bf16 copy the job trained against.
            merged = AutoModelForCausalLM.from_pretrained(job / "output" / "merged", dtype=torch.float32).eval()
            assert merged.dtype == torch.float32
            assert torch.allclose(logits(merged), adapted, atol=1e-4), float((logits(merged) - adapted).abs().max())
