"""`JobWizard`: a guided way to a running job, one question per page.

Task → Model → Data → GPUs → Plan → Hyper-parameters → Review → Launch; pages a
task does not need are skipped (a script has no data or plan, calibration no
model). All choices live in one `WizardState`, so Back keeps them, the last
ones are remembered in QSettings, and a job or a plan can be cloned into a new
wizard. Launch submits to the engine; on success the wizard emits
`sig_submitted(job_id)`, closes, and the main window shows the job.

    wizard = JobWizard(link, parent=self)                    # last choices, or the shipped tiny example
    wizard = JobWizard.from_plan(plan_dict, link=link, parent=self)
    wizard = JobWizard.from_job(job_dict, link=link, parent=self)

Everything in the app opens it through `open_wizard` (Ctrl+N, the Jobs page, clone).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QSettings, QSize, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import QWidget, QWizard

from rigpilot.app.planner.gpu_selector import BusyGpus
from rigpilot.app.planner.model import error_text
from rigpilot.app.tasks import run_in_background
from rigpilot.app.widgets.engine_messages import machine_dict
from rigpilot.app.widgets.window_size import first_size
from rigpilot.app.wizard import engine_requests
from rigpilot.app.wizard.data_check import DataReport
from rigpilot.app.wizard.host import DATA, GPUS, HYPER, LAUNCH, MODEL, PLAN, REVIEW, TASK
from rigpilot.app.wizard.pages_finish import LaunchPage, ReviewPage
from rigpilot.app.wizard.pages_plan import HyperPage, PlanPage
from rigpilot.app.wizard.pages_setup import DataPage, GpuPage, ModelPage, TaskPage
from rigpilot.app.wizard.state import (
    CALIBRATE,
    FINETUNE,
    INFER,
    SCRIPT,
    WizardState,
    default_gpus,
    default_state,
    state_from_plan,
    state_from_spec,
)
from rigpilot.engine.planner.overrides import Overrides

SETTINGS_KEY = "wizard/last"
# The wizard's window where the screen has room (a 1280×800 one has): its pages are laid out for it.
DESIGN_SIZE = QSize(1000, 720)
_KIND_OF_JOB = {"train": FINETUNE, "infer": INFER, "script": SCRIPT, "calibrate": CALIBRATE}


def land_on_job(widget: QWidget | None, job_id: str) -> None:
    """Show the job's page in the main window `widget` lives in, if it has a jobs page."""
    main = widget.window() if widget is not None else None
    show_page = getattr(main, "show_page", None)
    if show_page is None:
        return
    jobs = show_page("jobs")
    open_job = getattr(jobs, "open_job", None)
    if open_job is not None:
        open_job(job_id)


def open_wizard(
    link: Any, parent: QWidget | None, *, job: dict[str, Any] | None = None, plan: dict[str, Any] | None = None
) -> JobWizard:
    """Show a wizard: filled from `job` (clone) or `plan` (launch with it), else with the last choices (or the
    shipped tiny example). With the main window as `parent`, Launch lands on the new job's page."""
    if job is not None:
        wizard = JobWizard.from_job(job, link=link, parent=parent)
    elif plan is not None:
        wizard = JobWizard.from_plan(plan, link=link, parent=parent)
    else:
        wizard = JobWizard(link, parent)
    wizard.show()  # a window of its own, in front of its parent
    return wizard


