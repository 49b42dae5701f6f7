"""What CPU offload costs in training speed: the same job with and without FSDP2's CPUOffloadPolicy.

    .venv/bin/python benchmarks/offload_cost.py [--steps 30] [--ranks 2] [--seq-len 64]

Runs the tiny example Llama (examples/models/tiny-llama, from scratch, fp32,
Shakespeare) under torchrun twice on CPU ranks, dp_shard=RANKS, once plain and
once with `cpu_offload`, and prints steps/s of each (median step time from the
workers' own metrics, the first steps left out as warm-up) side by side with
the ratio. On CPU ranks the offload copies are CPU-to-CPU, so the figure is
the policy's bookkeeping overhead, not the PCIe traffic a GPU run pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WARMUP_STEPS = 3


def run(root: Path, name: str, ranks: int, steps: int, seq_len: int, offload: bool) -> tuple[float, float]:
    """(steps/s over the measured steps, wall seconds of the whole job)."""
    from rigpilot.engine.jobspec.spec import JobSpec

    job = root / name
    JobSpec.from_dict({
        "id": name,
        "kind": "train",
        "model": str(REPO / "examples" / "models" / "tiny-llama" / "config.json"),
        "parallelism": {"dp_shard": ranks, "cpu_offload": offload},
        "train": {
            "dataset": [str(REPO / "examples" / "data" / "shakespeare.txt")],
            "method": "scratch", "precision": "fp32", "seq_len": seq_len, "micro_batch": 2, "grad_accum": 1,
            "max_steps": steps, "learning_rate": 1e-3, "warmup_steps": 1, "eval_every": 0, "checkpoint_every": 0,
            "seed": 1234,
        },
    }).write(job)  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", RIGPILOT_METRICS_DIR=str(job / "metrics"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "-m", "rigpilot.engine.workers", str(job)], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in (job / "metrics" / "rank0.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in recs if r.get("step_time") is not None and r["step"] > WARMUP_STEPS]
    return 1.0 / statistics.median(times), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain, plain_wall = run(root, "plain", args.ranks, args.steps, args.seq_len, offload=False)
        off, off_wall = run(root, "offload", args.ranks, args.steps, args.seq_len, offload=True)
    print(f"tiny Llama, {args.ranks} CPU ranks, dp_shard={args.ranks}, {args.steps} steps, seq_len {args.seq_len}")
    print(f"{'':>12} {'steps/s':>10} {'job wall s':>11}")
    print(f"{'FSDP2':>12} {plain:>10.2f} {plain_wall:>11.1f}")
    print(f"{'FSDP2 + off':>12} {off:>10.2f} {off_wall:>11.1f}")
    print(f"offload / plain steps/s: {off / plain:.2f}")


if __name__ == "__main__":
    main()
