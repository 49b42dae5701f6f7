"""Submit-to-first-step latency: the engine with its warm worker, without it, and plain torchrun, with phases.

    .venv/bin/python benchmarks/engine_latency.py [--runs 3] [--ranks 2] [--steps 3]

One job, a few steps of DDP training on the tiny example Llama over CPU
ranks, run three ways in alternating rounds (the order rotates each round):

- engine, warm: a fresh engine service whose warm worker (engine.launch.warm)
  is ready; its ranks are forked from it with torch and transformers imported.
- engine, cold: the same with RIGPILOT_WARM_WORKER=0 (every rank a new interpreter).
- torchrun: `python -m torch.distributed.run --standalone --nproc-per-node N
  -m rigpilot.engine.workers JOB_DIR`, the same worker and job without the engine.

Times are from sending `submit` (or starting torchrun) to the time stamp of
rank 0's first step record; the phases come from rank 0's status records
(engine.workers reports them) and, in the engine, the rank's launch record.
Medians over the runs, and each run's ratio to the torchrun run of its round.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_common import REPO, scratch_engine

TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"
PHASES = ("launching", "import torch", "import transformers", "loading weights", "first step")


def job_spec(ranks: int, steps: int) -> dict[str, Any]:
    return {
        "kind": "train", "model": str(TINY_LLAMA), "gpus": list(range(ranks)),
        "parallelism": {"dp_replicate": ranks},
        "train": {
            "dataset": [str(SHAKESPEARE)], "method": "scratch", "precision": "fp32", "seq_len": 32,
            "micro_batch": 2, "grad_accum": 1, "max_steps": steps, "learning_rate": 1e-2, "seed": 1234,
            "checkpoint_every": 0,
        },
    }  # fmt: skip


def phases(t0: float, records: list[dict[str, Any]], rank_started: float | None) -> dict[str, float | None]:
    """Seconds per start-up phase, from rank 0's records; `rank_started`: when rankexec ran (engine only)."""
    marks: dict[str, float] = {}
    for r in records:
        t = r.get("time")
        if r.get("kind") == "status" and r.get("phase") == "importing":
            marks.setdefault(f"import {r.get('module')}", t)
        elif r.get("kind") == "status" and r.get("phase") == "loading model":
            marks.setdefault("loading weights", t)
        elif r.get("kind") == "status" and r.get("phase") in ("training", "generating", "calibrating"):
            marks.setdefault("first step", t)
        elif r.get("kind") is None and isinstance(r.get("step"), int):
            marks.setdefault("stepped", t)
    order = [("launching", t0), *((p, marks.get(p)) for p in PHASES[1:]), ("end", marks.get("stepped"))]
    out: dict[str, float | None] = {}
    for (name, start), (_, end) in itertools.pairwise(order):
        out[name] = end - start if start is not None and end is not None else None
    out["total"] = marks["stepped"] - t0 if "stepped" in marks else None
    out["torchrun+rendezvous"] = rank_started - t0 if rank_started is not None else None
    return out


def read_records(metrics: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def wait_first_step(metrics: Path, timeout: float = 300) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_records(metrics)
        if any(r.get("kind") is None and isinstance(r.get("step"), int) for r in records):
            return records
        time.sleep(0.02)
    raise RuntimeError(f"no first step in {metrics} within {timeout} s")


def engine_run(spec: dict[str, Any], warm: bool) -> dict[str, float | None]:
    from rigpilot.engine.api.client import EngineClient

    os.environ["RIGPILOT_WARM_WORKER"] = "1" if warm else "0"
    with scratch_engine() as (_, root):
        if warm:
            deadline = time.monotonic() + 120
            while not list((root / "r").rglob("warm.sock")):
                if time.monotonic() > deadline:
                    raise RuntimeError("the warm worker was not ready within 120 s")
                time.sleep(0.1)
        time.sleep(1.0)  # let the just-started service and warm worker settle, as an engine that waited would be
        with EngineClient(autostart=False, timeout=60) as c:
            t0 = time.time()
            job = c.request("submit", spec=spec)["job"]
            job_dir = Path(job["job_dir"])
            records = wait_first_step(job_dir / "metrics" / "rank0.jsonl")
            state = json.loads((job_dir / "ranks" / "rank0.json").read_text())
            if bool(state.get("warm")) != warm:
                raise RuntimeError(f"rank 0 {'did not use' if warm else 'used'} the warm worker")
            c.request("cancel", job=job["id"])
    return phases(t0, records, state.get("started"))


def torchrun_run(spec: dict[str, Any]) -> dict[str, float | None]:
    from rigpilot.engine.jobspec.spec import JobSpec

    with tempfile.TemporaryDirectory(prefix="rplat") as tmp:
        job_dir = Path(tmp) / "job"
        JobSpec.from_dict({"id": "bench", **{k: v for k, v in spec.items() if k != "gpus"}}).write(job_dir)
        env = dict(os.environ, RIGPILOT_METRICS_DIR=str(job_dir / "metrics"), PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
                   OMP_NUM_THREADS=str(max(1, len(os.sched_getaffinity(0)) // len(spec["gpus"]))))  # fmt: skip
        env.pop("RIGPILOT_WARM_SOCKET", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(spec['gpus'])}",
               "-m", "rigpilot.engine.workers", str(job_dir)]  # fmt: skip
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=job_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            records = wait_first_step(job_dir / "metrics" / "rank0.jsonl")
        finally:
            proc.terminate()
            proc.wait(60)
    return phases(t0, records, None)


def fmt(v: float | None) -> str:
    return f"{v:6.2f}" if v is not None else "     -"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    spec = job_spec(args.ranks, args.steps)
    ways = {"engine, warm": lambda: engine_run(spec, True), "engine, cold": lambda: engine_run(spec, False),
            "torchrun": lambda: torchrun_run(spec)}  # fmt: skip
    names = list(ways)
    results: dict[str, list[dict[str, float | None]]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min load average, {os.cpu_count()} CPUs)", flush=True)
    for i in range(args.runs):
        order = names[i % 3 :] + names[: i % 3]
        round_: dict[str, dict[str, float | None]] = {}
        for name in order:
            round_[name] = ways[name]()
            results[name].append(round_[name])
            print(f"  round {i + 1}: {name:13} {fmt(round_[name]['total'])} s", flush=True)
        base = round_["torchrun"]["total"]
        for name in names:
            total = round_[name]["total"]
            if base and total:
                ratios[name].append(total / base)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"\nsubmit → first step, train job (tiny Llama, DDP over {args.ranks} CPU ranks), medians of {args.runs} runs (s):")
    columns = ["total", "torchrun+rendezvous", *PHASES]
    widths = [max(len(c), 6) + 2 for c in columns]
    print(f"{'':14}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)) + f"{'× torchrun':>12}{'spread':>13}")
    for name in names:
        row = f"{name:14}"
        for c, w in zip(columns, widths, strict=True):
            values = [r[c] for r in results[name] if r.get(c) is not None]
            row += f"{fmt(statistics.median(values)) if values else fmt(None):>{w}}"
        rs = ratios[name]
        spread = f"{min(rs):.2f}–{max(rs):.2f}" if rs else "-"
        row += f"{statistics.median(rs):>12.2f}{spread:>13}" if rs else ""
        print(row)
    print("\nphases: launching = submit until rank 0 reports (torchrun, rendezvous, the rank's interpreter);"
          " import torch / transformers = the worker's imports (≈0 when forked warm); loading weights = model,"
          " data and process group until the loop; first step = the first optimizer step.")  # fmt: skip


if __name__ == "__main__":
    main()
