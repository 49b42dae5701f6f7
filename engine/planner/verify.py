"""Check the formula's memory for the top plans against a traced step of the engine's own model.

The search ranks thousands of layouts with the formula (`memory.py`); the few
plans it puts on top are then built the way a worker builds them and stepped on
fake tensors by `rigpilot.engine.workers.memtrace`, in a subprocess of the
interpreter that has PyTorch (this module imports no torch: the GUI and the
planner import it for its types). Each verified plan carries both figures per
GPU (`MemoryBreakdown.total` and `.traced`); its headroom and `fits` use the
larger. A gap over `DEFECT_GAP` is a defect of the formula: it is shown in the
explanation and logged. A plan that cannot be traced says why, in one line,
in `Plan.verification` (decided here, engine.planner.traceable, before any
process is started).

Traces never hold up the formula's answer: `rigpilot plan` prints it first and
each trace's outcome as it arrives (`trace_all`'s `on_answer`), and the engine's
`plan` request answers `verify: false` at once and traces one plan per `trace`
request, in a warm tracer (`warm_up`). Each answer is kept on disk
(engine.planner.trace_cache), so a plan traced once is verified at once after.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
import selectors
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.models.spec import ModelSpec
from rigpilot.engine.planner import trace_cache
from rigpilot.engine.planner.amounts import fmt_gib
from rigpilot.engine.planner.calibration import CalibrationStatus
from rigpilot.engine.planner.links import Calibration
from rigpilot.engine.planner.machine_check import MachineCheckUse
from rigpilot.engine.planner.plan import Plan, Workload
from rigpilot.engine.planner.result import SearchResult
from rigpilot.engine.planner.search import SearchOptions, search
from rigpilot.engine.planner.traceable import why_not_traced

log = logging.getLogger(__name__)
# A defect goes to the engine's log (its handlers sit on the root logger); `rigpilot plan` in a terminal
# shows the same finding as an explanation line, not as a raw log record from logging's last resort.
log.addHandler(logging.NullHandler())

VERIFY_TOP = 3  # the best plan and the next two
DEFECT_GAP = 0.05  # formula and trace further apart than this (of the formula's tensor bytes) is a defect
TRACE_TIMEOUT_S = 120.0
VERIFY_BUDGET_S = 25.0  # the engine's planner: its plan request has 45 s in all
TRACER = "rigpilot.engine.workers.memtrace"
MAX_TRACERS = 4  # tracer processes at once, at most one per core
ENV_SWITCH = "RIGPILOT_PLAN_VERIFY"  # "0": plans are not verified unless asked for explicitly


def enabled() -> bool:
    """Whether verification is on by default (RIGPILOT_PLAN_VERIFY is not "0")."""
    return os.environ.get(ENV_SWITCH, "1").strip() not in {"0", "false", "no", "off"}


def trace(plan: Plan, *, trust_remote_code: bool = False, timeout_s: float = TRACE_TIMEOUT_S) -> dict[str, Any]:
    """The tracer's answer for `plan`: {"ok": True, "peak": bytes, ...} or {"ok": False, "reason": one line}."""
    return trace_all([plan], trust_remote_code=trust_remote_code, timeout_s=timeout_s)[0]


OnAnswer = Callable[[int, Plan, dict[str, Any]], None]


