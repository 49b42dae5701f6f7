"""The machine check's state for one page, kept current from the EngineLink.

It asks the engine (`doctor_report`) on connecting, when the engine switches machines, and when a doctor job
ends (the normal "job" event); between those, job events of kind "doctor" say a check runs and how far it
got. The engine may still be storing a check whose job just ended (`running` still names it): then it asks
again shortly, a bounded number of times, rather than show "running" for a job that is over.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from rigpilot.app.doctor.model import CheckState, state_of
from rigpilot.app.engine_link import CONNECTED
from rigpilot.engine.schema import TERMINAL_STATES

DOCTOR_KIND = "doctor"
KEEP_RETRY_MS = 400  # how soon to ask again while the engine stores an ended check
KEEP_RETRIES = 40  # about the CLI's wait for it (engine/cli/doctor.py KEEP_WAIT_S), then show what there is
ENDED = {s.value for s in TERMINAL_STATES}


class CheckSource(QObject):
    sig_changed = Signal(object)  # CheckState: a new answer from the engine, or a check started or ended
    sig_progress = Signal()  # the running check's job or its latest status changed

    def __init__(self, link: Any, parent: QObject | None = None, *, follow_progress: bool = False):
        super().__init__(parent)
        self.link = link
        self.state = CheckState()
        self.loaded = False  # an answer (or a failure to get one) has come
        self.job: dict[str, Any] | None = None  # the doctor job running (or last seen)
        self.status: dict[str, Any] | None = None  # its ranks' latest status record (which check, which GPUs)
        self._follow = follow_progress
        self._watching: str | None = None
        self._retries = 0
        self._retry = QTimer(self, singleShot=True, interval=KEEP_RETRY_MS)
        self._retry.timeout.connect(self.refresh)
        self._machine = (getattr(link, "machine", None) or {}).get("label")
        link.sig_state.connect(self._on_link_state)
        link.sig_machine.connect(self._on_machine)
        link.sig_job.connect(self.on_job)
        if follow_progress:
            link.sig_metrics.connect(self._on_metrics)
        if getattr(link, "state", None) == CONNECTED:
            self.refresh()

    # -- asking the engine --------------------------------------------------------------------------
    def refresh(self) -> None:
        self.link.call("doctor_report", on_done=self._on_reply, on_error=self._on_error)

    def _on_link_state(self, state: str, _detail: str) -> None:
        if state == CONNECTED:
            self._retries = 0
            self.refresh()

    def _on_machine(self, machine: dict[str, Any]) -> None:
        # A check stands for one machine: another one (Settings switched it) has its own, or none. The machine
        # a connection brings is asked about on CONNECTED already.
        label = machine.get("label") if isinstance(machine, dict) else None
        if label != self._machine and self._machine is not None:
            self.refresh()
        self._machine = label

    def _on_reply(self, reply: Any) -> None:
        state = state_of(reply)
        if state.running and self.job is not None and self.job.get("id") == state.running:
            if self.job.get("state") in ENDED and self._retries < KEEP_RETRIES:
                self._retries += 1  # its job is over: the report is a moment away
                self._retry.start()
                return
            if self.job.get("state") in ENDED:  # waited long enough: show what the engine has, not "running"
                state.running = None
        self._retries = 0
        if state.running and (self.job is None or self.job.get("id") != state.running):
            self.job = {"id": state.running, "state": "running", "kind": DOCTOR_KIND}
            self.status = None
        self._watch(state.running)
        self._set(state)

    def _on_error(self, error: BaseException) -> None:
        self._set(CheckState(error=f"Could not ask the engine for the machine check: {error}"))

    def _set(self, state: CheckState) -> None:
        self.state = state
        self.loaded = True
        self.sig_changed.emit(state)

    # -- a check running ------------------------------------------------------------------------------
    def on_job(self, job: dict[str, Any]) -> None:
        if job.get("kind") != DOCTOR_KIND:
            return
        self.job = dict(job)
        if job.get("state") in ENDED:
            self._watch(None)
            self._retries = 0
            self.refresh()  # the engine keeps the report once the job ends: ask for it
            return
        if self.state.running != job.get("id"):
            self.status = None
            self._watch(job.get("id"))
            self._set(CheckState(self.state.report, self.state.why, job.get("id"), self.state.error))
        self.sig_progress.emit()

    def started(self, job: dict[str, Any]) -> None:
        """doctor_start answered with its job: show it running at once (its events follow)."""
        self.on_job(job)

    def _on_metrics(self, job_id: str, records: list[dict[str, Any]]) -> None:
        if job_id != self.state.running:
            return
        latest = next((r for r in reversed(records) if r.get("kind") == "status" and r.get("check")), None)
        if latest is not None:
            self.status = latest
            self.sig_progress.emit()

    def _watch(self, job_id: str | None) -> None:
        if not self._follow or job_id == self._watching:
            return
        if self._watching is not None:
            self.link.unwatch_metrics(self._watching)
        self._watching = job_id
        if job_id is not None:
            self.link.watch_metrics(job_id)
