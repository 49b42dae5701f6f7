"""A long soak of the engine service: jobs running, a 10 Hz subscriber, RSS/fds/threads every 30 s.

    PYTHONPATH=. python benchmarks/soak.py [--minutes 15] [--every 30]

Starts a private engine (simulated 4×RTX 4090, XDG folders in a temporary directory) and for the
whole run keeps one short script job running after another (each reports metrics at 10 Hz), while
a client subscribed to telemetry, jobs and every job's metrics reads events as they come and asks
for `jobs` ten times a second. Every `--every` seconds it prints the engine's RSS, open file
descriptors and threads; at the end, the growth over the last ten minutes (target: ≤ 5%).
Not a test: it takes as long as it is told to.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]

JOB_SCRIPT = """
import time
from engine.report import report
for step in range(1, 301):
    report(step=step, loss=1.0 / step, tokens_per_s=1000.0)
    time.sleep(0.1)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rigpilot-soak-"))
    (tmp / "run").mkdir(mode=0o700)
    os.environ.update(
        XDG_RUNTIME_DIR=str(tmp / "run"), XDG_STATE_HOME=str(tmp / "state"), XDG_CONFIG_HOME=str(tmp / "config"),
        RIGPILOT_SIMULATE="4x-rtx4090", PYTHONPATH=str(REPO),
    )  # fmt: skip
    from engine.service.client import EngineClient

    script = tmp / "job.py"
    script.write_text(JOB_SCRIPT)
    log = (tmp / "engine.log").open("wb")
    engine = subprocess.Popen([sys.executable, "-m", "engine.service"], cwd=REPO, stdout=log, stderr=log)
    stop = threading.Event()
    counts = {"events": 0, "requests": 0, "jobs": 0}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with EngineClient(autostart=False, timeout=5):
                    break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        proc = psutil.Process(engine.pid)

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
        end = start + args.minutes * 60
        print("   time      RSS   fds  threads   jobs   events  requests", flush=True)
        while time.monotonic() < end:
            time.sleep(min(args.every, max(end - time.monotonic(), 0)))
            now = time.monotonic() - start
            sample = (now, proc.memory_info().rss, proc.num_fds(), proc.num_threads())
            samples.append(sample)
            print(f"{now:6.0f} s {sample[1] / 2**20:5.1f} MiB {sample[2]:5d} {sample[3]:8d} {counts['jobs']:6d} "
                  f"{counts['events']:8d} {counts['requests']:9d}", flush=True)  # fmt: skip
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
        print(f"engine log: {tracebacks} tracebacks; folder {tmp}")
    finally:
        stop.set()
        engine.terminate()
        engine.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
