"""The optimizer state in host memory (`--optimizer-offload`, engine.workers.optimizer_offload): a step with it
is the plain AdamW step written here (gradient accumulation and clipping on, fp32 and pure bf16), bit for bit;
its state checkpoints through DCP and resumes bit for bit; a job trains the plain loop's model and resumes as an
unbroken run; the combinations the engine does not run are refused in one line before a job is created.

On CPU ranks the "device" is host memory too: the copies are plain copies, the code path is CUDA's without the
side stream (the CUDA path runs where a GPU is lent)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs.submission import prepare
from rigpilot.engine.workers.optimizer_offload import MIN_OFFLOAD_NUMEL, HostOffloadedOptimizer

from support.paths import SHAKESPEARE, TINY_LLAMA_CONFIG
from support.reference_loop import reference_lr
from support.worker_jobs import losses, records, resume_from, run_job, write_job

LR, BETAS, WD, CLIP, ACCUM = 3e-3, (0.9, 0.95), 0.1, 0.05, 2


def tiny(dtype: torch.dtype) -> nn.Module:
    """Two linears above the offload threshold (host AdamW) and a norm and biases below it (device AdamW)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 160), nn.LayerNorm(160), nn.GELU(), nn.Linear(160, 32)).to(dtype)
    assert sum(p.numel() >= MIN_OFFLOAD_NUMEL for p in model.parameters()) == 2
    return model


def batches(dtype: torch.dtype, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(4, 32, generator=g).to(dtype), torch.randn(4, 32, generator=g).to(dtype))
             for _ in range(ACCUM)] for _ in range(steps)]  # fmt: skip


def lr_at(step: int) -> float:
    return reference_lr(step, 1, 6)


def run_steps(model: nn.Module, opt: Any, scheds: list[Any], data: list, clip: Any) -> list[float]:
    norms = []
    for micro in data:
        opt.zero_grad(set_to_none=True)
        for x, y in micro:
            ((model(x).float() - y.float()) ** 2).mean().div(ACCUM).backward()
        norms.append(float(clip()))
        torch.manual_seed(len(norms))  # the same rounding bits for both runs' steps (pure bf16)
        opt.step()
        for s in scheds:
            s.step()
    return norms


class PlainPair:
    """Plain torch.optim.AdamW, the same calls the offloaded step makes: fused CPU AdamW for the large tensors,
    for-each AdamW for the small ones (engine.workers.train's), one clip over every gradient."""

    def __init__(self, model: nn.Module) -> None:
        params = list(model.parameters())
        big = [p for p in params if p.numel() >= MIN_OFFLOAD_NUMEL]
        small = [p for p in params if p.numel() < MIN_OFFLOAD_NUMEL]
        self.params = params
        if params[0].dtype == torch.bfloat16:  # pure bf16: torchao's AdamW, rounding stochastically
            from torchao.optim import _AdamW

            kw = dict(lr=LR, betas=BETAS, weight_decay=WD, bf16_stochastic_round=True)
            # The small tensors' step first, as the offloaded step queues it: both draw their rounding bits in turn.
            self.opts = [_AdamW(small, **kw), _AdamW(big, **kw)]
            return
        self.opts = [torch.optim.AdamW(big, lr=LR, betas=BETAS, weight_decay=WD, fused=True),
                     torch.optim.AdamW(small, lr=LR, betas=BETAS, weight_decay=WD, foreach=True)]  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def offloaded(model: nn.Module) -> HostOffloadedOptimizer:
    return HostOffloadedOptimizer(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, device=torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "pure-bf16"])
def test_the_offloaded_step_is_plain_adamws_with_accumulation_and_clipping(dtype: torch.dtype) -> None:
    data = batches(dtype, 4)
    plain_model, model = tiny(dtype), tiny(dtype)
    plain = PlainPair(plain_model)
    plain_norms = run_steps(
        plain_model, plain, [torch.optim.lr_scheduler.LambdaLR(o, lr_at) for o in plain.opts], data,
        lambda: torch.nn.utils.clip_grad_norm_(plain.params, CLIP),
    )  # fmt: skip
    opt = offloaded(model)
    norms = run_steps(model, opt, [torch.optim.lr_scheduler.LambdaLR(opt, lr_at)], data,
                      lambda: opt.clip_grad_norm_(CLIP))  # fmt: skip
    assert norms == plain_norms and max(norms) > CLIP  # clipping took effect
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    assert all(p.grad is None for p in opt.host)  # the device gradients left as each was ready
    assert all(s["exp_avg"].dtype == dtype for s in opt.state.values())
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * lr_at(4))


