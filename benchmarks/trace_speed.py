"""How long the traced verification of a best plan takes, beside the search that found it (target: ≤ 10 s).

    python benchmarks/trace_speed.py [--repeat N] [--only 4090]

For each case: the planner's search (median of --repeat runs, the formula
only), then `rigpilot.engine.planner.verify.trace` of its best plan, as the
planner runs it: a subprocess of the worker interpreter that builds the
engine's parallelised model on fake tensors and steps it (a few blocks,
scaled, for a deep model); then every plan `rigpilot plan` checks (the top
VERIFY_TOP, one tracer per core), cold, as one `rigpilot plan` waits for
them, with the tracers' CPU seconds beside the wall seconds (on a loaded
machine the wall measures the load). Every trace is cold: the trace cache is
an empty folder of this run's (RIGPILOT_TRACE_CACHE). Prints the times, the
formula's and the traced figure per GPU, and exits 1 when a trace passes the
limit or fails.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner.amounts import fmt_gib
from rigpilot.engine.planner.plan import LoraSettings, Workload
from rigpilot.engine.planner.search import SearchOptions, search
from rigpilot.engine.planner.verify import apply_trace, to_trace, trace, trace_all

LORA = LoraSettings(rank=16, alpha=32)
CASES = [
    ("8x-h100-sxm", Workload(model="llama-3.1-70b", task="train", method="full", seq_len=4096, global_batch=64)),
    ("8x-h100-sxm", Workload(model="llama-3.1-70b", method="lora", seq_len=4096, global_batch=64, lora=LORA)),
    ("8x-h100-sxm", Workload(model="llama-2-7b", task="train", method="full", seq_len=2048, global_batch=64)),
    # planner_speed.py's inference case: the prefill of 3,584 prompt tokens, then 512 decoded.
    ("8x-h100-sxm", Workload(model="llama-3.1-70b", task="infer", seq_len=4096, global_batch=8, new_tokens=512)),
    # Issue 28's consumer cases (tests/unit/test_planner_recipe.py), with the recipes the search picks.
    ("4x-rtx4090", Workload(model="llama-2-7b")),
    ("1x-rtx4090", Workload(model="llama-3.1-8b", global_batch=2)),
    ("1x-rtx4090", Workload(model="llama-3.1-8b", method="lora", global_batch=2, lora=LoraSettings())),
]
LIMIT_S = 10.0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default="", help="only the cases whose simulated machine's name has this in it")
    args = ap.parse_args()
    failed = False
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average {load} on {os.cpu_count()} cores; every trace cold (an empty trace cache)")
    head = (f"{'model':14} {'task':6} {'search ms':>9} {'trace s':>8} {'formula':>10} {'traced':>10} "
            f"{'top plans: wall s':>17} {'cpu s':>6}  best plan / how traced")  # fmt: skip
    print(head)
    for profile, workload in CASES:
        if args.only not in profile:
            continue
        machine = load_profile(profile)
        spec = describe_model(workload.model)
        options = SearchOptions(suggest=False) if profile.startswith("8x") else SearchOptions()
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
        with tempfile.TemporaryDirectory(prefix="rigpilot-trace-cache-") as cache:
            os.environ["RIGPILOT_TRACE_CACHE"] = cache
            t0 = time.perf_counter()
            answer = trace(best)
            seconds = time.perf_counter() - t0
        with tempfile.TemporaryDirectory(prefix="rigpilot-trace-cache-") as cache:
            os.environ["RIGPILOT_TRACE_CACHE"] = cache
            plans = to_trace(result)
            t0, c0 = time.perf_counter(), children_cpu()
            answers = trace_all(plans)
            top_s, top_cpu = time.perf_counter() - t0, children_cpu() - c0
        apply_trace(best, answer)
        m = best.peak_memory
        traced = fmt_gib(m.traced) if m.traced is not None else "-"
        how = answer.get("method") if answer.get("ok") else answer.get("reason")
        print(f"{workload.model:14} {task:6} {statistics.median(times):9.1f} {seconds:8.1f} "
              f"{fmt_gib(m.total):>10} {traced:>10} {f'{top_s:.1f} ({len(plans)})':>17} {top_cpu:6.1f}  "
              f"{best.parallelism.describe()} / {how}")  # fmt: skip
        for plan, a in zip(plans, answers, strict=True):
            figure = fmt_gib(int(a["peak"])) if a.get("ok") else a.get("reason")
            print(f"{'':32}   {plan.parallelism.describe()}: {figure}, {a.get('seconds', '-')} s in its tracer")
        failed |= not answer.get("ok") or seconds > LIMIT_S
    print(f"\nlimit: {LIMIT_S:.0f} s per traced plan (subprocess start and imports included)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
