"""A long soak of the engine service: jobs running, a 10 Hz subscriber, RSS/fds/threads every 30 s.

    python benchmarks/soak.py [--minutes 15] [--every 30]

Starts a private engine (simulated 4×RTX 4090, XDG folders in a temporary directory) and for the
whole run keeps one short script job running after another (each reports metrics at 10 Hz), while
a client subscribed to telemetry, jobs and every job's metrics reads events as they come and asks
for `jobs` ten times a second. Every `--every` seconds it prints the engine's RSS, open file
descriptors and threads; at the end, the growth over the last ten minutes (target: ≤ 5%).
Not a test: it takes as long as it is told to.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import psutil
from engine_common import scratch_engine

JOB_SCRIPT = """
import time
from rigpilot import report
for step in range(1, 301):
    report(step=step, loss=1.0 / step, tokens_per_s=1000.0)
    time.sleep(0.1)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    args = ap.parse_args()
    with scratch_engine() as (engine, tmp):
        soak(psutil.Process(engine.pid), tmp, args.minutes, args.every)
    return 0


def soak(proc: psutil.Process, tmp: Path, minutes: float, every: float) -> None:
    from rigpilot.engine.api.client import EngineClient

    script = tmp / "job.py"
    script.write_text(JOB_SCRIPT)
    stop = threading.Event()
    counts = {"events": 0, "requests": 0, "jobs": 0}

    def subscriber() -> None:
        with EngineClient(autostart=False, timeout=30) as c:
            c.request("subscribe", topics=["telemetry", "jobs"])
            watched: set[str] = set()
            while not stop.is_set():
                for job in c.request("jobs", limit=5)["jobs"]:
                    if job["id"] not in watched:
                        watched.add(job["id"])
                        c.request("subscribe", topics=[f"metrics:{job['id']}"])
                counts["requests"] += 1
                end = time.monotonic() + 0.1
                while (left := end - time.monotonic()) > 0:
                    if c.next_event(timeout=left) is not None:
                        counts["events"] += 1

    def submitter() -> None:
        with EngineClient(autostart=False, timeout=30) as c:
            current = None
            while not stop.is_set():
                if current is None or c.request("job", job=current)["job"]["state"] not in ("queued", "running"):
                    spec = {"kind": "script", "gpus": [0], "script": [str(script)], "name": "soak"}
                    current = c.request("submit", spec=spec, cwd=str(tmp))["job"]["id"]
                    counts["jobs"] += 1
                stop.wait(1.0)

    threads = [threading.Thread(target=f, daemon=True) for f in (subscriber, submitter)]
    for t in threads:
        t.start()
    samples: list[tuple[float, int, int, int]] = []
    start = time.monotonic()
    end = start + minutes * 60
    print("   time      RSS   fds  threads   jobs   events  requests", flush=True)
    try:
        while time.monotonic() < end:
            time.sleep(min(every, max(end - time.monotonic(), 0)))
            now = time.monotonic() - start
            sample = (now, proc.memory_info().rss, proc.num_fds(), proc.num_threads())
            samples.append(sample)
            print(f"{now:6.0f} s {sample[1] / 2**20:5.1f} MiB {sample[2]:5d} {sample[3]:8d} {counts['jobs']:6d} "
                  f"{counts['events']:8d} {counts['requests']:9d}", flush=True)  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    window = [s for s in samples if s[0] >= samples[-1][0] - 600] if samples else []
    if len(window) >= 2:
        first, last = window[0], window[-1]
        for i, name in ((1, "RSS"), (2, "fds"), (3, "threads")):
            growth = (last[i] - first[i]) / max(first[i], 1)
            print(f"{name} over the last {last[0] - first[0]:.0f} s: {first[i]} -> {last[i]} ({growth:+.1%}; target ≤ +5%)")
    tracebacks = (tmp / "engine.log").read_text(errors="replace").count("Traceback")
    print(f"engine log: {tracebacks} tracebacks")


if __name__ == "__main__":
    raise SystemExit(main())
