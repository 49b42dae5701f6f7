"""Engine overhead: the same small training run through the engine service and as a plain torchrun.

    .venv/bin/python benchmarks/engine_overhead.py [--steps 40] [--warmup 5] [--seq 128] [--ranks 2] [--repeats 1]

The run: the tiny Llama of examples/models/tiny-llama trained from scratch on
examples/data/shakespeare.txt, data parallel (DDP) over CPU ranks, fp32, no
eval or checkpoints. It runs

  engine  submitted to a throwaway engine service (temporary XDG folders,
          RIGPILOT_SIMULATE=4x-rtx4090) through EngineClient, followed to the
          end; the service launches it as it launches every job (torchrun,
          c10d rendezvous, the rankexec wrapper, its tailing of the metrics);
  plain   `python -m torch.distributed.run --standalone --nproc-per-node N
          -m rigpilot.engine.workers JOB_DIR` on a copy of the engine job's job.json,
          with the ranks' environment the service would give them, and no
          service running,

alternately (engine, plain, plain, engine, ... so drift does not favour one),
and prints each one's steady steps per second from the ranks' own metric
records, leaving out the first --warmup steps: (last step - warmup) / (time of
the last step record - time of the warmup step record), the slowest rank's
figure (DDP keeps the ranks in step), beside 1 / the mean reported step_time.
The ratio engine / plain is the engine's cost while a job runs (target >= 0.97).
Submit-to-first-step is the time from sending `submit` to the first step
record reaching the client (engine) or from starting torchrun to the first
step record in the metrics file (plain).
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
from typing import Any

from engine_common import REPO, scratch_engine

TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"


def train_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "kind": "train", "name": "engine-overhead", "model": str(TINY_LLAMA), "gpus": list(range(args.ranks)),
        "env": {"HF_HUB_OFFLINE": "1"},
        "train": {"dataset": [str(SHAKESPEARE)], "method": "scratch", "max_steps": args.steps, "seq_len": args.seq,
                  "micro_batch": args.micro_batch, "eval_every": 0, "checkpoint_every": 0, "warmup_steps": 0,
                  "precision": "fp32"},
    }  # fmt: skip


def step_rate(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Steady steps/s of the slowest rank after `warmup` steps, and 1 / its mean step_time."""
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for r in records:
        if r.get("kind") is None and isinstance(r.get("step"), int) and "step_time" in r:
            by_rank.setdefault(r.get("rank", 0), {})[r["step"]] = r
    rates, timed = [], []
    for steps in by_rank.values():
        last = max(steps)
        if warmup not in steps or last <= warmup:
            raise RuntimeError(f"need more than {warmup} steps to measure (got {last})")
        rates.append((last - warmup) / (steps[last]["time"] - steps[warmup]["time"]))
        timed.append(1 / statistics.fmean(steps[s]["step_time"] for s in steps if s > warmup))
    return {"steps_per_s": min(rates), "by_step_time": min(timed), "ranks": len(by_rank)}


def run_engine(spec: dict[str, Any], warmup: int) -> tuple[dict[str, float], Path]:
    """Through the service: submit, follow, read the metrics; returns the figures and a copy of job.json."""
    import psutil

    from rigpilot.engine.api.client import EngineClient

    with scratch_engine() as (proc, _), EngineClient(autostart=False, timeout=60) as c:
        service = psutil.Process(proc.pid)
        cpu0 = sum(service.cpu_times()[:2])
        t0 = time.perf_counter()
        job = c.request("submit", spec=spec, cwd=str(REPO))["job"]
        c.request("subscribe", topics=[f"metrics:{job['id']}"])
        first_step = None
        deadline = time.monotonic() + 600
        while True:
            ev = c.next_event(1.0)
            if time.monotonic() > deadline:
                raise RuntimeError("the engine job did not end within 10 minutes")
            if ev is None:
                continue
            if first_step is None and ev.get("event") == "metrics":
                if any(r.get("kind") is None and isinstance(r.get("step"), int) for r in ev["records"]):
                    first_step = time.perf_counter() - t0
            if ev.get("event") == "job" and ev["job"]["id"] == job["id"]:
                state = ev["job"]["state"]
                if state in ("completed", "failed", "cancelled", "interrupted"):
                    if state != "completed":
                        raise RuntimeError(
                            f"engine job {state}: {ev['job'].get('exit_reason')} {ev['job'].get('last_log')}"
                        )
                    break
        busy = time.perf_counter() - t0
        service_cpu = sum(service.cpu_times()[:2]) - cpu0
        records, _ = c.all_metrics(job["id"])
        job_json = json.loads((Path(job["job_dir"]) / "job.json").read_text())
        done = c.request("job", job=job["id"])["job"]
    figures = step_rate(records, warmup)
    figures["first_step_s"] = first_step if first_step is not None else float("nan")
    figures["service_cpu_pct"] = 100 * service_cpu / busy  # of one core, while the job ran
    figures["tokens_per_s"] = (done.get("measured") or done.get("progress") or {}).get("tokens_per_s") or float("nan")
    keep = Path(tempfile.mkdtemp(prefix="rpbench-spec"))
    (keep / "job.json").write_text(json.dumps(job_json, indent=2))
    return figures, keep / "job.json"


