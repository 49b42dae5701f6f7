"""torch.compile on CPU ranks: compiled vs eager steps/s, and Rigpilot's compiled step vs a plain compiled loop.

    .venv/bin/python benchmarks/compile_speed.py [--steps 30] [--warmup 5] [--rounds 3] [--seq 256]
                             [--micro-batch 2] [--layers 2] [--hidden 256] [--ranks 1]
                             [--loops engine,engine-compiled,plain-compiled,plain-whole]

One torchrun of --ranks CPU ranks (gloo, fp32, DDP when more than one, OMP_NUM_THREADS=1) runs every loop in the same processes,
round after round, the order rotated each round so drift favours none; dynamo's in-memory caches are reset
before each loop so every compiled loop pays its own warm-up (inductor's on-disk cache, the user's
~/.cache/rigpilot/torchinductor, is shared: a kernel compiled once is loaded after, so the first round's first
compiled loop shows the cold warm-up and the others a warm cache's):

  engine           the engine's own training loop (engine.workers.train.Trainer: setup, then run) in eager
                   mode, with all it does in a job (metric records, the log line, the cancel consensus);
  engine-compiled  the same with `compile` on: each transformer block compiled in place
                   (engine.workers.compile.apply_compile);
  plain-compiled   what a user writes following torchtune: each decoder layer `.compile()`d in place, then
                   DDP where there are ranks to sync, cross-entropy, backward, clip_grad_norm_, AdamW,
                   LambdaLR, and rank 0 printing the loss every 10 steps;
  plain-whole      the same loop with the whole model under torch.compile (one graph with the head).

The model: examples/models/tiny-llama's tokenizer and shape with --layers blocks of width --hidden
(intermediate 2x), seeded from scratch; examples/data/shakespeare.txt in --seq token blocks.
Steady steps/s = (steps - warmup) / (time of the last step - time of step `warmup`), and beside it 1 / the
median step time after warm-up, which bursts of other work on shared cores move less; each the median over
the rounds (min..max). Warm-up = the first step's seconds (for the engine's compiled loop, from when its loop
starts: its record's compile_time leaves out the set-up before). Losses are compared too: every loop trains
on the same blocks in the same order.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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

LOOPS = ("engine", "engine-compiled", "plain-compiled", "plain-whole")
SEED = 1234
LR = 3e-3
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0


def model_folder(work: Path, args: argparse.Namespace) -> Path:
    folder = work / "model"
    shutil.copytree(TINY_LLAMA.parent, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  max_position_embeddings=max(config["max_position_embeddings"], 2 * args.seq))  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def job_spec(args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    return {
        "id": "compile-speed", "kind": "train", "name": "compile-speed", "model": str(Path(args.work) / "model" / "config.json"),
        "gpus": list(range(args.ranks)), "simulated": True, "parallelism": {"dp_replicate": args.ranks},
        "env": {"HF_HUB_OFFLINE": "1"},
        "train": {"dataset": [str(SHAKESPEARE)], "method": "scratch", "max_steps": args.steps, "seq_len": args.seq,
                  "micro_batch": args.micro_batch, "eval_every": 0, "eval_fraction": 0.0, "checkpoint_every": 0,
                  "warmup_steps": 0, "precision": "fp32", "learning_rate": LR, "weight_decay": WEIGHT_DECAY,
                  "grad_clip": GRAD_CLIP, "seed": SEED, "compile": compiled},
    }  # fmt: skip


# --- inside each rank -----------------------------------------------------------------------------


def run_engine(args: argparse.Namespace, rt: Any, compiled: bool) -> dict[str, Any]:
    from rigpilot.engine.jobspec.spec import JobSpec

    spec = JobSpec.from_dict(job_spec(args, compiled))
    started, ordered = engine_loop(spec, rt, Path(args.work) / f"engine-{compiled}")
    times = [r["time"] for r in ordered]
    return {"times": times, "losses": [r["loss"] for r in ordered], "warmup_s": times[0] - started,
            "compile_time": ordered[0].get("compile_time")}  # fmt: skip


def run_plain(args: argparse.Namespace, config: Any, blocks: Any, order: list[int], whole: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)  # as the engine builds a scratch model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if not whole:
        for layer in model.model.layers:
            layer.compile()
    called: Any = DistributedDataParallel(model) if dist.get_world_size() > 1 else model
    if whole:
        called = torch.compile(called)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95))
    schedule = lambda step: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, args.steps))))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    loader = DataLoader(TensorDataset(blocks), batch_size=args.micro_batch, sampler=order)
    model.train()
    times, losses = [], []
    started = time.time()
    for step, (block,) in enumerate(loader):
        inputs, labels = block[:, :-1], block[:, 1:]
        logits = called(input_ids=inputs, use_cache=False).logits
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
    t = torch.stack(losses).double()
    dist.all_reduce(t)
    return {"times": times, "losses": (t / dist.get_world_size()).tolist(), "warmup_s": times[0] - started}


def rank_main(args: argparse.Namespace) -> None:
    import torch._dynamo

    from rigpilot.engine.jobspec.spec import JobSpec
    from rigpilot.engine.workers.compile import private_inductor_cache
    from rigpilot.engine.workers.data import ShardedBatches, build_dataset, read_dataset
    from rigpilot.engine.workers.model_loading import load_config, load_tokenizer, resolve_source
    from rigpilot.engine.workers.parallel_dims import init_runtime

    spec = JobSpec.from_dict(job_spec(args, False))
    s = spec.train
    rt = init_runtime(spec)
    private_inductor_cache()  # the plain loops compile into the same cache as the engine's
    source = resolve_source(spec.model)
    config, tokenizer = load_config(source, spec), load_tokenizer(source, spec)
    files, docs = read_dataset(s.dataset, s.text_field)
    data = build_dataset(files, docs, tokenizer, s.seq_len + 1, s.eval_fraction, s.seed)
    sampler = ShardedBatches(len(data.train), s.micro_batch, rt.rank, rt.world_size, s.seed)
    order = [i for _ in range(s.max_steps) for i in sampler.next_indices().tolist()]

    def run(name: str, _round: int) -> dict[str, Any]:
        torch._dynamo.reset()  # every compiled loop pays its own warm-up
        if name.startswith("engine"):
            return run_engine(args, rt, compiled=name == "engine-compiled")
        return run_plain(args, config, data.train, order, whole=name == "plain-whole")

    finish_ranks(run_rounds(args.loops.split(","), args.rounds, run, args.warmup), Path(args.work))


# --- the launcher ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=1)
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
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rpcompile") as tmp:
        work = Path(tmp)
        model_folder(work, args)
        argv = forwarded(args, "steps", "warmup", "rounds", "seq", "micro_batch", "layers", "hidden", "ranks", "loops")
        # One thread per rank, as torchrun sets for several: threads spinning in OpenMP barriers on cores other
        # work shares made one rank's steps 10-20 times slower in some rounds than in others.
        threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        t0 = time.monotonic()
        results = launch_ranks(__file__, args.ranks, work, argv, threads)
    print(f"{args.ranks} CPU rank(s) (gloo, fp32), Llama {args.layers} layers x {args.hidden}, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, {args.steps} steps ({args.warmup} warm-up), {args.rounds} rounds, "
          f"{time.monotonic() - t0:.0f} s; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")  # fmt: skip
    for key, what in (("rate", "steady steps/s (wall clock)"), ("typical", "1 / median step time")):
        print(f"{what}: median over rounds (min..max)")
        rates = {name: [r[key] for r in runs] for name, runs in results.items()}
        for name, values in rates.items():
            print(f"  {name:16s} {spread(values, 3)}")
        a = "engine-compiled"
        for b in ("engine", "plain-compiled", "plain-whole"):
            if a in rates and b in rates:
                per_round = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
                target = "" if b == "engine" else "  (target >= 1.0)"
                print(f"  {a} / {b:14s} {statistics.median(rates[a]) / statistics.median(rates[b]):.3f}  "
                      f"(per round {min(per_round):.3f}..{max(per_round):.3f}){target}")  # fmt: skip
    print("first step, seconds: each round (the first round's first compiled loop compiles with a colder cache)")
    for name, runs in results.items():
        print(f"  {name:16s} " + "  ".join(f"{r['warmup_s']:.1f}" for r in runs))
    names = list(results)
    reference = results[names[0]][0]["losses"]
    for name in names[1:]:
        gap = max(abs(a - b) for run in results[name] for a, b in zip(run["losses"], reference, strict=False))
        print(f"loss check: {name:16s} largest difference from {names[0]}'s step losses: {gap:.2e}")


if __name__ == "__main__":
    main()
