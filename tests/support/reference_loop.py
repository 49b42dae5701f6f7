"""The plain single-process PyTorch training loop every layout is held to (tests/workers/test_workers_reference*.py).

Written with torch and transformers only; see test_workers_reference.py for what it shares with the worker
(the data) and what it re-implements (the step, the LR schedule).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from support.paths import TINY_LLAMA_CONFIG

GLOBAL_BATCH = 4  # sequences per optimizer step, in every layout


RECIPE: dict[str, Any] = {
    "method": "scratch",
    "precision": "fp32",
    "seq_len": 32,
    "max_steps": 4,
    "learning_rate": 3e-3,
    "warmup_steps": 1,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "eval_every": 4,
    "checkpoint_every": 4,
    "seed": 1234,
}


def reference_lr(step: int, warmup: int, max_steps: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def summed_token_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def inputs_and_labels(blocks: torch.Tensor, trained: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    labels = blocks[:, 1:]
    if trained is not None:
        labels = labels.masked_fill(~trained[:, 1:], -100)
    return blocks[:, :-1], labels


def plain_loop(folder: Path, data: Any, steps: list[torch.Tensor], recipe: dict[str, Any]) -> dict[str, Any]:
    """The plain loop on `data` (a built dataset), step i training on the blocks `steps[i]`: per-step loss, grad
    norm and LR, the final eval loss, and the trained model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    r = recipe
    torch.manual_seed(r["seed"])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=r["learning_rate"], weight_decay=r["weight_decay"], betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: reference_lr(s, r["warmup_steps"], r["max_steps"])
    )
    out: dict[str, Any] = {"loss": {}, "grad_norm": {}, "lr": {}}
    for step, picked in enumerate(steps, start=1):
        trained = None if data.train_trained is None else data.train_trained[picked]
        inputs, labels = inputs_and_labels(data.train[picked], trained)
        optimizer.zero_grad(set_to_none=True)
        out["lr"][step] = schedule.get_last_lr()[0]
        loss = summed_token_loss(model, inputs, labels) / (labels != -100).sum().clamp(min=1)
        loss.backward()
        out["grad_norm"][step] = float(torch.nn.utils.clip_grad_norm_(params, r["grad_clip"]))
        optimizer.step()
        schedule.step()
        out["loss"][step] = float(loss.detach())
    model.eval()
    with torch.no_grad():
        inputs, labels = inputs_and_labels(data.eval, data.eval_trained)
        out["eval_loss"] = float(summed_token_loss(model, inputs, labels) / (labels != -100).sum())
    out["eval_blocks"] = len(data.eval)
    out["model"] = model
    return out


def reference_run(dataset: Path, eval_fraction: float) -> dict[str, Any]:
    """Per-step loss, grad norm and LR, and the final eval loss, of the plain loop."""
    from transformers import AutoTokenizer

    from rigpilot.engine.workers.data import ShardedBatches, build_dataset, read_dataset

    r = RECIPE
    folder = TINY_LLAMA_CONFIG.parent
    tokenizer = AutoTokenizer.from_pretrained(folder)
    files, docs = read_dataset([str(dataset)], "text")
    data = build_dataset(files, docs, tokenizer, r["seq_len"] + 1, eval_fraction, r["seed"], train_on_prompts=False)
    order = ShardedBatches(len(data.train), GLOBAL_BATCH, 0, 1, r["seed"])
    assert order.batches_per_epoch >= r["max_steps"]  # no epoch boundary: every layout cuts the same chunks
    return plain_loop(folder, data, [order.next_indices() for _ in range(r["max_steps"])], r)
