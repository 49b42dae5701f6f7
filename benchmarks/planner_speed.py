"""How long a full planner search takes (target: under 100 ms for 8 GPUs).

    python benchmarks/planner_speed.py [--repeat N]

Searches every (dp, tp, pp, ZeRO/FSDP degree, offload, checkpointing, micro-batch)
plan on the simulated 8-GPU machines and prints the median time of `--repeat`
runs after one warm-up (which loads the spec table and model presets). The limit
applies to the search; when nothing fits, finding the smallest change that fits
re-runs it several times, shown separately.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner.plan import Workload
from rigpilot.engine.planner.search import SearchOptions, search

CASES = [
    ("8x-h100-sxm", Workload(model="llama-2-7b", task="train", method="full", seq_len=2048, global_batch=64)),
    ("8x-a100-pcie", Workload(model="llama-2-7b", task="train", method="full", seq_len=2048, global_batch=64)),
    ("8x-h100-sxm", Workload(model="llama-2-7b", task="train", method="lora", seq_len=4096, global_batch=32)),
    ("8x-a100-pcie", Workload(model="llama-3.1-70b", task="train", method="full", seq_len=4096, global_batch=64)),
    ("8x-h100-sxm", Workload(model="llama-3.1-70b", task="infer", seq_len=4096, global_batch=8, new_tokens=512)),
]
LIMIT_MS = 100.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    worst = 0.0
    print(f"{'machine':14} {'model':14} {'task':12} {'plans':>6} {'fit':>5} {'median ms':>10} {'max ms':>8}  best")
    for profile, workload in CASES:
        machine = load_profile(profile)
        spec = describe_model(workload.model)
        plain = SearchOptions(suggest=False)
        search(spec, machine, workload, options=plain)  # warm-up
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = search(spec, machine, workload, options=plain)
            times.append((time.perf_counter() - t0) * 1e3)
        med = statistics.median(times)
        worst = max(worst, med)
        if result.best:
            best = result.best.parallelism.describe()
        else:
            t0 = time.perf_counter()
            full = search(spec, machine, workload)
            ms = (time.perf_counter() - t0) * 1e3
            best = f"nothing fits; {len(full.suggestions)} suggestions found in {ms:.0f} ms more"
        task = f"{workload.task}/{workload.method}" if workload.training else "infer"
        print(f"{profile:14} {workload.model:14} {task:12} {result.considered:6d} {result.fitting:5d} {med:10.1f} {max(times):8.1f}  {best}")
    verdict = "OK" if worst < LIMIT_MS else "TOO SLOW"
    print(f"slowest median: {worst:.1f} ms (limit {LIMIT_MS:.0f} ms): {verdict}")
    return 0 if worst < LIMIT_MS else 1


if __name__ == "__main__":
    sys.exit(main())
