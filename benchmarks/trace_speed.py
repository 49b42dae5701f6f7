"""How long the traced verification of a best plan takes, beside the search that found it (target: ≤ 10 s).

    python benchmarks/trace_speed.py [--repeat N]

For each case: the planner's search (median of --repeat runs, the formula
only), then `rigpilot.engine.planner.verify.trace` of its best plan, as the
planner runs it: a subprocess of the worker interpreter that builds the
engine's parallelised model on fake tensors and steps it (2 and 4 blocks,
scaled, for a deep model). Prints both times, the formula's and the traced
figure per GPU, and exits 1 when a trace passes the limit or fails.
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
from rigpilot.engine.planner.memory import fmt_gib
from rigpilot.engine.planner.plan import LoraSettings, Workload
from rigpilot.engine.planner.search import SearchOptions, search
from rigpilot.engine.planner.verify import apply_trace, trace

LORA = LoraSettings(rank=16, alpha=32)
CASES = [
    ("8x-h100-sxm", Workload(model="llama-3.1-70b", task="train", method="full", seq_len=4096, global_batch=64)),
    ("8x-h100-sxm", Workload(model="llama-3.1-70b", method="lora", seq_len=4096, global_batch=64, lora=LORA)),
    ("8x-h100-sxm", Workload(model="llama-2-7b", task="train", method="full", seq_len=2048, global_batch=64)),
    # planner_speed.py's inference case: the prefill of 3,584 prompt tokens, then 512 decoded.
    ("8x-h100-sxm", Workload(model="llama-3.1-70b", task="infer", seq_len=4096, global_batch=8, new_tokens=512)),
]
LIMIT_S = 10.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    failed = False
    head = f"{'model':14} {'task':6} {'search ms':>9} {'trace s':>8} {'formula':>10} {'traced':>10}  best plan / how traced"
    print(head)
    for profile, workload in CASES:
        machine = load_profile(profile)
        spec = describe_model(workload.model)
        options = SearchOptions(suggest=False)
        search(spec, machine, workload, options=options)  # warm-up
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = search(spec, machine, workload, options=options)
            times.append((time.perf_counter() - t0) * 1e3)
        best = result.best
        task = workload.method if workload.training else "infer"
        if best is None:
            print(f"{workload.model:14} {task:6} {statistics.median(times):9.1f}  nothing fits")
            continue
        t0 = time.perf_counter()
        answer = trace(best)
        seconds = time.perf_counter() - t0
        apply_trace(best, answer)
        m = best.peak_memory
        traced = fmt_gib(m.traced) if m.traced is not None else "-"
        how = answer.get("method") if answer.get("ok") else answer.get("reason")
        print(f"{workload.model:14} {task:6} {statistics.median(times):9.1f} {seconds:8.1f} "
              f"{fmt_gib(m.total):>10} {traced:>10}  {best.parallelism.describe()} / {how}")  # fmt: skip
        failed |= not answer.get("ok") or seconds > LIMIT_S
    print(f"\nlimit: {LIMIT_S:.0f} s per traced plan (subprocess start and imports included)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
