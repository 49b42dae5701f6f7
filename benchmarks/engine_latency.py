"""Submit-to-first-step latency of a script job on a warm engine service.

    .venv/bin/python benchmarks/engine_latency.py [--runs 3] [--ranks 2]

Times, for a script that reports step 0 as its first statement, the span from
sending `submit` to the arrival of that record at a subscribed client. Most
of it is torchrun importing torch and the rendezvous; the service's own share
(queue, launch, tailing) is the rest.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine_common import scratch_engine

FIRST_STEP_SCRIPT = """
from rigpilot import report
report(step=0, loss=1.0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()

    from rigpilot.engine.service.client import EngineClient

    times, running = [], []
    with scratch_engine() as (_, root):
        script = root / "first_step.py"
        script.write_text(FIRST_STEP_SCRIPT)
        with EngineClient(autostart=False, timeout=60) as c:
            c.request("subscribe", topics=["jobs"])
            for _ in range(args.runs):
                t0 = time.perf_counter()
                spec = {"kind": "script", "script": [str(script)], "gpus": list(range(args.ranks))}
                job = c.request("submit", spec=spec)["job"]
                c.request("subscribe", topics=[f"metrics:{job['id']}"])
                first = None
                while True:
                    ev = c.next_event(60)
                    if ev is None:
                        raise RuntimeError("no first step within 60 s")
                    if ev["event"] == "metrics" and first is None:
                        first = time.perf_counter() - t0
                    if ev["event"] == "job" and ev["job"]["id"] == job["id"]:
                        if ev["job"]["state"] == "running" and len(running) < len(times) + 1:
                            running.append(time.perf_counter() - t0)
                        if ev["job"]["state"] in ("completed", "failed"):
                            break
                c.request("unsubscribe", topics=[f"metrics:{job['id']}"])
                times.append(first)
    print(f"submit → first step, script job with {args.ranks} CPU ranks, {args.runs} runs:")
    print("  " + ", ".join(f"{t:.2f} s" for t in times) + f"   (median {statistics.median(times):.2f} s)")
    if running:
        print(f"  submit → 'running' state event: median {statistics.median(running):.2f} s")


if __name__ == "__main__":
    main()