def test_the_host_state_checkpoints_through_dcp_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from rigpilot.engine.workers.checkpoint import _ModelAndOptimizer

    data = batches(torch.float32, 4)
    whole = tiny(torch.float32)
    opt = offloaded(whole)
    run_steps(whole, opt, [], data, lambda: opt.clip_grad_norm_(CLIP))

    first = tiny(torch.float32)
    opt = offloaded(first)
    run_steps(first, opt, [], data[:2], lambda: opt.clip_grad_norm_(CLIP))
    dcp.save({"app": _ModelAndOptimizer(first, [opt], False)}, checkpoint_id=str(tmp_path))
    again = nn.Sequential(nn.Linear(32, 160), nn.LayerNorm(160), nn.GELU(), nn.Linear(160, 32))  # other weights
    opt = offloaded(again)
    dcp.load({"app": _ModelAndOptimizer(again, [opt], False)}, checkpoint_id=str(tmp_path))
    assert {int(s["step"]) for s in opt.state.values()} == {2}
    run_steps(again, opt, [], data[2:], lambda: opt.clip_grad_norm_(CLIP))
    for a, b in zip(whole.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


# -- jobs ------------------------------------------------------------------------------------------------------

JOB: dict[str, Any] = {
    "method": "scratch",
    "precision": "fp32",
    "seq_len": 32,
    "micro_batch": 2,
    "grad_accum": 2,
    "max_steps": 4,
    "learning_rate": 3e-3,
    "warmup_steps": 1,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "eval_every": 0,
    "checkpoint_every": 2,
    "eval_fraction": 0.01,
    "seed": 1234,
    "optimizer_offload": True,
    "dataset": [str(SHAKESPEARE)],
}


def plain_job_loop(steps: int) -> list[float]:
    """torch and transformers only: the worker's data, the tiny Llama, plain AdamW (fused on the CPU for the
    tensors the job offloads), accumulation over two micro-batches and clipping."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rigpilot.engine.workers.data import ShardedBatches, build_dataset, read_dataset

    r = JOB
    folder = TINY_LLAMA_CONFIG.parent
    files, docs = read_dataset([str(SHAKESPEARE)], "text")
    data = build_dataset(files, docs, AutoTokenizer.from_pretrained(folder), r["seq_len"] + 1, r["eval_fraction"],
                         r["seed"], train_on_prompts=False)  # fmt: skip
    order = ShardedBatches(len(data.train), r["micro_batch"] * r["grad_accum"], 0, 1, r["seed"])
    torch.manual_seed(r["seed"])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.train()
    params = list(model.parameters())
    big = [p for p in params if p.numel() >= MIN_OFFLOAD_NUMEL]
    small = [p for p in params if p.numel() < MIN_OFFLOAD_NUMEL]
    kw = dict(lr=r["learning_rate"], weight_decay=r["weight_decay"], betas=(0.9, 0.95))
    opts = [torch.optim.AdamW(big, fused=True, **kw), torch.optim.AdamW(small, foreach=True, **kw)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: reference_lr(s, r["warmup_steps"], steps)) for o in opts]
    out = []
    for _ in range(steps):
        picked = order.next_indices()
        blocks = data.train[picked]
        inputs, labels = blocks[:, :-1], blocks[:, 1:]
        for o in opts:
            o.zero_grad(set_to_none=True)
        total = (labels != -100).sum()
        step_loss = 0.0
        for chunk in range(r["grad_accum"]):
            part = slice(chunk * r["micro_batch"], (chunk + 1) * r["micro_batch"])
            logits = model(input_ids=inputs[part], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels[part].flatten(), reduction="sum") / total
            loss.backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, r["grad_clip"])
        for o, s in zip(opts, scheds, strict=True):
            o.step()
            s.step()
        out.append(step_loss)
    return out


@pytest.mark.slow
def test_a_job_trains_the_plain_loops_model_and_resumes_as_an_unbroken_run(tmp_path: Path) -> None:
    job = write_job(tmp_path / "whole", kind="train", model=str(TINY_LLAMA_CONFIG), train=JOB)
    run_job(job, 1)
    steps = [r for r in records(job) if r.get("loss") is not None]
    assert [r["loss"] for r in steps] == pytest.approx(plain_job_loop(JOB["max_steps"]), abs=1e-6)
    notes = [r.get("message", "") for r in records(job) if r.get("kind") == "note"]
    assert any(n.startswith("optimizer state in host memory:") and "fused CPU AdamW" in n for n in notes), notes
    again = resume_from(job, 2)
    assert losses(again) == {s: v for s, v in losses(job).items() if s > 2}


@pytest.mark.parametrize(
    ("train", "parallelism", "said"),
    [
        ({}, {"dp_replicate": 2},
         "the optimizer state in host memory runs on one GPU; with several, shard it with FSDP2 (CPU offload) instead"),
        ({}, {"cpu_offload": True},
         "CPU offload already keeps the optimizer state in host memory: use one or the other"),
        ({"optimizer_in_backward": True, "grad_accum": 1, "grad_clip": 0.0}, {},
         "the optimizer state in host memory already steps each weight apart on the CPU: "
         "drop the optimizer step in backward"),
        ({"optimizer": "adamw8bit"}, {},
         "8-bit AdamW runs on the GPU; with the optimizer state in host memory the step is CPU AdamW"),
        ({"precision": "fp16"}, {}, "the optimizer state in host memory cannot run under fp16's loss scaling: use bf16"),
    ],
    ids=["two-ranks", "cpu-offload", "in-backward", "adamw8bit", "fp16"],
)
def test_what_the_engine_does_not_run_is_refused_in_one_line_at_submission(
    tmp_path: Path, train: dict[str, Any], parallelism: dict[str, Any], said: str
) -> None:
    """`rigpilot run train --optimizer-offload …` (its job, as the CLI sends it) is refused before a job exists."""
    profile = "4x-rtx4090" if parallelism.get("dp_replicate") else "1x-rtx4090"
    job = {"kind": "train", "model": str(TINY_LLAMA_CONFIG), "parallelism": parallelism,
           "train": {**JOB, **train}}  # fmt: skip
    with pytest.raises(UserError) as e:
        prepare(job, None, str(tmp_path), job_id="refused", machine=load_profile(profile), max_cpu_ranks=2)
    assert str(e.value) == said
    assert not any(tmp_path.iterdir())


def test_the_traced_step_leaves_the_host_tensors_off_the_gpu_and_agrees_with_the_formula(tmp_path: Path) -> None:
    """The memory tracer runs the worker's optimizer: the gradients leave as backward makes them, the master copies,
    gradient buffers and state are filed as host memory, and what is left on the GPU is the formula's figure."""
    import json

    from rigpilot.engine.models.describe import describe_model
    from rigpilot.engine.planner.plan import Workload
    from rigpilot.engine.planner.search import search
    from rigpilot.engine.workers.memtrace import trace_plan

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
              "intermediate_size": 1536, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 256, "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    traced = {}
    for offload in (False, True):
        w = Workload(model=str(tmp_path), seq_len=32, global_batch=1, master_weights="bf16", optimizer="adamw",
                     optimizer_in_backward=False, loss_chunks=1, activation_offload=False, optimizer_offload=offload)
        best = search(describe_model(str(tmp_path)), load_profile("1x-rtx4090"), w).best
        assert best is not None and best.workload.optimizer_offload is offload
        m = best.memory[0]
        traced[offload] = trace_plan(best.to_dict())["peak"], m.total - m.overhead
    (plain, _), (moved, formula) = traced[False], traced[True]
    assert moved < 0.35 * plain  # the weights stay; gradients and AdamW state leave
    assert moved == pytest.approx(formula, rel=0.05)
