"""`python -m rigpilot.engine.service.planworker`: the planner in a child process of the engine service.

A plan search is the one request whose work grows with its inputs, and a
Python thread cannot be stopped from outside. Running the search in a child
lets the service kill it when it passes its deadline or its client leaves,
and keeps a model's own code (`trust_remote_code`) out of the service. The
child is reused between requests, so a plan costs the imports once.

Wire: the first stdin line is the machine (Machine.to_dict as JSON); then one
JSON request per line. A request may name another machine to plan for
(`machine`: a simulated profile's id or a machine description, checked by
`plan_machine`); it is planned without this machine's calibration. Each answer is
one JSON line on stdout, `{"result": ...}` or `{"error": {"code", "message", "reason", "fields"}}`
or `{"bug": traceback}`; only JSON flows back to the service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from rigpilot.engine.api import protocol
from rigpilot.engine.api.client import readable
from rigpilot.engine.api.protocol import ProtocolError
from rigpilot.engine.errors import UserError

log = logging.getLogger(__name__)


def plan(machine: Any, model: str, workload: dict[str, Any] | None = None, gpus: list[int] | None = None,
         options: dict[str, Any] | None = None, trust_remote_code: bool = False,
         calibration: dict[str, Any] | None = None, verify: bool = True,
         node_machines: list[Any] | None = None, recheck: dict[str, Any] | None = None,
         trace: dict[str, Any] | None = None, doctor: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One search. `calibration`: the machine's stored calibration file (the service's, never a client's);
    `doctor`: its stored machine check (rigpilot.doctor/1, the service's too), whose broken links and measured
    figures count (planner.machine_check).

    Several machines: `options` carries `nodes` and `internode` (SearchOptions, checked like every option);
    `node_machines` are each node's machine, each checked as `plan_machine` checks the `machine`.
    `recheck` ({"plan", "overrides"}): no search, but that plan with the user's changes (planner.recheck)
    on the `gpus` selected. `trace` ({"plan"}): no search, that plan's memory traced (`_trace`).
    `verify` false: the formula's answer alone, at once; its `trace` says how many plans a client may then
    trace one by one (`pending`) before asking again with `verify` on, which finds them in the trace cache."""
    if recheck is not None:
        from rigpilot.engine.planner import machine_check

        # The links the plan was searched on: a change in the wizard must not bring back a P2P the check turned off.
        searched_on = machine_check.use(doctor if not node_machines else None, machine, gpus).machine
        return {"result": _recheck(searched_on, model, recheck, gpus, trust_remote_code)}
    if trace is not None:
        return {"result": _trace(trace, trust_remote_code)}
    from rigpilot.engine.models.job_model import describe_for_job
    from rigpilot.engine.planner import machine_check
    from rigpilot.engine.planner.calibration import apply_stored
    from rigpilot.engine.planner.plan import PRECISIONS, LoraSettings, Workload
    from rigpilot.engine.planner.search import SearchOptions
    from rigpilot.engine.planner.verify import VERIFY_BUDGET_S, search_checked

    work = dict(workload or {})
    if "model" in work:  # else Workload(model=model, **work) would get it twice
        raise ProtocolError(protocol.INVALID, "plan.workload.model: the model goes in the request's own 'model'")
    protocol.check_dataclass(Workload, {**work, "model": model}, "plan.workload", ignore=frozenset({"lora"}))
    protocol.check_dataclass(SearchOptions, options or {}, "plan.options")
    if work.get("lora") is not None:
        protocol.check_dataclass(LoraSettings, work["lora"], "plan.workload.lora")
        work["lora"] = LoraSettings(**work["lora"])
    try:
        spec = describe_for_job(model, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise UserError(f"cannot read the model {_short(model)}: {e.strerror or e}") from None
    nodes = None
    if node_machines:
        if not isinstance(node_machines, list) or len(node_machines) < 2:
            raise ProtocolError(protocol.INVALID, "plan.node_machines: expected a list of at least two machines")
        nodes = []
        for i, m in enumerate(node_machines):
            try:
                nodes.append(plan_machine(m))
            except ProtocolError as e:
                raise ProtocolError(e.code, e.message.replace("plan.machine", f"plan.node_machines[{i}]", 1)) from None
    w = Workload(model=model, **work)
    checked = machine_check.use(doctor if not nodes else None, machine, gpus)
    calibrated = apply_stored(
        calibration, machine, w.precision if w.precision in PRECISIONS else "bf16", checked=checked.calibration
    )
    # Within the service's deadline for a plan: past the budget the rest stay "not verified".
    result = search_checked(
        spec, machine, w, calibrated, gpus=gpus, options=SearchOptions(**(options or {})), verify=verify,
        trust_remote_code=trust_remote_code, budget_s=VERIFY_BUDGET_S, node_machines=nodes, machine_check=checked,
    )  # fmt: skip
    status = calibrated[1]
    if not verify:
        from rigpilot.engine.planner import verify as verification

        pending = len(verification.to_trace(result)) if verification.enabled() else 0
        result.trace = {"traced": 0, "tried": 0, "seconds": 0.0, "pending": pending}
        if pending:
            # The client's `trace` requests follow: the tracer imports torch while it shows this answer.
            verification.warm_up()
    return {"result": {**result.to_dict(), "calibration": status.to_dict()}}


def _trace(trace: Any, trust: bool) -> dict[str, Any]:
    """One plan's memory traced (from the trace cache when it was before): {"plan": the plan with both figures,
    "outcome": verify.outcome's facts, "line": the explanation's line when formula and trace disagree, or null}."""
    from rigpilot.engine.planner import verify
    from rigpilot.engine.planner.plan import Plan

    if not isinstance(trace, dict) or not isinstance(trace.get("plan"), dict) or set(trace) - {"plan"}:
        raise ProtocolError(protocol.INVALID, "plan.trace: expected {plan}")
    try:
        plan = Plan.from_dict(trace["plan"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(protocol.INVALID, f"plan.trace.plan: not a plan ({e})") from None
    answer = verify.trace_all(
        [plan], trust_remote_code=trust, timeout_s=verify.VERIFY_BUDGET_S, least_s=1.0, warm=True
    )[0]
    outcome = verify.outcome(plan, answer)
    line = verify.apply_trace(plan, answer)
    return {"plan": plan.to_dict(), "outcome": outcome, "line": line}


def _recheck(machine: Any, model: str, recheck: Any, gpus: list[int] | None, trust: bool) -> dict[str, Any]:
    from rigpilot.engine.planner.overrides import Overrides
    from rigpilot.engine.planner.plan import Plan
    from rigpilot.engine.planner.recheck import PlanChecker

    if not isinstance(recheck, dict) or not isinstance(recheck.get("plan"), dict) or set(recheck) - {"plan", "overrides"}:
        raise ProtocolError(protocol.INVALID, "plan.recheck: expected {plan, overrides}")
    overrides = recheck.get("overrides") or {}
    protocol.check_dataclass(Overrides, overrides, "plan.recheck.overrides")
    try:
        Plan.from_dict(recheck["plan"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(protocol.INVALID, f"plan.recheck.plan: not a plan ({e})") from None
    spec = _described(model.strip(), trust, _stamp(model.strip()))
    return PlanChecker(spec, machine).check(recheck["plan"], Overrides(**overrides), gpus)


@functools.lru_cache(maxsize=8)
def _described(model: str, trust: bool, stamp: float | None) -> Any:
    """A recheck follows every change the user makes: the model is described once (again when its file changes)."""
    from rigpilot.engine.models.job_model import describe_for_job

    try:
        return describe_for_job(model, trust_remote_code=trust)
    except OSError as e:
        raise UserError(f"cannot read the model {_short(model)}: {e.strerror or e}") from None


def _stamp(model: str) -> float | None:
    """When a local model's config last changed (None for a preset or a hub id)."""
    path = os.path.expanduser(model)
    for candidate in (os.path.join(path, "config.json"), path):
        with contextlib.suppress(OSError):
            return os.stat(candidate).st_mtime
    return None


def _short(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[:n] + "…")


# What Machine.to_dict writes besides the fields, and what the engine's `machine` message adds: read, not used.
_MACHINE_EXTRAS = frozenset({"label", "schema_version", "calibration"})
_PAIR_ENUMS = {"pcie": "PciePath", "p2p_read": "P2P", "p2p_write": "P2P"}
MAX_GPUS = 4096


def plan_machine(value: Any) -> Any:
    """The machine a `plan` request names: a simulated profile's id, or a machine description (Machine.to_dict,
    e.g. an imported `nvidia-smi` output). Anything else is refused in one line naming what is wrong."""
    from rigpilot.engine.hardware import machine as hw
    from rigpilot.engine.hardware.simulated import list_profiles, load_profile

    if isinstance(value, str):
        known = [p["id"] for p in list_profiles()]
        if value not in known:  # also keeps a path out of the profiles folder
            raise UserError(f"unknown simulated profile {_short(value)}; known profiles: {', '.join(known)}")
        return load_profile(value)
    if not isinstance(value, dict):
        raise ProtocolError(
            protocol.INVALID, "plan.machine: expected a simulated profile's id or a machine description"
        )
    d = {k: v for k, v in value.items() if k not in _MACHINE_EXTRAS}
    where = "plan.machine"
    try:
        source = hw.Source(str(d.get("source")))
    except ValueError:
        choices = ", ".join(s.value for s in hw.Source)
        raise ProtocolError(protocol.INVALID, f"{where}.source: expected one of {choices}") from None
    gpus = d.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        raise ProtocolError(protocol.INVALID, f"{where}.gpus: expected a list of at least one GPU")
    if len(gpus) > MAX_GPUS:
        raise ProtocolError(protocol.INVALID, f"{where}.gpus: at most {MAX_GPUS} GPUs, got {len(gpus)}")
    if d.get("host") is not None:
        protocol.check_dataclass(hw.Host, d["host"], f"{where}.host")
    for i, g in enumerate(gpus):
        protocol.check_dataclass(hw.Gpu, g, f"{where}.gpus[{i}]")
        for name in ("index", "name"):
            if name not in g:
                raise ProtocolError(protocol.INVALID, f"{where}.gpus[{i}]: missing {name!r}")
    pairs = d.get("pairs") or []
    if not isinstance(pairs, list):
        raise ProtocolError(protocol.INVALID, f"{where}.pairs: expected a list")
    for i, p in enumerate(pairs):
        protocol.check_dataclass(hw.GpuPair, p, f"{where}.pairs[{i}]", ignore=frozenset({"topo", *_PAIR_ENUMS}))
        for key, enum in _PAIR_ENUMS.items():
            v = p.get(key)
            if v is not None and v not in {e.value for e in getattr(hw, enum)}:
                raise ProtocolError(protocol.INVALID, f"{where}.pairs[{i}].{key}: unknown value {_short(str(v))}")
    for key in ("nics", "notes"):
        if not isinstance(d.get(key) or [], list):
            raise ProtocolError(protocol.INVALID, f"{where}.{key}: expected a list")
    for key in ("profile", "origin"):
        if not isinstance(d.get(key), str | None):
            raise ProtocolError(protocol.INVALID, f"{where}.{key}: expected a string or null")
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(hw.Machine)})
    if unknown:
        raise ProtocolError(protocol.INVALID, f"{where}: unknown field {unknown[0]!r}")
    try:
        machine = hw.Machine.from_dict({**d, "source": source.value})
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(protocol.INVALID, f"{where}: not a machine description ({e})") from None
    indices = [g.index for g in machine.gpus]
    if len(set(indices)) != len(indices) or min(indices) < 0:
        raise ProtocolError(protocol.INVALID, f"{where}.gpus: GPU indices must be distinct and not negative")
    unknown_memory = [g.index for g in machine.gpus if not g.memory_total]
    if unknown_memory:
        # `topo -m` alone names neither the GPUs nor their memory: nothing to plan against.
        raise UserError(
            f"the memory of GPU {', '.join(map(str, unknown_memory))} on {machine.label} is unknown; "
            "import that machine's `nvidia-smi -q` output too (it names each GPU and its memory)"
        )
    return machine


def _answer(machine: Any, line: bytes) -> dict[str, Any]:
    try:
        args = json.loads(line)
        if args.get("machine") is not None:
            # Another machine: this machine's calibration and check measured other GPUs and links: they do not apply.
            machine, args["calibration"], args["doctor"] = plan_machine(args["machine"]), None, None
        if args.get("node_machines"):
            args["calibration"], args["doctor"] = None, None  # measured on this machine, not on the nodes named
        args.pop("machine", None)
        return plan(machine, **args)
    except ProtocolError as e:
        return {"error": {"code": e.code, "message": e.message}}
    except UserError as e:  # its reason and fields go to the client as they are (protocol.refusal_reply)
        return {"error": protocol.refusal_reply(None, e)["error"]}
    except Exception:
        return {"bug": traceback.format_exc()}


def main() -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the answers
    stdin = sys.stdin.buffer
    from rigpilot.engine.hardware.machine import Machine

    machine = Machine.from_dict(json.loads(stdin.readline()))
    for line in stdin:
        out.write(json.dumps(_answer(machine, line), separators=(",", ":")).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- the service's side ------------------------------------------------------------


class PlanTimeout(Exception):
    """The search passed its deadline (or no planner process came free before it); the child was killed."""


class ClientGone(Exception):
    """The client that asked hung up; its search was stopped."""


class PlannerBug(Exception):
    """The planner process raised something unexpected; its traceback is in the engine log."""


class _Child:
    def __init__(self, machine_line: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rigpilot.engine.service.planworker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )  # stderr: the engine's own log
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.stdin.write(machine_line.encode() + b"\n")
        self.stdin.flush()
        self.idle_since = time.monotonic()

    def ask(self, args: dict[str, Any], deadline: float, client_gone: Callable[[], bool]) -> dict[str, Any]:
        self.stdin.write(json.dumps(args).encode() + b"\n")
        self.stdin.flush()
        fd = self.stdout.fileno()
        buf = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PlanTimeout
            if readable(fd, min(left, 0.25)):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    code = self.proc.wait()
                    raise PlannerBug(f"the planner process exited with code {code} in the middle of a search")
                buf += chunk
                if buf.endswith(b"\n"):
                    return json.loads(buf)
            elif client_gone():
                raise ClientGone

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        for f in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                f.close()
        self.proc.wait()


class PlannerPool:
    """At most `size` planner processes; a search runs in one, with a deadline, and is killed past it."""

    def __init__(self, machine: Any, size: int = 2, idle_s: float = 300.0):
        self._machine_line = json.dumps(machine.to_dict())
        self._size = size
        self._idle_s = idle_s
        self._idle: list[_Child] = []
        self._out = 0  # children handed to requests
        self._cond = threading.Condition()
        self._closed = False

    def plan(self, args: dict[str, Any], deadline: float, client_gone: Callable[[], bool]) -> dict[str, Any]:
        child = self._take(deadline)
        answer = None
        try:
            answer = child.ask(args, deadline, client_gone)
        finally:
            self._give_back(child, reusable=answer is not None)
        if "bug" in answer:
            log.error("the planner failed:\n%s", answer["bug"])
            raise PlannerBug(answer["bug"].strip().splitlines()[-1])
        if "error" in answer:
            err = answer["error"]
            if "reason" in err:  # a refusal: the same UserError again, so it is answered as the child raised it
                refusal = UserError(err["message"], reason=err["reason"])
                refusal.fields = dict(err.get("fields") or {})
                raise refusal
            raise ProtocolError(err["code"], err["message"])
        return answer["result"]

    def _take(self, deadline: float) -> _Child:
        with self._cond:
            while not self._idle and self._out >= self._size:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise PlanTimeout
                self._cond.wait(left)
            self._out += 1
            if self._idle:
                return self._idle.pop()
        try:
            return _Child(self._machine_line)
        except BaseException:
            with self._cond:
                self._out -= 1
                self._cond.notify()
            raise

    def _give_back(self, child: _Child, *, reusable: bool) -> None:
        """Reuse a child that answered; kill one stopped midway (it may still be searching)."""
        if reusable and child.proc.poll() is None and not self._closed:
            child.idle_since = time.monotonic()
            with self._cond:
                self._idle.append(child)
                self._out -= 1
                self._cond.notify()
            return
        child.kill()
        with self._cond:
            self._out -= 1
            self._cond.notify()

    def trim(self) -> None:
        """Let children idle for a while go: each holds the planner's imports in memory."""
        now = time.monotonic()
        with self._cond:
            old = [c for c in self._idle if now - c.idle_since > self._idle_s]
            self._idle = [c for c in self._idle if c not in old]
        for c in old:
            c.kill()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for c in idle:
            c.kill()