def rank_environment(ranks: int, spec_env: dict[str, str]) -> dict[str, str]:
    """What the service gives the ranks of a simulated job (engine.jobs.supervisor), less its own markers."""
    env = dict(os.environ)
    for name in ("RIGPILOT_SIMULATE", "XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        env.pop(name, None)
    env.update(spec_env)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(CUDA_VISIBLE_DEVICES="")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // max(ranks, 1))))
    return env


def run_plain(job_json: Path, ranks: int, warmup: int) -> dict[str, float]:
    """The same job.json under a bare torchrun, no service anywhere."""
    from rigpilot.engine.jobs.metrics import read_records

    spec = json.loads(job_json.read_text())
    with tempfile.TemporaryDirectory(prefix="rpbench-plain") as tmp:
        job_dir = Path(tmp) / "job"
        for sub in ("logs", "metrics", "checkpoints", "output"):
            (job_dir / sub).mkdir(parents=True)
        (job_dir / "job.json").write_text(json.dumps({**spec, "id": "plain"}, indent=2))
        env = rank_environment(ranks, spec.get("env") or {})
        env["RIGPILOT_METRICS_DIR"] = str(job_dir / "metrics")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "rigpilot.engine.workers", str(job_dir)]  # fmt: skip
        with (job_dir / "logs" / "torchrun.log").open("wb") as log:
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                cmd, cwd=job_dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
            first_step = None
            while proc.poll() is None:
                if first_step is None and _has_step(job_dir / "metrics"):
                    first_step = time.perf_counter() - t0
                time.sleep(0.02)
        if proc.returncode != 0:
            raise RuntimeError(
                f"plain torchrun exited {proc.returncode}:\n{(job_dir / 'logs' / 'torchrun.log').read_text()[-3000:]}"
            )
        records, cursor = [], {}
        while True:
            got, cursor, more = read_records(job_dir / "metrics", cursor, max_bytes=4 << 20)
            records += got
            if not more:
                break
    figures = step_rate(records, warmup)
    figures["first_step_s"] = first_step if first_step is not None else float("nan")
    return figures


def _has_step(metrics_dir: Path) -> bool:
    for f in metrics_dir.glob("rank*.jsonl"):
        try:
            text = f.read_text()
        except OSError:
            continue
        if '"step_time"' in text:
            return True
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the rate (default 5)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs (engine and plain each this often)")
    args = ap.parse_args()
    if args.steps <= args.warmup + 1:
        ap.error("--steps must exceed --warmup by 2 or more")

    spec = train_spec(args)
    engine_runs: list[dict[str, float]] = []
    plain_runs: list[dict[str, float]] = []
    job_json: Path | None = None
    order = []
    for i in range(args.repeats):
        order += ["engine", "plain"] if i % 2 == 0 else ["plain", "engine"]
    if order[0] == "plain":
        raise AssertionError("the first run goes through the engine: it writes the job.json the plain run reuses")
    for mode in order:
        if mode == "engine":
            figures, job_json = run_engine(spec, args.warmup)
            engine_runs.append(figures)
        else:
            assert job_json is not None
            plain_runs.append(run_plain(job_json, args.ranks, args.warmup))
        f = (engine_runs if mode == "engine" else plain_runs)[-1]
        extra = f", service CPU {f['service_cpu_pct']:.1f}%" if mode == "engine" else ""
        print(f"  {mode:6} run: {f['steps_per_s']:.2f} steps/s (1/step_time {f['by_step_time']:.2f}), "
              f"first step after {f['first_step_s']:.2f} s{extra}", flush=True)  # fmt: skip
    if job_json is not None:
        job_json.unlink(missing_ok=True)
        job_json.parent.rmdir()

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    e, p = med(engine_runs, "steps_per_s"), med(plain_runs, "steps_per_s")
    et, pt = med(engine_runs, "by_step_time"), med(plain_runs, "by_step_time")
    print(
        f"\ntiny Llama ({TINY_LLAMA.parent.name}), {args.ranks} CPU ranks DDP, seq {args.seq}, micro-batch "
        f"{args.micro_batch}, {args.steps} steps, first {args.warmup} left out; median of {args.repeats} run(s) each"
    )
    print(f"{'':24}{'engine':>10}{'plain':>10}{'ratio':>8}")
    print(f"{'steps/s (records)':24}{e:10.2f}{p:10.2f}{e / p:8.3f}   (target >= 0.97)")
    print(f"{'steps/s (1/step_time)':24}{et:10.2f}{pt:10.2f}{et / pt:8.3f}")
    print(
        f"{'submit → first step (s)':24}{med(engine_runs, 'first_step_s'):10.2f}{med(plain_runs, 'first_step_s'):10.2f}"
    )
    print(f"engine service CPU while the job ran: {med(engine_runs, 'service_cpu_pct'):.1f}% of one core")
    print(f"job tokens/s through the engine (sum over ranks, latest): {med(engine_runs, 'tokens_per_s'):.0f}")


if __name__ == "__main__":
    main()
