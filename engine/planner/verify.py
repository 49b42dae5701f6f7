"""Check the formula's memory for the top plans against a traced step of the engine's own model.

The search ranks thousands of layouts with the formula (`memory.py`); the few
plans it puts on top are then built the way a worker builds them and stepped on
fake tensors by `rigpilot.engine.workers.memtrace`, in a subprocess of the
interpreter that has PyTorch (this module imports no torch: the GUI and the
planner import it for its types). Each verified plan carries both figures per
GPU (`MemoryBreakdown.total` and `.traced`); its headroom and `fits` use the
larger. A gap over `DEFECT_GAP` is a defect of the formula: it is shown in the
explanation and logged. A plan that cannot be traced says why, in one line,
in `Plan.verification`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.models.spec import ModelSpec
from rigpilot.engine.planner.calibration import CalibrationStatus
from rigpilot.engine.planner.links import Calibration
from rigpilot.engine.planner.memory import fmt_gib
from rigpilot.engine.planner.plan import Plan, Workload
from rigpilot.engine.planner.result import SearchResult
from rigpilot.engine.planner.search import SearchOptions, search

log = logging.getLogger(__name__)
# A defect goes to the engine's log (its handlers sit on the root logger); `rigpilot plan` in a terminal
# shows the same finding as an explanation line, not as a raw log record from logging's last resort.
log.addHandler(logging.NullHandler())

VERIFY_TOP = 3  # the best plan and the next two
DEFECT_GAP = 0.05  # formula and trace further apart than this (of the formula's tensor bytes) is a defect
TRACE_TIMEOUT_S = 120.0
VERIFY_BUDGET_S = 25.0  # the engine's planner: its plan request has 45 s in all
TRACER = "rigpilot.engine.workers.memtrace"
ENV_SWITCH = "RIGPILOT_PLAN_VERIFY"  # "0": plans are not verified unless asked for explicitly


def enabled() -> bool:
    """Whether verification is on by default (RIGPILOT_PLAN_VERIFY is not "0")."""
    return os.environ.get(ENV_SWITCH, "1").strip() not in {"0", "false", "no", "off"}


def trace(plan: Plan, *, trust_remote_code: bool = False, timeout_s: float = TRACE_TIMEOUT_S) -> dict[str, Any]:
    """The tracer's answer for `plan`: {"ok": True, "peak": bytes, ...} or {"ok": False, "reason": one line}."""
    from rigpilot.engine.runtime import worker_python

    try:
        python = worker_python()
    except UserError as e:
        return {"ok": False, "reason": str(e)}
    request = json.dumps({"plan": plan.to_dict(), "trust_remote_code": trust_remote_code})
    # Config only, never a download: the planner has read the config already, the cache has it.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run(
            [python, "-m", TRACER], input=request, capture_output=True, text=True, timeout=timeout_s,
            env=env, cwd="/",  # not the caller's folder: nothing there may shadow a module
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ok": False, "reason": f"the trace took longer than {timeout_s:.0f} s"}
    except OSError as e:
        return {"ok": False, "reason": f"cannot start the tracer ({python}): {e.strerror or e}"}
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or "ok" not in answer:
        log.warning("memory tracer exited with %s without an answer:\n%s", done.returncode, done.stderr[-4000:])
        return {"ok": False, "reason": f"the tracer exited with code {done.returncode} without an answer"}
    if not answer["ok"] and done.stderr.strip():
        log.info("memory tracer: %s\n%s", answer.get("reason"), done.stderr[-4000:])
    return answer


def apply_trace(plan: Plan, answer: dict[str, Any]) -> str | None:
    """Record the tracer's answer on `plan`; returns the line to show when formula and trace disagree."""
    if not answer.get("ok"):
        plan.verification = f"not verified: {answer.get('reason') or 'no reason given'}"
        return None
    peak = int(answer["peak"])
    stages = answer.get("stages") or {}  # pipeline plans: the traced peak of each stage
    worst: tuple[float, Any] | None = None
    for m in plan.memory:
        # The trace sees tensors only; the CUDA context and NCCL are the formula's.
        m.traced = int(stages.get(str(m.stage), peak)) + m.overhead
        m.headroom = m.capacity - max(m.total, m.traced)
        tensors = max(m.total - m.overhead, 1)
        gap = (m.traced - m.total) / tensors
        if worst is None or abs(gap) > abs(worst[0]):
            worst = (gap, m)
    plan.verification = f"traced: {answer.get('method', 'traced')}, {float(answer.get('seconds', 0)):.1f} s"
    if worst is None or abs(worst[0]) <= DEFECT_GAP:
        return None
    gap, m = worst
    log.warning(
        "planner defect: memory formula %s from the traced step for %s (%s): formula %s, traced %s per GPU (%d vs %d bytes)",
        f"{100 * gap:+.1f}%", plan.parallelism.describe(), plan.workload.model, fmt_gib(m.total), fmt_gib(m.traced),
        m.total, m.traced,
    )  # fmt: skip
    return (
        f"memory check ({plan.parallelism.family}): formula {fmt_gib(m.total)} · traced {fmt_gib(m.traced)} per GPU "
        f"({100 * gap:+.0f}%); the plan counts the larger"
    )


