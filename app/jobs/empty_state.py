"""What the Jobs page shows with no job open: a way to start one.

Two buttons: "Run the example job" submits the wizard's first-run job (the
shipped tiny model and text, under the plan recommended for this machine) in
one click, and "New job…" opens the wizard. The wording follows the job list:
"no jobs yet" before the first one, "select a job" once there are some.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractItemModel, Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from rigpilot.app.widgets.engine_messages import machine_dict
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import mark_primary
from rigpilot.app.wizard.state import examples_present

NO_JOBS = (
    "No jobs yet. Run the example job to see a training run from start to finish, "
    "or start your own (New job…, Ctrl+N on any page)."
)
NO_EXAMPLE = "The example model and data are not installed with this copy of Rigpilot."
NO_JOB_OPEN = "Select a job to see its charts, its log and what it predicted — or start a new one (Ctrl+N)."


class JobsEmptyState(QWidget):
    sig_submitted = Signal(str)  # the example job's id, once the engine took it
    sig_message = Signal(str)  # a line for the user: why the example did not start

    def __init__(self, link: Any, jobs: QAbstractItemModel, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("noJob")
        self.link = link
        self.jobs = jobs
        self._submitting = False
        self.text = QLabel()
        self.text.setObjectName("noJobText")
        self.text.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.text.setWordWrap(True)
        self.example_button = QPushButton("&Run the example job")
        set_icon(self.example_button, "run")
        mark_primary(self.example_button)
        self.example_button.setObjectName("runExample")
        self.example_button.setToolTip(
            "Trains the shipped tiny model (tiny-llama) on the shipped text for 30 steps, "
            "under the plan recommended for this machine: a minute or two."
        )
        self.example_button.clicked.connect(self.run_example)
        if not examples_present():
            self.example_button.setEnabled(False)
            self.example_button.setToolTip(NO_EXAMPLE)
        self.new_button = QPushButton("New job…")
        set_icon(self.new_button, "new-job")
        self.new_button.setObjectName("newJobButton")
        self.new_button.setToolTip("Open the job wizard (Ctrl+N, from any page)")
        self.new_button.clicked.connect(self.new_job)
        self.status = QLabel()
        self.status.setObjectName("exampleStatus")
        self.status.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.example_button)
        buttons.addWidget(self.new_button)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addStretch(1)
        layout.addWidget(self.text)
        layout.addLayout(buttons)
        layout.addWidget(self.status)
        layout.addStretch(2)
        for signal in (jobs.rowsInserted, jobs.rowsRemoved, jobs.modelReset):
            signal.connect(self._update_text)
        self.sig_message.connect(self.status.setText)
        self._update_text()

    def _update_text(self) -> None:
        self.text.setText(NO_JOB_OPEN if self.jobs.rowCount() else NO_JOBS)

    def new_job(self) -> None:
        """The main window's New job… (one wizard at a time); a page on its own opens one of its own."""
        window = self.window()
        opener = getattr(window, "new_job", None)
        if callable(opener):
            opener()
            return
        from rigpilot.app.wizard.wizard import open_wizard  # on first use: not needed to paint the page

        open_wizard(self.link, window)

    def run_example(self) -> None:
        """Plan and submit the example job; the page opens it once the engine has taken it."""
        if self._submitting:
            return
        from rigpilot.app.wizard.engine_requests import run_example

        if not examples_present():
            self.sig_message.emit(NO_EXAMPLE)
            return
        jobs: list[dict[str, Any]] = getattr(self.jobs, "jobs", lambda: [])()
        self._set_submitting(True, "Planning the example job for this machine…")
        run_example(self.link, machine_dict(getattr(self.link, "machine", None)), jobs, self._submitted, self._failed)

    def _submitted(self, job_id: str) -> None:
        self._set_submitting(False, f"Example job {job_id} submitted.")
        self.sig_submitted.emit(job_id)

    def _failed(self, message: str) -> None:
        self._set_submitting(False, "")
        self.sig_message.emit(f"The example job did not start: {message}")

    def _set_submitting(self, on: bool, text: str) -> None:
        self._submitting = on
        self.example_button.setEnabled(not on)
        self.status.setText(text)
