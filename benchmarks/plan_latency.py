"""How soon `rigpilot plan` answers, and how long its memory check takes: formula only, cold trace, cached trace.

    python benchmarks/plan_latency.py [--model llama-3.1-8b] [--simulated 4x-rtx4090] [--method full]

Runs the real command three ways, each a fresh process, with a trace cache of its own (a temporary folder,
RIGPILOT_TRACE_CACHE) and reads its output line by line as it comes:
    formula only   --no-verify
    cold           verification on, the cache empty: every top plan traced
    cached         the same command again: every trace from the cache, no tracer process
For each: seconds from the start to the first plan table on screen (the formula's answer), to each traced
plan's line, and to the end. Also the in-process times of the planner's search (the formula's answer once the
model config is read), of the tracer's phases in one cold process (its imports, then each plan's trace), and of
the top plans' check done as before (a process per plan), as `rigpilot plan` does it now (one tracer per core)
and by the engine's warm tracer (the Planner page's trace requests). Speed figures live here, never in tests
(a loaded machine measures the load: the load average is printed first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner.plan import Workload
from rigpilot.engine.planner.search import search
from rigpilot.engine.planner.verify import VERIFY_TOP

RIGPILOT = [str(Path(sys.executable).with_name("rigpilot"))]  # the command as installed beside this interpreter


def run(args: list[str], cache: str) -> dict[str, object]:
    """One `rigpilot plan`: when its plan table, each memory-check line and its end appeared."""
    env = {**os.environ, "RIGPILOT_TRACE_CACHE": cache, "RIGPILOT_PLAN_VERIFY": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*RIGPILOT, "plan", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stdout is not None
    table = None
    traces: list[float] = []
    in_check = False
    for line in proc.stdout:
        now = time.perf_counter() - start
        if table is None and line.startswith("Plans, "):
            table = now
        if line.startswith("Memory check:"):
            in_check = True
        elif in_check and line.startswith("  ") and ("traced" in line or "not verified" in line):
            traces.append(now)
        elif in_check and not line.strip():
            in_check = False
    code = proc.wait()
    return {"table": table, "traces": traces, "end": time.perf_counter() - start, "code": code}


def search_ms(model: str, profile: str, method: str) -> float:
    spec = describe_model(model)
    machine = load_profile(profile)
    workload = Workload(model=model, method=method, seq_len=2048, global_batch=16)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        search(spec, machine, workload)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def tracer_phases(model: str, profile: str, method: str) -> dict[str, object]:
    """One cold tracer process, timed inside: imports, then each top plan's trace."""
    spec = describe_model(model)
    result = search(spec, load_profile(profile), Workload(model=model, method=method, seq_len=2048, global_batch=16))
    plans = [p.to_dict() for p in ([result.best] if result.best else []) + result.runners_up][:VERIFY_TOP]
    # CPU seconds beside wall seconds: a tracer is one busy thread (fake tensors do no arithmetic), so on a
    # quiet machine its wall time is its CPU time, whatever else a loaded machine runs meanwhile.
    script = (
        "import json, sys, time\n"
        "t, c = time.perf_counter(), time.process_time()\n"
        "from rigpilot.engine.workers import memtrace\n"
        "memtrace._quiet()\n"
        "memtrace._warm_imports()\n"
        "out = {'imports': time.perf_counter() - t, 'imports_cpu': time.process_time() - c, 'traces': [], 'cpu': []}\n"
        "for plan in json.load(sys.stdin):\n"
        "    t, c = time.perf_counter(), time.process_time()\n"
        "    try:\n"
        "        memtrace.trace_plan(plan)\n"
        "    except memtrace.NotTraced:\n"
        "        pass\n"
        "    out['traces'].append(time.perf_counter() - t)\n"
        "    out['cpu'].append(time.process_time() - c)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(plans), capture_output=True, text=True, env=env
    )
    lines = done.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {"imports": None, "traces": []}
    out["process"] = time.perf_counter() - start
    return out


def tracer_ways(model: str, profile: str, method: str) -> list[tuple[str, float]]:
    """The top plans' memory check three ways, the cache off: as before this change (a tracer process per plan,
    one per core at a time), one tracer per core taking a share of the plans (rigpilot plan's way now), and the
    engine's warm tracer once its imports are done (the Planner page's way, after the formula's answer)."""
    from concurrent.futures import ThreadPoolExecutor

    from rigpilot.engine.planner import verify

    os.environ["RIGPILOT_TRACE_CACHE"] = "off"
    os.environ[verify.ENV_SWITCH] = "1"
    spec = describe_model(model)
    result = search(spec, load_profile(profile), Workload(model=model, method=method, seq_len=2048, global_batch=16))
    plans = verify.to_trace(result)
    out = []
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(len(plans), os.cpu_count() or 1))) as pool:
        list(pool.map(verify.trace, plans))
    out.append(("a process per plan (before)", time.perf_counter() - t))
    t = time.perf_counter()
    verify.trace_all(plans)
    out.append(("one tracer per core (now)", time.perf_counter() - t))
    verify.warm_up()
    verify.trace_all(plans[:1], warm=True)  # its imports and first trace: what the formula's answer hides
    t = time.perf_counter()
    verify.trace_all(plans, warm=True)
    out.append(("warm tracer (engine)", time.perf_counter() - t))
    verify.stop_warm()
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:6.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--simulated", default="4x-rtx4090", help="the simulated machine planned for")
    ap.add_argument("--method", default="full")
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        f"search (the formula's answer, model config read): {search_ms(a.model, a.simulated, a.method):.0f} ms median"
    )
    phases = tracer_phases(a.model, a.simulated, a.method)
    traces = ", ".join(f"{t:.2f} s" for t in phases["traces"])  # type: ignore[union-attr]
    print(
        f"one cold tracer process: imports {fmt(phases['imports'])}, traces {traces}, in all {fmt(phases['process'])}"
    )  # type: ignore[arg-type]
    cpu = phases.get("cpu") or []
    if cpu and phases.get("imports_cpu") is not None:
        cores = max(1, min(len(cpu), os.cpu_count() or 1))  # type: ignore[arg-type]
        shares = [sum(cpu[k::cores]) for k in range(cores)]  # type: ignore[index]
        quiet = float(phases["imports_cpu"]) + max(shares)  # type: ignore[arg-type]
        print(
            f"  its CPU seconds: imports {float(phases['imports_cpu']):.2f}, traces "  # type: ignore[arg-type]
            + ", ".join(f"{c:.2f}" for c in cpu)  # type: ignore[union-attr]
            + f"; the cold check of these plans on {cores} quiet core(s), a tracer each: about {quiet:.1f} s"
        )
    print(f"\nthe top {VERIFY_TOP} plans traced, cold, the trace cache off:")
    for name, seconds in tracer_ways(a.model, a.simulated, a.method):
        print(f"  {name:30}  {seconds:6.2f} s")
    args = ["--model", a.model, "--simulate", a.simulated, "--method", a.method]
    with tempfile.TemporaryDirectory(prefix="rigpilot-trace-cache-") as cache:
        rows = [
            ("formula only", run([*args, "--no-verify"], cache)),
            ("cold", run(args, cache)),
            ("cached", run(args, cache)),
        ]
    print(f"\n{'rigpilot plan':14}  {'plan table':>10}  {'traces arrived':>30}  {'done':>9}")
    for name, r in rows:
        arrived = ", ".join(f"{t:.1f}" for t in r["traces"]) or "-"  # type: ignore[union-attr]
        print(f"{name:14}  {fmt(r['table']):>10}  {arrived:>30}  {fmt(r['end']):>9}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