class JobWizard(QWizard):
    sig_submitted = Signal(str)  # the new job's id
    sig_submit_failed = Signal(str)  # the message shown on the Launch page

    def __init__(
        self,
        link: Any,
        parent: QWidget | None = None,
        *,
        state: WizardState | None = None,
        settings: QSettings | None = None,
    ):
        super().__init__(parent)
        self.setObjectName("jobWizard")
        self.setWindowTitle("New job")
        self.link = link
        self.settings = settings if settings is not None else QSettings()
        self.machine: dict[str, Any] | None = machine_dict(getattr(link, "machine", None))
        self.busy = BusyGpus(link, self)
        self.job_id: str | None = None
        self.state = state or self.remembered() or default_state(self.machine)
        if not self.state.gpus:
            self.state.gpus = default_gpus(self.machine)

        self.task_page = TaskPage(self)
        self.model_page = ModelPage(self)
        self.data_page = DataPage(self)
        self.gpu_page = GpuPage(self)
        self.plan_page = PlanPage(self)
        self.hyper_page = HyperPage(self)
        self.review_page = ReviewPage(self)
        self.launch_page = LaunchPage(self)
        for page_id, page in (
            (TASK, self.task_page), (MODEL, self.model_page), (DATA, self.data_page), (GPUS, self.gpu_page),
            (PLAN, self.plan_page), (HYPER, self.hyper_page), (REVIEW, self.review_page), (LAUNCH, self.launch_page),
        ):  # fmt: skip
            self.setPage(page_id, page)
        self.setStartId(TASK)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Close")
        # Ctrl+Enter is Next (and Launch on Review) wherever the focus is; while Next waits for a check it does
        # nothing, where Alt+N would type an "n" into the focused field.
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self, self._next_by_key)
        self.button(QWizard.WizardButton.NextButton).setToolTip("Next (Ctrl+Enter)")
        self.resize(first_size(self.screen(), DESIGN_SIZE))  # smaller where the screen is, title bar included
        link.sig_machine.connect(self._on_machine)

    def _next_by_key(self) -> None:
        button = self.button(QWizard.WizardButton.NextButton)
        if button.isVisible() and button.isEnabled():
            button.click()

    # -- other ways in ---------------------------------------------------------------------------
    @classmethod
    def from_plan(cls, plan: dict[str, Any], link: Any, parent: QWidget | None = None, **kw: Any) -> JobWizard:
        """A wizard to launch under `plan` (a Plan dict or a search result); data and settings as last time."""
        wizard = cls(link, parent, **kw)
        wizard.apply_state(state_from_plan(plan, base=wizard.state))
        wizard.state.name = ""
        return wizard

    @classmethod
    def from_job(cls, job: dict[str, Any], link: Any, parent: QWidget | None = None, **kw: Any) -> JobWizard:
        """A wizard filled from a job: a JobSpec dict, a job record carrying `spec` (and `plan`), or a job
        record whose folder (`job_dir`) holds job.json and plan.json, read in the background."""
        spec = job if ("spec_version" in job or "parallelism" in job) else job.get("spec")
        if isinstance(spec, dict):
            state = state_from_spec(spec, job.get("plan"))
        else:
            state = WizardState(
                kind=_KIND_OF_JOB.get(job.get("kind", ""), FINETUNE), name=job.get("name", ""),
                gpus=list(job.get("gpus") or []),
            )  # fmt: skip
        wizard = cls(link, parent, state=state, **kw)
        if not isinstance(spec, dict) and job.get("job_dir"):
            wizard._load_job_folder(Path(job["job_dir"]))
        return wizard

    def _load_job_folder(self, folder: Path) -> None:
        def read() -> WizardState:
            spec = json.loads((folder / "job.json").read_text())
            plan_file = folder / "plan.json"
            plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
            return state_from_spec(spec, plan)

        # A job whose folder cannot be read still gives its kind, name and GPUs.
        run_in_background(read, self.apply_state, lambda e: None)

    def apply_state(self, state: WizardState) -> None:
        """Start over with `state` (a clone whose files arrived, a plan to launch)."""
        self.state = state
        if not state.gpus:
            state.gpus = default_gpus(self.machine)
        self.restart()

    # -- remembering -------------------------------------------------------------------------------
    def remembered(self) -> WizardState | None:
        text = self.settings.value(SETTINGS_KEY)
        if not isinstance(text, str) or not text:
            return None
        try:
            return WizardState.from_json(text)
        except (ValueError, TypeError, KeyError):
            return None  # settings from another version: start from the defaults

    def remember(self) -> None:
        self.settings.setValue(SETTINGS_KEY, self.state.to_json())

    def done(self, result: int) -> None:
        self.remember()
        super().done(result)

    # -- the machine and the data ------------------------------------------------------
    def _on_machine(self, message: dict[str, Any]) -> None:
        d = machine_dict(message)
        if not d:
            return
        self.machine = d
        if not self.state.gpus:
            self.state.gpus = default_gpus(d)
        self.gpu_page.machine_changed(d)

    def data_report(self) -> DataReport | None:
        return self.data_page.report

    # -- talking to the engine ---------------------------------------------------------------------------
    def request_plan(
        self, on_done: Callable[[dict[str, Any]], None], on_error: Callable[[BaseException], None],
        on_formula: Callable[[dict[str, Any]], None] | None = None, on_progress: Callable[[int, int], None] | None = None,
    ) -> engine_requests.PlanCheck:  # fmt: skip
        """A plan for the current choices, from the engine (engine_requests.request_plan: the formula's answer
        first with `on_formula`, then the memory check's)."""
        return engine_requests.request_plan(self.link, self.state, on_done, on_error, on_formula, on_progress)

    def engine_connected(self) -> bool:
        return engine_requests.connected(self.link)

    def recheck(
        self,
        plan: dict[str, Any],
        overrides: Overrides,
        on_done: Callable[[dict[str, Any]], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        """`plan` with the user's changes, re-checked by the engine."""
        engine_requests.recheck(self.link, self.state, plan, overrides, on_done, on_error)

    def submission(self) -> dict[str, Any]:
        """The arguments of the `submit` request for the current choices (and of `check`, the same)."""
        return engine_requests.submission(self.link, self.state)

    def check(self, on_done: Callable[[dict[str, Any]], None], on_error: Callable[[BaseException], None]) -> None:
        """Ask the engine what it would run for these choices, creating nothing: `on_done({"lines", "would_run"})`,
        or `on_error` with the one-line refusal a submission would get."""
        self.link.call("check", on_done=on_done, on_error=on_error, **self.submission())

    def submit(self, on_done: Callable[[str], None], on_error: Callable[[str], None]) -> None:
        """Submit the job once; on success announce it, show it in the main window and close."""
        if self.job_id is not None:
            on_done(self.job_id)
            return
        args = self.submission()

        def submitted(reply: dict[str, Any]) -> None:
            self.job_id = reply["job"]["id"]
            self.remember()
            on_done(self.job_id)
            self.sig_submitted.emit(self.job_id)
            land_on_job(self.parentWidget(), self.job_id)
            self.accept()

        def failed(error: BaseException) -> None:
            message = error_text(error)
            on_error(message)
            self.sig_submit_failed.emit(message)

        self.link.call("submit", on_done=submitted, on_error=failed, **args)