def trace_all(
    plans: list[Plan], *, trust_remote_code: bool = False, timeout_s: float = TRACE_TIMEOUT_S,
    on_answer: OnAnswer | None = None, cancelled: Callable[[], bool] | None = None,
    memo: dict[str, dict[str, Any]] | None = None, least_s: float = 0.0, warm: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Each plan's traced answer, in order; `on_answer(i, plan, answer)` as each is known.

    A plan the tracer cannot trace is answered at once with the reason (no process started), one traced
    before from the disk cache (engine.planner.trace_cache, `"cached": True`) or from `memo` (this run's
    answers by plan); the rest in tracer processes, one per core at most, each tracing its share of the
    plans in turn and answering each as it is done. Past `timeout_s`, or once `cancelled()`, the tracers are
    stopped and the plans left say why; with less than `least_s` to go, none is started. `warm`: in this
    process's warm tracer (`warm_up`), which stays for the next call.
    """
    deadline = time.monotonic() + timeout_s
    answers: list[dict[str, Any] | None] = [None] * len(plans)

    def answer(i: int, a: dict[str, Any]) -> None:
        answers[i] = a
        if memo is not None:
            memo[_identity(plans[i])] = a
        if on_answer is not None:
            on_answer(i, plans[i], a)

    python: str | None = None
    keys: dict[int, str | None] = {}
    for i, plan in enumerate(plans):
        reason = why_not_traced(dataclasses.asdict(plan.workload), dataclasses.asdict(plan.parallelism))
        if reason is not None:
            answer(i, {"ok": False, "reason": reason})
            continue
        known = memo.get(_identity(plan)) if memo is not None else None
        if known is not None:
            answer(i, known)
            continue
        if python is None:
            from rigpilot.engine.runtime import worker_python

            try:
                python = worker_python()
            except UserError as e:
                answer(i, {"ok": False, "reason": str(e)})
                continue
        keys[i] = trace_cache.key(plan, python=python, trust_remote_code=trust_remote_code)
        cached = trace_cache.load(keys[i])
        if cached is not None:
            answer(i, {**cached, "cached": True})
    misses = [i for i in keys if answers[i] is None]
    if misses and timeout_s < least_s:
        for i in misses:
            answer(i, {"ok": False, "reason": "no time left for it in this request"})
    elif misses and python is not None:

        def traced(i: int, a: dict[str, Any]) -> None:
            if a.get("ok"):
                trace_cache.store(keys[i], a)
            answer(i, a)

        _run_tracers(python, plans, misses, trust_remote_code, deadline, timeout_s, traced, cancelled, warm)
    return [a if a is not None else {"ok": False, "reason": "not traced"} for a in answers]


def _identity(plan: Plan) -> str:
    return json.dumps([dataclasses.asdict(plan.workload), dataclasses.asdict(plan.parallelism)], sort_keys=True)


def tracer_command(python: str) -> list[str]:
    """How a tracer process is started (a test may start a stand-in that waits for its cue)."""
    return [python, "-m", TRACER]


def _run_tracers(
    python: str, plans: list[Plan], todo: list[int], trust_remote_code: bool, deadline: float, timeout_s: float,
    answer: Callable[[int, dict[str, Any]], None], cancelled: Callable[[], bool] | None, warm: bool = False,
) -> None:  # fmt: skip
    # Each tracer is one thread (fake tensors do no arithmetic): more of them than cores only competes for
    # the cores, and each pays torch's import, so the plans are shared out over at most one per core.
    # A warm tracer (`warm`) has paid its imports already: it traces them all, in turn.
    n = 1 if warm else max(1, min(len(todo), os.cpu_count() or 1, MAX_TRACERS))
    shares = [todo[k::n] for k in range(n)]  # the best plan first in the first tracer
    running: list[_Tracer] = []
    finished = False
    try:
        for share in shares:
            request = {"plans": [plans[i].to_dict() for i in share], "trust_remote_code": trust_remote_code}
            try:
                tracer = _warm_tracer(python) if warm else _Tracer(tracer_command(python))
                tracer.send(request, share)
                running.append(tracer)
            except OSError as e:
                for i in share:
                    answer(i, {"ok": False, "reason": f"cannot start the tracer ({python}): {e.strerror or e}"})
        sel = selectors.DefaultSelector()
        for t in running:
            sel.register(t.stdout, selectors.EVENT_READ, t)
        while sel.get_map():
            if cancelled is not None and cancelled():
                for t in running:
                    t.fail(answer, "the memory check was cancelled")
                return
            left = deadline - time.monotonic()
            if left <= 0:
                for t in running:
                    t.fail(answer, f"the trace took longer than {timeout_s:.0f} s")
                return
            for key, _ in sel.select(timeout=min(left, 0.25)):
                t = key.data
                alive = t.read(answer)
                if not alive:
                    t.finish(answer)
                if not alive or not t.pending:
                    sel.unregister(t.stdout)
        finished = True
    finally:
        for t in running:
            if not (finished and t is _WARM and t.proc.poll() is None):
                t.stop()


# The warm tracer of this process (a planner process of the engine: one request at a time), started by
# `warm_up` or the first trace that asks for it, and reused until it fails, is stopped or its owner exits.
_WARM: _Tracer | None = None


def warm_up() -> None:
    """Start the warm tracer now, if it is not running, so its imports are done by the time a trace is asked."""
    if not enabled():
        return
    from rigpilot.engine.runtime import worker_python

    try:
        _warm_tracer(worker_python())
    except (UserError, OSError) as e:
        log.info("no warm tracer: %s", e)


def stop_warm() -> None:
    """Stop the warm tracer, if one runs."""
    if _WARM is not None:
        _WARM.stop()


def _warm_tracer(python: str) -> _Tracer:
    global _WARM
    if _WARM is None or _WARM.proc.poll() is not None:
        _WARM = _Tracer([*tracer_command(python), "--serve"], serve=True)
    return _WARM


class _Tracer:
    """One tracer process, the plans it was last given, and the answer lines it has written so far."""

    def __init__(self, command: list[str], *, serve: bool = False):
        self.serve = serve
        self.share: list[int] = []
        self.pending: set[int] = set()
        self.buffer = b""
        self.stderr = tempfile.TemporaryFile()
        # Config only, never a download: the planner has read the config already, the cache has it.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env,
            cwd="/",  # not the caller's folder: nothing there may shadow a module
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdout = self.proc.stdout

    def send(self, request: dict[str, Any], share: list[int]) -> None:
        """Ask it to trace `request`'s plans, which are `share` of the caller's; a one-shot tracer gets no more."""
        self.share, self.pending = share, set(share)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            if not self.serve:
                self.proc.stdin.close()
        except OSError:
            pass  # it exited already: its exit code says so once its output ends

    def read(self, answer: Callable[[int, dict[str, Any]], None]) -> bool:
        """Take what it wrote; False at its end."""
        chunk = os.read(self.stdout.fileno(), 1 << 16)
        if not chunk:
            return False
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                a = json.loads(line)
            except ValueError:
                continue
            if not isinstance(a, dict) or "ok" not in a:
                continue
            index = a.pop("index", None)
            i = self.share[index] if isinstance(index, int) and 0 <= index < len(self.share) else None
            if i is None and index is None and len(self.share) == 1:
                i = self.share[0]
            if i in self.pending:
                self.pending.discard(i)
                if not a["ok"]:
                    log.info("memory tracer: %s\n%s", a.get("reason"), self._errors())
                answer(i, a)
        return True

    def finish(self, answer: Callable[[int, dict[str, Any]], None]) -> None:
        code = self.proc.wait()
        if self.pending:
            log.warning("memory tracer exited with %s without an answer:\n%s", code, self._errors())
            self.fail(answer, f"the tracer exited with code {code} without an answer")

    def fail(self, answer: Callable[[int, dict[str, Any]], None], reason: str) -> None:
        for i in sorted(self.pending):
            answer(i, {"ok": False, "reason": reason})
        self.pending.clear()

    def stop(self) -> None:
        global _WARM
        if self is _WARM:
            _WARM = None
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for f in (self.proc.stdin, self.stdout):
            with contextlib.suppress(OSError, ValueError):
                if f is not None:
                    f.close()
        self.stderr.close()

    def _errors(self) -> str:
        try:
            self.stderr.seek(0, os.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - 4000))
            return self.stderr.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""


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
    how = "from the trace cache" if answer.get("cached") else f"{float(answer.get('seconds', 0)):.1f} s"
    plan.verification = f"traced: {answer.get('method', 'traced')}, {how}"
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
    timeout_s: float = TRACE_TIMEOUT_S, budget_s: float | None = None, on_answer: OnAnswer | None = None,
    cancelled: Callable[[], bool] | None = None, memo: dict[str, dict[str, Any]] | None = None,
) -> list[str]:  # fmt: skip
    """Trace the top `top` plans of `result` in place; a best plan the trace shows does not fit gives way.

    `budget_s` bounds the whole verification: plans left when it runs out stay "not verified".
    `on_answer`, `cancelled`, `memo`: as `trace_all` takes them.
    Returns the explanation's lines about it (`search` runs this before it explains the best plan).
    """
    plans = ([result.best] if result.best else []) + result.runners_up
    started = time.perf_counter()
    budget = timeout_s if budget_s is None else min(timeout_s, budget_s)
    answers = trace_all(
        plans[:top], trust_remote_code=trust_remote_code, timeout_s=budget, least_s=1.0, on_answer=on_answer,
        cancelled=cancelled, memo=memo,
    )  # fmt: skip
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
    cached = sum(bool(a.get("ok") and a.get("cached")) for a in answers)
    tried = min(top, len(plans))
    result.trace = {"traced": traced, "tried": tried, "seconds": round(seconds, 1), "cached": cached}
    result.notes = [
        *result.notes,
        f"memory traced for {traced} of {tried} plan(s) in {seconds:.1f} s"
        + (f" ({cached} from the trace cache)" if cached else ""),
    ]
    return lines


def verify(result: SearchResult, **kwargs: Any) -> SearchResult:
    """`check` on a result already explained: its lines go at the end of the explanation."""
    result.explanation = result.explanation + check(result, **kwargs)
    return result


def search_checked(
    spec: ModelSpec, machine: Machine, workload: Workload, calibrated: tuple[Calibration | None, CalibrationStatus], *,
    gpus: list[int] | None = None, options: SearchOptions | None = None, verify: bool = True,
    trust_remote_code: bool = False, budget_s: float | None = None, node_machines: list[Machine] | None = None,
    memo: dict[str, dict[str, Any]] | None = None, machine_check: MachineCheckUse | None = None,
) -> SearchResult:  # fmt: skip
    """The search `rigpilot plan` and the engine's planner both run: calibrated, its top plans traced (unless
    `verify` is off or RIGPILOT_PLAN_VERIFY=0), and the explanation ending with what the calibration did.
    `memo`: answers traced already in this run (trace_all's), so the same plans are not traced twice.
    `machine_check` (planner.machine_check.use): the machine as the check left it is planned for, and the
    explanation ends with what the check changed."""
    numbers, status = calibrated
    verifier = None
    if verify and enabled():
        verifier = functools.partial(check, trust_remote_code=trust_remote_code, budget_s=budget_s, memo=memo)
    planned = machine_check.machine if machine_check is not None else machine
    result = search(
        spec, planned, workload, gpus=gpus, calibration=numbers, options=options, verifier=verifier, node_machines=node_machines,
    )  # fmt: skip
    result.explanation.append(status.line)
    if machine_check is not None:
        result.explanation += machine_check.lines
    return result


def figures(plan: Plan) -> str:
    """'formula 12.4 GiB · traced 13.1 GiB' for the fullest GPU, or the formula alone with the reason."""
    m = plan.peak_memory
    if m.traced is None:
        return f"formula {fmt_gib(m.total)}" + (f" ({plan.verification})" if plan.verification else "")
    return f"formula {fmt_gib(m.total)} · traced {fmt_gib(m.traced)}"


def to_trace(result: SearchResult, top: int = VERIFY_TOP) -> list[Plan]:
    """The plans `check` traces for `result`, best first."""
    return (([result.best] if result.best else []) + result.runners_up)[:top]


def outcome(plan: Plan, answer: dict[str, Any]) -> dict[str, Any]:
    """What one trace says of `plan`, as facts for a client to word: {"verified", "fits", "formula_bytes",
    "traced_bytes", "capacity_bytes", "cached", "seconds", "reason"}; `plan` itself is left as it was."""
    shown = copy.deepcopy(plan)
    apply_trace(shown, answer)
    m = shown.peak_memory
    return {
        "verified": bool(answer.get("ok")),
        "fits": shown.fits,
        "formula_bytes": m.total,
        "traced_bytes": m.traced,
        "capacity_bytes": m.capacity,
        "cached": bool(answer.get("cached")),
        "seconds": float(answer.get("seconds") or 0.0),
        "reason": "" if answer.get("ok") else str(answer.get("reason") or "no reason given"),
    }


def outcome_line(o: dict[str, Any]) -> str:
    """`outcome` in words: 'formula 14.2 GiB · traced 14.9 GiB per GPU: fits (3.1 s)' or 'not verified: why'."""
    if not o["verified"]:
        return f"not verified: {o['reason']}"
    verdict = "fits" if o["fits"] else f"does not fit its {fmt_gib(o['capacity_bytes'])}"
    when = "from the trace cache" if o["cached"] else f"{o['seconds']:.1f} s"
    return (
        f"formula {fmt_gib(o['formula_bytes'])} · traced {fmt_gib(o['traced_bytes'] or 0)} per GPU: {verdict} ({when})"
    )
