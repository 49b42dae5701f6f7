"""A stand-in for `rigpilot.app.engine_link.EngineLink`, for testing pages without an engine service.

`FakeLink` has the same signals and a `call()` that answers from canned
replies built from real engine objects (simulated machines and their
telemetry), in the shapes `engine/service/server.py` sends. Replies are
delivered later on the GUI thread, as the real link does, and errors too.

    link = FakeLink("8x-a100-pcie", history_seconds=120)
    page = DashboardPage(link)
    link.connect_engine()          # sig_state(connected), sig_machine
    link.push_telemetry(5)         # five live samples, one second apart
    link.replies["plan"] = {"result": {...}}            # any request type
    link.replies["metrics"] = lambda job, **_: {...}    # or a function of the request's arguments
    link.replies["job"] = EngineError("not_found", "no job x")  # or an error
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from rigpilot.engine.api.client import EngineError
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.simulated import Load, SimulatedBackend, load_profile
from rigpilot.engine.hardware.telemetry import TelemetrySample, Tier
from rigpilot.engine.hardware.topology import describe, summarize

CONNECTING, CONNECTED, LOST = "connecting", "connected", "lost"


class FakeClock:
    def __init__(self, start: float):
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_machine(profile: str = "4x-rtx4090") -> Machine:
    return load_profile(profile)


def make_job(
    job_id: str = "job-1", gpus: list[int] | None = None, state: str = "running", name: str = "finetune"
) -> dict[str, Any]:
    """A job record with the fields the GUI reads (the engine's JobRecord.to_dict has more)."""
    return {
        "id": job_id, "seq": 1, "kind": "train", "name": name, "state": state, "gpus": list(gpus or [0]),
        "ranks": len(gpus or [0]), "simulated": True, "created": time.time() - 60, "started": time.time() - 50,
        "ended": None, "exit_reason": None, "last_log": [],
    }  # fmt: skip


class TelemetryFeed:
    """Telemetry of a simulated machine on a controllable clock: live samples and a back-filled history."""

    def __init__(self, machine: Machine, *, start: float | None = None, seed: int = 1):
        self.machine = machine
        self.clock = FakeClock(start if start is not None else time.time())
        self.backend = SimulatedBackend(machine, seed=seed, clock=self.clock)
        self._slow: dict[int, dict[str, Any]] = {}

    def set_load(
        self,
        gpu: int,
        utilization: float = 90.0,
        memory_gib: float = 10.0,
        pid: int = 4242,
        command: str = "python train.py",
    ) -> None:
        self.backend.set_load(gpu, f"test-{gpu}", Load(utilization, int(memory_gib * 2**30), 0.3, pid, command))

    def sample(self, dt: float = 1.0, tier: Tier = Tier.SLOW) -> dict[str, Any]:
        """Advance the clock by `dt` and return a TelemetrySample dict with a host part."""
        self.clock.now += dt
        gpus = self.backend.sample_gpus(tier)
        host = {"cpu_percent": [12.5, 30.0, 5.0, 50.0], "memory_used": 20 * 2**30, "memory_total": 64 * 2**30,
                "swap_used": 0, "swap_total": 8 * 2**30}  # fmt: skip
        d = TelemetrySample(time=self.clock.now, gpus=gpus, simulated=True).to_dict()
        d["host"] = host
        return d

    def history(self, seconds: float, step: float = 1.0) -> list[dict[str, Any]]:
        """`seconds` of samples ending at the clock's current time (the clock moves to the end)."""
        self.clock.now -= seconds
        return [self.sample(step) for _ in range(int(seconds / step))]


class FakeLink(QObject):
    sig_state = Signal(str, str)
    sig_hello = Signal(dict)
    sig_machine = Signal(dict)
    sig_telemetry = Signal(dict)
    sig_job = Signal(dict)
    sig_metrics = Signal(str, list)
    sig_notice = Signal(dict)

    def __init__(
        self,
        profile: str | None = "4x-rtx4090",
        *,
        machine: Machine | None = None,
        history_seconds: float = 0.0,
        jobs: list[dict[str, Any]] | None = None,
        replies: dict[str, Any] | None = None,
        start: float | None = None,
    ):
        super().__init__()
        self.machine_obj = machine or (make_machine(profile) if profile else None)
        self.remote: str | None = None
        self.state = CONNECTING
        self.machine: dict[str, Any] | None = None  # set on connect, as the real link does
        self.notes: list[str] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.watched: set[str] = set()
        self.jobs = list(jobs or [])
        self.feed = TelemetryFeed(self.machine_obj, start=start) if self.machine_obj else None
        self.history = self.feed.history(history_seconds) if self.feed and history_seconds else []
        self.replies: dict[str, Any] = {
            "machine": lambda **_: {"machine": self.machine_obj.to_dict() if self.machine_obj else None, "notes": []},
            "topology": lambda **_: self._topology(),
            "telemetry_history": self._telemetry_history,
            "jobs": lambda **_: {"jobs": copy.deepcopy(self.jobs)},
            "job": lambda job, **_: {"job": next(j for j in self.jobs if j["id"] == job)},
            "metrics": lambda job, **_: {"job": job, "records": [], "cursor": {}, "more": False, "state": "running"},
            "plan": EngineError("unavailable", "no plan reply configured in FakeLink"),
            "doctor_report": lambda **_: {"report": None, "why": "never", "running": None},
        }
        self.replies.update(replies or {})

    # -- the EngineLink interface ---------------------------------------------------------------
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def watch_metrics(self, job_id: str) -> None:
        self.watched.add(job_id)

    def unwatch_metrics(self, job_id: str) -> None:
        self.watched.discard(job_id)

    def call(
        self,
        rtype: str,
        on_done: Callable[[Any], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        **args: Any,
    ) -> None:
        self.calls.append((rtype, args))
        answer = self.replies.get(rtype, EngineError("invalid", f"FakeLink has no reply for {rtype!r}"))
        try:
            result = answer(**args) if callable(answer) else answer
            if isinstance(result, BaseException):
                raise result
        except BaseException as e:
            error: BaseException | None = e
            result = None
        else:
            error = None
            result = copy.deepcopy(result)

        def deliver() -> None:
            if error is not None:
                if on_error is not None:
                    on_error(error)
            elif on_done is not None:
                on_done(result)

        QTimer.singleShot(0, deliver)  # later, on the GUI thread, like a reply from the worker pool

    # -- driving it from a test -------------------------------------------------------------------
    def connect_engine(self, detail: str = "local") -> None:
        self.machine = self.machine_obj.to_dict() if self.machine_obj else None
        self.state = CONNECTED
        self.sig_hello.emit(
            {"service": "rigpilot-engine", "machine": self.machine.get("label") if self.machine else ""}
        )
        if self.machine is not None:
            self.sig_machine.emit(self.machine)
        self.sig_state.emit(CONNECTED, detail)

    def lose_engine(self, why: str = "connection reset") -> None:
        self.state = LOST
        self.sig_state.emit(LOST, why)

    def push_telemetry(self, n: int = 1, dt: float = 1.0) -> list[dict[str, Any]]:
        """Emit `n` live samples `dt` seconds apart; they also go into the history the engine would keep."""
        assert self.feed is not None, "FakeLink(profile=None) has no telemetry"
        out = []
        for _ in range(n):
            s = self.feed.sample(dt)
            self.history.append(s)
            self.sig_telemetry.emit(s)
            out.append(s)
        return out

    def push_job(self, job: dict[str, Any]) -> None:
        self.jobs = [j for j in self.jobs if j["id"] != job["id"]] + [job]
        self.sig_job.emit(job)

    def push_metrics(self, job_id: str, records: list[dict[str, Any]]) -> None:
        self.sig_metrics.emit(job_id, records)

    def requests(self, rtype: str) -> list[dict[str, Any]]:
        return [args for t, args in self.calls if t == rtype]

    # -- canned replies in the server's shapes ------------------------------------------------------
    def _telemetry_history(self, since: float | None = None, limit: int = 3600, **_: Any) -> dict[str, Any]:
        newer = [s for s in self.history if since is None or s["time"] > since]
        page = newer[:limit]
        return {"samples": page, "more": len(newer) > limit, "next_since": page[-1]["time"] if page else since}

    def _topology(self) -> dict[str, Any]:
        m = self.machine_obj
        assert m is not None
        gpus = [g.index for g in m.gpus]
        cells = [[("X" if a == b else (m.pair(a, b).topo_code if m.pair(a, b) else None)) for b in gpus] for a in gpus]
        return {"matrix": {"gpus": gpus, "cells": cells}, "summary": summarize(m).to_dict(), "description": describe(m)}


# -- helpers for GUI tests ------------------------------------------------------------------------------
# Messages from the offscreen platform plugin itself, not from the code under test.
IGNORED_QT_MESSAGES = ("This plugin does not support propagateSizeHints()",)


class QtMessages:
    """Collects Qt warnings while installed; `qt_warnings` (below) fails a test that produced any."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._previous = None

    def install(self) -> None:
        from PySide6.QtCore import qInstallMessageHandler

        self._previous = qInstallMessageHandler(self._handle)

    def uninstall(self) -> None:
        from PySide6.QtCore import qInstallMessageHandler

        qInstallMessageHandler(self._previous)

    def _handle(self, kind: Any, context: Any, message: str) -> None:
        from PySide6.QtCore import QtMsgType

        if (
            kind in (QtMsgType.QtWarningMsg, QtMsgType.QtCriticalMsg, QtMsgType.QtFatalMsg)
            and message not in IGNORED_QT_MESSAGES
        ):
            self.messages.append(message)


def focusable_widgets(root: Any) -> list[Any]:
    """Widgets under `root` that Tab should reach: visible, enabled, accepting Tab focus."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QWidget

    found = []
    for w in root.findChildren(QWidget):
        if w.isVisible() and w.isEnabled() and w.focusPolicy() & Qt.FocusPolicy.TabFocus and w.focusProxy() is None:
            found.append(w)
    return found


def tab_through(root: Any, qtbot: Any, limit: int = 400) -> list[Any]:
    """Press Tab from the first focusable widget until focus comes back; the widgets visited, in order."""
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication

    root.activateWindow()
    start = focusable_widgets(root)[0]
    start.setFocus(Qt.FocusReason.TabFocusReason)
    qtbot.waitUntil(lambda: QApplication.focusWidget() is start)
    visited = [start]
    for _ in range(limit):
        QTest.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        current = QApplication.focusWidget()
        if current is start or current is None:
            break
        if current not in visited:
            visited.append(current)
    return visited


def fail_on_qt_warnings():
    """For an autouse fixture: `yield from fail_on_qt_warnings()` fails the test on any Qt warning."""
    import pytest

    messages = QtMessages()
    messages.install()
    try:
        yield messages
    finally:
        messages.uninstall()
    if messages.messages:
        pytest.fail("Qt warnings:\n" + "\n".join(messages.messages))


def isolated_config(tmp_path: Any, monkeypatch: Any):
    """For a fixture: engine settings (XDG) and QSettings go under `tmp_path`, never the user's files."""
    from PySide6.QtCore import QCoreApplication, QSettings

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    # A job that ends while the window is inactive pops up a desktop notification (app.desktop_notify): never on
    # the desktop of whoever runs the tests. A bus address that leads nowhere (unset, gdbus would autolaunch one).
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", f"unix:path={tmp_path / 'no-session-bus'}")
    org, app = QCoreApplication.organizationName(), QCoreApplication.applicationName()
    QCoreApplication.setOrganizationName("RigpilotTests")
    QCoreApplication.setApplicationName("Rigpilot")
    for fmt in (QSettings.Format.NativeFormat, QSettings.Format.IniFormat):
        QSettings.setPath(fmt, QSettings.Scope.UserScope, str(tmp_path / "qt"))
    try:
        yield tmp_path
    finally:
        QCoreApplication.setOrganizationName(org)
        QCoreApplication.setApplicationName(app)


# -- planner and submission replies --------------------------------------------------------------------------


def real_plan_reply(machine: Machine) -> Callable[..., dict[str, Any]]:
    """A `plan` reply computed by the real planner on `machine`, as engine/service/server.py does it (and a
    `recheck` of a changed plan, as the planner process answers it).

    link.replies["plan"] = real_plan_reply(link.machine_obj)
    """
    default_machine = machine

    def plan(model: str, workload: dict[str, Any] | None = None, gpus: list[int] | None = None,
             options: dict[str, Any] | None = None, trust_remote_code: bool = False,
             machine: Any = None, recheck: dict[str, Any] | None = None, verify: bool = True,
             trace: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        from rigpilot.engine.api.protocol import ProtocolError
        from rigpilot.engine.errors import UserError
        from rigpilot.engine.models.job_model import describe_for_job
        from rigpilot.engine.planner.overrides import Overrides
        from rigpilot.engine.planner.plan import LoraSettings, Workload
        from rigpilot.engine.planner.recheck import PlanChecker
        from rigpilot.engine.planner.search import SearchOptions, search
        from rigpilot.engine.service.planworker import plan_machine

        try:  # the machine asked for, checked as the engine's planner process checks it
            target = plan_machine(machine) if machine is not None else default_machine
        except ProtocolError as e:
            raise EngineError(e.code, e.message) from None
        except UserError as e:
            raise _as_replied(e) from None
        if trace is not None:  # one plan's memory traced, as the planner process does it
            from rigpilot.engine.service.planworker import _trace

            return {"result": _trace(trace, trust_remote_code)}
        if recheck is not None:  # the user's changes to a plan, re-checked as the planner process does it
            try:
                spec = describe_for_job(model, trust_remote_code=trust_remote_code)
                checker = PlanChecker(spec, target)
                return {"result": checker.check(recheck["plan"], Overrides(**recheck.get("overrides", {})), gpus)}
            except UserError as e:
                raise _as_replied(e) from None
        work = dict(workload or {})
        if work.get("lora") is not None:
            work["lora"] = LoraSettings(**work["lora"])
        try:
            spec = describe_for_job(model, trust_remote_code=trust_remote_code)
            result = search(
                spec, target, Workload(model=model, **work), gpus=gpus, options=SearchOptions(**(options or {}))
            )
        except UserError as e:
            raise _as_replied(e) from None
        from rigpilot.engine.planner import verify as verification

        if verify and verification.enabled() and result.best is not None:
            verification.verify(result)  # as the planner process's search_checked, without the calibration line
        elif not verify:
            pending = len(verification.to_trace(result)) if verification.enabled() else 0
            result.trace = {"traced": 0, "tried": 0, "seconds": 0.0, "pending": pending}
        return {"result": result.to_dict()}

    return plan


def accept_checks(link: FakeLink, max_cpu_ranks: int = 4) -> list[dict[str, Any]]:
    """Make `check` answer as the engine does: the real submission path (engine.jobs.submission.prepare)
    on the link's machine, creating nothing; a job it refuses fails with the refusal as an EngineError.
    Returns the list the checked requests go into."""
    checked: list[dict[str, Any]] = []

    def check(
        spec: dict[str, Any], plan: dict[str, Any] | None = None, cwd: str | None = None,
        slurm: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        from rigpilot.engine.errors import UserError
        from rigpilot.engine.jobs import slurm as slurm_jobs
        from rigpilot.engine.jobs.submission import describe, prepare, would_run

        checked.append({"spec": spec, "plan": plan, "cwd": cwd, "slurm": slurm})
        try:
            options = slurm_jobs.check_options(slurm) if slurm is not None else None
            sub = prepare(spec, plan, cwd, job_id="check", machine=link.machine_obj, max_cpu_ranks=max_cpu_ranks)
            lines = describe(sub)
            if options is not None:  # no cluster here: sbatch --test-only answers as a cluster with room would
                lines += slurm_jobs.check(sub, options, slurm_jobs.SlurmCommands(options.get("login"), runner=_sbatch_test_only))
        except UserError as e:
            raise _as_replied(e) from None
        # What the engine's `check` request answers (Supervisor.check), from the same functions.
        return {"ok": True, "lines": lines, "would_run": would_run(sub)}

    link.replies["check"] = check
    return checked


def _sbatch_test_only(argv: list[str], **_: Any) -> Any:
    import subprocess

    answer = "sbatch: Job 7 to start at 2026-11-24T07:00:00 using 2 processors on nodes n1 in partition gpu\n"
    return subprocess.CompletedProcess(argv, 0, "", answer)


def accept_submissions(link: FakeLink, job_id: str = "job-new") -> list[dict[str, Any]]:
    """Make `check` and `submit` succeed, `submit` with a queued job `job_id`; returns the list the submitted
    requests go into."""
    accept_checks(link)
    submitted: list[dict[str, Any]] = []

    def submit(
        spec: dict[str, Any], plan: dict[str, Any] | None = None, cwd: str | None = None,
        slurm: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        submitted.append({"spec": spec, "plan": plan, "cwd": cwd, "slurm": slurm})
        job = make_job(job_id, gpus=spec.get("gpus") or [0], state="queued", name=spec.get("name") or job_id)
        job["kind"] = spec.get("kind", "train")
        return {"job": job}

    link.replies["submit"] = submit
    return submitted


def _as_replied(e: BaseException) -> EngineError:
    """A refusal as the client raises it after the engine's error reply: the reply's reason and fields."""
    from rigpilot.engine.api import protocol

    return EngineError.of_reply(protocol.refusal_reply(None, e)["error"])  # type: ignore[arg-type]
