"""Training loop speed: Rigpilot's loop beside a plain PyTorch DDP loop, Accelerate and HF Trainer, same job.

    .venv/bin/python benchmarks/training_speed.py [--steps 60] [--warmup 10] [--rounds 3] [--seq 128]
                             [--micro-batch 4] [--ranks 2] [--loops engine,plain,accelerate,trainer]

One torchrun of --ranks CPU ranks (gloo, DDP, fp32, OMP_NUM_THREADS=1 as torchrun sets it) runs every
loop in the same processes, round after round, the order rotated each round so drift favours none:

  engine      the engine's own training loop (rigpilot.engine.workers.train.Trainer: setup, then run),
              with everything it does in a job: metric records written to the rank's metrics file,
              rank 0's log line, the cancellation consensus; no eval, no checkpoints;
  plain       what a user writes with torch and transformers: DDP(model), a DataLoader over the
              token blocks, cross-entropy, backward, clip_grad_norm_, AdamW, LambdaLR, and rank 0
              printing the loss every 10 steps;
  accelerate  the same loop through Hugging Face Accelerate: Accelerator().prepare(model, optimizer,
              dataloader), accelerator.backward, accelerator.clip_grad_norm_;
  trainer     Hugging Face Trainer (train_sampling_strategy="sequential" over the same order, its
              defaults otherwise: logging every 10 steps, tokens averaged across devices), given
              the same AdamW and LR schedule; its loss is the model's own (labels, shift_labels).

The job: the tiny Llama of examples/models/tiny-llama from scratch (the same seeded initial weights
in every loop), examples/data/shakespeare.txt tokenized once before any loop runs (the engine
tokenizes it again in its untimed set-up), seq_len --seq, --micro-batch sequences per rank per
step, AdamW (betas 0.9/0.95, weight decay 0.1), grad clipping at 1.0, warmup + cosine LR. Every
loop sees the same blocks in the same order (the engine's seeded sampler), so their losses must
agree: the script prints the largest difference from the engine's loss over all steps (Trainer logs
10-step means, compared with the engine's means over the same steps).

Steady steps/s of a run = (steps - warmup) / (time of the last step - time of step `warmup`), on
rank 0 (DDP keeps the ranks in step); the engine's step times are its metric records' timestamps.
Step times of Trainer come from a callback's on_step_end. Beside it, 1 / the median step time after
warm-up, which bursts of other work on shared cores move less. Printed for both: each loop's median
over the rounds with min..max, and the ratio of the engine's median to each other loop's (target
>= 1.0), with the range and median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_common import (
    SHAKESPEARE,
    TINY_LLAMA,
    engine_loop,
    finish_ranks,
    forwarded,
    launch_ranks,
    run_rounds,
    spread,
)

LOOPS = ("engine", "plain", "accelerate", "trainer")
SEED = 1234
LR = 3e-3
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0


def job_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "id": "training-speed", "kind": "train", "name": "training-speed", "model": str(TINY_LLAMA), "gpus": list(range(args.ranks)),
        "simulated": True, "parallelism": {"dp_replicate": args.ranks}, "env": {"HF_HUB_OFFLINE": "1"},
        "train": {"dataset": [str(SHAKESPEARE)], "method": "scratch", "max_steps": args.steps, "seq_len": args.seq,
                  "micro_batch": args.micro_batch, "eval_every": 0, "eval_fraction": 0.0, "checkpoint_every": 0,
                  "warmup_steps": 0, "precision": "fp32", "learning_rate": LR, "weight_decay": WEIGHT_DECAY,
                  "grad_clip": GRAD_CLIP, "seed": SEED},
    }  # fmt: skip


# --- inside each rank -----------------------------------------------------------------------------


def run_engine(spec: Any, rt: Any, work: Path, tag: str) -> tuple[list[float], list[float]]:
    _, ordered = engine_loop(spec, rt, work / tag)
    return [r["time"] for r in ordered], [r["loss"] for r in ordered]


def fresh_model(config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)  # as the engine builds a scratch model
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def lr_factor(max_steps: int) -> Any:
    import math

    # The engine's schedule with no warmup: cosine from the peak down to a tenth of it.
    return lambda step: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, max_steps))))


def world_losses(losses: list[Any]) -> list[float]:
    """Each step's global loss: the mean of the ranks' local means (every rank has the same token count)."""
    import torch
    import torch.distributed as dist

    t = torch.stack(losses).double()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def run_plain(config: Any, blocks: Any, order: list[int], args: argparse.Namespace) -> tuple[list[float], list[float]]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    model = DistributedDataParallel(fresh_model(config))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(args.steps))
    loader = DataLoader(TensorDataset(blocks), batch_size=args.micro_batch, sampler=order)
    model.train()
    times, losses = [], []
    for step, (block,) in enumerate(loader):
        inputs, labels = block[:, :-1], block[:, 1:]
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        times.append(time.time())
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"plain step {step + 1} loss {loss.item():.4f}", flush=True)
    return times, world_losses(losses)


def run_accelerate(
    config: Any, blocks: Any, global_order: list[int], args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    # The scheduler is stepped by hand once per step: prepared, Accelerate would step it once per process.
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    model = fresh_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(args.steps))
    # Accelerate deals the batches of one loader round-robin to the processes: given the global order,
    # process r gets exactly the engine's rank-r batches.
    loader = DataLoader(TensorDataset(blocks), batch_size=args.micro_batch, sampler=global_order)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    times, losses = [], []
    for step, (block,) in enumerate(loader):
        inputs, labels = block[:, :-1], block[:, 1:]
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        times.append(time.time())
        if accelerator.is_main_process and step % 10 == 0:
            accelerator.print(f"accelerate step {step + 1} loss {loss.item():.4f}")
    accelerator.free_memory()
    return times, world_losses(losses)


def run_trainer(
    config: Any, blocks: Any, global_order: list[int], args: argparse.Namespace, work: Path
) -> tuple[list[float], list[float]]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    times: list[float] = []
    logged: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            times.append(time.time())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs and "loss" in logs:
                logged.append(logs["loss"])

    model = fresh_model(config)
    model.config.use_cache = False
    # The global order laid out in a row: Trainer deals its batches round-robin as Accelerate does.
    rows = [{"input_ids": blocks[i, :-1], "labels": blocks[i, :-1], "shift_labels": blocks[i, 1:]} for i in global_order]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(args.steps))
    training = TrainingArguments(
        output_dir=str(work / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        max_grad_norm=GRAD_CLIP, logging_steps=10, save_strategy="no", report_to="none", use_cpu=True,
        train_sampling_strategy="sequential", remove_unused_columns=False, disable_tqdm=True, seed=SEED,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training, train_dataset=rows, optimizers=(optimizer, scheduler), callbacks=[Clock()])
    trainer.train()
    return times, logged


def rank_main(args: argparse.Namespace) -> None:
    from rigpilot.engine.jobspec.spec import JobSpec
    from rigpilot.engine.workers.data import ShardedBatches, build_dataset, read_dataset
    from rigpilot.engine.workers.model_loading import load_config, load_tokenizer, resolve_source
    from rigpilot.engine.workers.parallel_dims import init_runtime

    spec = JobSpec.from_dict(job_spec(args))
    s = spec.train
    rt = init_runtime(spec)
    source = resolve_source(spec.model)
    config, tokenizer = load_config(source, spec), load_tokenizer(source, spec)
    files, docs = read_dataset(s.dataset, s.text_field)
    data = build_dataset(files, docs, tokenizer, s.seq_len + 1, s.eval_fraction, s.seed)
    samplers = [ShardedBatches(len(data.train), s.micro_batch, r, rt.world_size, s.seed) for r in range(rt.world_size)]
    per_rank: list[list[int]] = [[] for _ in samplers]
    for _ in range(s.max_steps):
        for r, sampler in enumerate(samplers):
            per_rank[r] += sampler.next_indices().tolist()
    global_order = [i for step in range(s.max_steps) for r in range(rt.world_size) for i in
                    per_rank[r][step * s.micro_batch:(step + 1) * s.micro_batch]]  # fmt: skip
    work = Path(args.work)

    def run(name: str, rnd: int) -> dict[str, Any]:
        if name == "engine":
            times, losses = run_engine(spec, rt, work, f"engine-{rnd}")
        elif name == "plain":
            times, losses = run_plain(config, data.train, per_rank[rt.rank], args)
        elif name == "trainer":
            times, losses = run_trainer(config, data.train, global_order, args, work)
        else:
            times, losses = run_accelerate(config, data.train, global_order, args)
        return {"times": times, "losses": losses}

    finish_ranks(run_rounds(args.loops.split(","), args.rounds, run, args.warmup), work)


# --- the launcher ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    unknown = set(args.loops.split(",")) - set(LOOPS)
    if unknown or not 0 < args.warmup < args.steps:
        sys.exit(f"--loops takes {', '.join(LOOPS)}; --warmup must be between 1 and --steps - 1")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rptrain") as tmp:
        argv = forwarded(args, "steps", "warmup", "rounds", "seq", "micro_batch", "ranks", "loops")
        results = launch_ranks(__file__, args.ranks, Path(tmp), argv)
    print(f"{args.ranks} CPU ranks (gloo, DDP, fp32), tiny Llama, seq {args.seq}, micro-batch {args.micro_batch}, "
          f"{args.steps} steps ({args.warmup} warm-up), {args.rounds} rounds, {time.monotonic() - t0:.0f} s; "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    for key, what in (("rate", "steady steps/s (wall clock)"), ("typical", "1 / median step time")):
        print(f"{what}: median over rounds (min..max)")
        rates = {name: [r[key] for r in runs] for name, runs in results.items()}
        for name, values in rates.items():
            print(f"  {name:12s} {spread(values)}")
        if "engine" not in rates:
            continue
        engine = statistics.median(rates["engine"])
        for name in rates:
            if name != "engine":
                per_round = [e / o for e, o in zip(rates["engine"], rates[name], strict=True)]
                print(f"  engine / {name:10s} {engine / statistics.median(rates[name]):.3f}  "
                      f"(per round {min(per_round):.3f}..{max(per_round):.3f}, median {statistics.median(per_round):.3f})")  # fmt: skip
    if "engine" in results:
        reference = results["engine"][0]["losses"]
        # Trainer logs the mean loss of every 10 steps: compared with the engine's means over the same steps.
        windows = [sum(reference[i : i + 10]) / len(reference[i : i + 10]) for i in range(0, len(reference), 10)]
        for name, runs in results.items():
            against = windows if name == "trainer" else reference
            gaps = [abs(a - b) for run in runs for a, b in zip(run["losses"], against, strict=False)]
            what = "10-step mean losses" if name == "trainer" else "step losses"
            # Under 10 steps Trainer logs no loss: nothing to compare, said so rather than a traceback.
            worst = f"{max(gaps):.2e}" if gaps else "none logged (Trainer logs every 10 steps)"
            print(f"loss check: {name:10s} largest difference from the engine's {what} ({len(against)}): {worst}")


if __name__ == "__main__":
    main()