def check(
    result: SearchResult, *, top: int = VERIFY_TOP, trust_remote_code: bool = False,
    timeout_s: float = TRACE_TIMEOUT_S, budget_s: float | None = None,
) -> list[str]:  # fmt: skip
    """Trace the top `top` plans of `result` in place; a best plan the trace shows does not fit gives way.

    `budget_s` bounds the whole verification: plans left when it runs out stay "not verified".
    Returns the explanation's lines about it (`search` runs this before it explains the best plan).
    """
    plans = ([result.best] if result.best else []) + result.runners_up
    started = time.perf_counter()
    deadline = started + (timeout_s if budget_s is None else min(timeout_s, budget_s))

    def one(plan: Plan) -> dict[str, Any]:
        if plan.parallelism.nodes > 1:
            # The trace runs one machine's ranks; a step spread over several nodes is not traced.
            return {"ok": False, "reason": "multi-node plans are not traced"}
        left = deadline - time.perf_counter()
        if left < 1.0:
            return {"ok": False, "reason": "no time left for it in this request"}
        return trace(plan, trust_remote_code=trust_remote_code, timeout_s=left)

    # Each trace is its own single-threaded process: side by side they take the time of one per core.
    with ThreadPoolExecutor(max_workers=max(1, min(top, os.cpu_count() or 1))) as pool:
        answers = list(pool.map(one, plans[:top]))
    lines = [line for plan, answer in zip(plans[:top], answers, strict=True) if (line := apply_trace(plan, answer))]
    if result.best is not None and not result.best.fits:
        # The plan that takes its place must fit once traced and be one the engine runs, as the best had to be.
        fitting = [p for p in plans[:top] if p.fits and (p.runs_here or not result.best.runs_here)]
        if fitting:
            new_best = fitting[0]
            lines.append(
                f"The traced step of {result.best.parallelism.family} ({result.best.parallelism.describe()}) "
                f"needs {fmt_gib(result.best.peak_memory.traced or 0)} per GPU and does not fit: "
                f"{new_best.parallelism.family} is recommended instead."
            )
            result.runners_up = [p for p in plans if p is not new_best]
            result.best = new_best
        else:
            lines.append("the traced step of the best plan does not fit its GPUs: the formula under-counts it")
    # Plans the trace shows do not fit stay listed (with both figures) but below every plan that fits.
    result.runners_up.sort(key=lambda p: not p.fits)
    seconds = time.perf_counter() - started
    traced = sum(bool(a.get("ok")) for a in answers)
    tried = min(top, len(plans))
    result.trace = {"traced": traced, "tried": tried, "seconds": round(seconds, 1)}
    result.notes = [*result.notes, f"memory traced for {traced} of {tried} plan(s) in {seconds:.1f} s"]
    return lines


def verify(result: SearchResult, **kwargs: Any) -> SearchResult:
    """`check` on a result already explained: its lines go at the end of the explanation."""
    result.explanation = result.explanation + check(result, **kwargs)
    return result


def search_checked(
    spec: ModelSpec, machine: Machine, workload: Workload, calibrated: tuple[Calibration | None, CalibrationStatus], *,
    gpus: list[int] | None = None, options: SearchOptions | None = None, verify: bool = True,
    trust_remote_code: bool = False, budget_s: float | None = None, node_machines: list[Machine] | None = None,
) -> SearchResult:  # fmt: skip
    """The search `rigpilot plan` and the engine's planner both run: calibrated, its top plans traced (unless
    `verify` is off or RIGPILOT_PLAN_VERIFY=0), and the explanation ending with what the calibration did."""
    numbers, status = calibrated
    verifier = None
    if verify and enabled():
        verifier = functools.partial(check, trust_remote_code=trust_remote_code, budget_s=budget_s)
    result = search(
        spec, machine, workload, gpus=gpus, calibration=numbers, options=options, verifier=verifier, node_machines=node_machines,
    )  # fmt: skip
    result.explanation.append(status.line)
    return result


def figures(plan: Plan) -> str:
    """'formula 12.4 GiB · traced 13.1 GiB' for the fullest GPU, or the formula alone with the reason."""
    m = plan.peak_memory
    if m.traced is None:
        return f"formula {fmt_gib(m.total)}" + (f" ({plan.verification})" if plan.verification else "")
    return f"formula {fmt_gib(m.total)} · traced {fmt_gib(m.traced)}"
