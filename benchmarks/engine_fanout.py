"""Fan-out cost: telemetry and metrics at 10 Hz pushed to three subscribers.

    .venv/bin/python benchmarks/engine_fanout.py [--seconds 20] [--subscribers 3]

Starts a scratch engine service sampling a simulated 4×RTX 4090 at 10 Hz, runs
a script job that reports a metric record 10 times a second on each of two
ranks, and subscribes N clients to telemetry and to the job's metrics. Prints
per-subscriber delivered rates, end-to-end latency (sample or record time to
arrival in the client; p50/p95) and the service's CPU use.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from engine_common import scratch_engine

METRICS_SCRIPT = """
import time
from rigpilot import report
step = 0
while True:
    report(step=step, loss=1.0 / (step + 1), tokens_per_s=1234.0)
    step += 1
    time.sleep(0.1)
"""


def subscriber(job_id: str, stop: threading.Event, out: dict) -> None:
    from rigpilot.engine.api.client import EngineClient

    with EngineClient(autostart=False, timeout=30) as c:
        c.request("subscribe", topics=["telemetry", f"metrics:{job_id}"])
        tel, met = [], []
        start = time.time()
        while not stop.is_set():
            ev = c.next_event(0.5)
            if ev is None:
                continue
            now = time.time()
            if ev["event"] == "telemetry":
                tel.append(now - ev["sample"]["time"])
            elif ev["event"] == "metrics":
                # Skip the history replayed on subscribe: only live records measure the push path.
                met += [now - r["time"] for r in ev["records"] if r["time"] >= start]
        out.update(telemetry=tel, metrics=met, seconds=time.time() - start)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--subscribers", type=int, default=3)
    args = ap.parse_args()

    import psutil

    from rigpilot.engine.api.client import EngineClient

    with scratch_engine("--telemetry-period", "0.1") as (proc, root):
        script = root / "metrics.py"
        script.write_text(METRICS_SCRIPT)
        with EngineClient(autostart=False) as c:
            job = c.request("submit", spec={"kind": "script", "script": [str(script)], "gpus": [0, 1]})["job"]
            while c.request("job", job=job["id"])["job"]["state"] != "running":
                time.sleep(0.1)
        time.sleep(1.0)  # let the ranks settle into their 10 Hz rhythm
        service = psutil.Process(proc.pid)
        stop = threading.Event()
        results = [{} for _ in range(args.subscribers)]
        threads = [threading.Thread(target=subscriber, args=(job["id"], stop, r)) for r in results]
        service.cpu_percent(None)
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        cpu = service.cpu_percent(None)
        stop.set()
        for t in threads:
            t.join()

    print(f"engine fan-out: {args.subscribers} subscribers, telemetry at 10 Hz, metrics 2 ranks × 10 Hz, {args.seconds:.0f} s")
    for i, r in enumerate(results):
        tel, met = r["telemetry"], r["metrics"]
        print(
            f"  subscriber {i}: telemetry {len(tel) / r['seconds']:.1f}/s "
            f"(latency p50 {1e3 * pct(tel, 50):.1f} ms, p95 {1e3 * pct(tel, 95):.1f} ms); "
            f"metrics {len(met) / r['seconds']:.1f} records/s "
            f"(latency p50 {1e3 * pct(met, 50):.0f} ms, p95 {1e3 * pct(met, 95):.0f} ms)"
        )
    print(f"  service CPU: {cpu:.1f}% of one core (sampling, storing and pushing; the job's ranks not included)")


if __name__ == "__main__":
    main()
