"""The last two wizard pages: review everything (and the equivalent command), then launch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PySide6.QtGui import QFont, QGuiApplication
from PySide6.QtWidgets import QFormLayout, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QWizard

from rigpilot.app.planner.export_bar import ExportBar
from rigpilot.app.planner.model import error_text, summary_lines
from rigpilot.app.widgets.form_row import form_row
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.wizard.host import LAUNCH, WizardHost
from rigpilot.app.wizard.page_base import StepPage
from rigpilot.app.wizard.state import (
    CALIBRATE,
    INFER,
    INFER_BACKEND_CHOICES,
    KIND_TITLES,
    SCRIPT,
    WizardState,
    default_name,
)
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.api.protocol import UNKNOWN_TYPE


def describe_state(s: WizardState, machine_label: str = "") -> list[str]:
    """The configuration in words, one line per choice."""
    lines = [f"Task: {KIND_TITLES[s.kind]}"]
    if s.kind == SCRIPT:
        lines.append(f"Script: {s.script} {s.script_args}".rstrip())
    elif s.model and s.kind != CALIBRATE:
        lines.append(f"Model: {s.model}")
    if s.training:
        lines.append(f"Method: {s.train_method}, {s.train.precision}")
        lines.append("Data: " + ", ".join(Path(d).name for d in s.dataset))
    elif s.kind == INFER:
        lines.append(f"Prompts: {s.prompts_file or f'{len(s.prompts)} typed'}")
    gpus = ", ".join(map(str, s.job_gpus())) or "none"
    lines.append(f"GPUs: {gpus}" + (f" of {machine_label}" if machine_label else ""))
    if s.planned and s.plan:
        lines += [f"Plan: {line}" if i == 0 else f"      {line}" for i, line in enumerate(summary_lines(s.plan))]
    if s.training:
        t = s.train
        lines.append(
            f"Steps {t.max_steps}, learning rate {t.learning_rate:g}, warm-up {t.warmup_steps}, "
            f"micro-batch {t.micro_batch} × {t.grad_accum} accumulation, sequence length {t.seq_len}"
        )
        lines.append(
            f"Checkpoint every {t.checkpoint_every}, evaluate every {t.eval_every}, seed {t.seed}, "
            f"activation checkpointing {t.activation_checkpointing}"
        )
        if s.adapters:
            lines.append(
                f"{'QLoRA (4-bit NF4 base)' if s.train_method == 'qlora' else 'LoRA'} rank {t.lora_rank}, "
                f"alpha {t.lora_alpha}, targets {','.join(t.lora_targets or ['default'])}"
                + (", merged weights saved too" if t.save_merged else "")
            )
    elif s.kind == INFER:
        i = s.infer
        lines.append(
            f"New tokens {i.max_new_tokens}, batch {i.batch_size}, temperature {i.temperature:g}, "
            f"top-p {i.top_p:g}, seed {i.seed}, engine {dict(INFER_BACKEND_CHOICES).get(i.backend, i.backend)}"
        )
    if s.planned and s.plan:
        p = s.parallelism()
        extras = [f"{p.pp_microbatches} pipeline micro-batches ({p.pp_schedule})"] if p.pp > 1 else []
        extras += ["sequence parallel"] * p.sequence_parallel + ["CPU offload (FSDP2)"] * p.cpu_offload
        if extras:
            lines.append("Parallel settings: " + ", ".join(extras))
    if s.planned:  # the kinds that load a model, where its own code could run
        lines.append(
            f"Trust remote code: {'ON — the model repository code will run' if s.trust_remote_code else 'off'}"
        )
    return lines


def check_lines(reply: dict[str, Any]) -> list[str]:
    """The engine's `check` answer as the lines shown on Review: what it would run, its notes included
    (engine.jobs.submission.describe words them; adding `would_run.notes` again showed each twice)."""
    return [str(line) for line in reply.get("lines") or []]


class ReviewPage(StepPage):
    def __init__(self, wizard: WizardHost):
        super().__init__(
            wizard, "Review", "Everything the job will run with, checked by the engine. Back changes any of it."
        )
        # Next submits from here: say so on the button (Alt+L, as Next is Alt+N on the other pages).
        self.setButtonText(QWizard.WizardButton.NextButton, "&Launch")
        self.verdict: dict[str, Any] | None = None  # the engine's last `check` answer
        self.engine_view = QPlainTextEdit()
        self.engine_view.setObjectName("engineCheck")
        self.engine_view.setAccessibleName("What the engine would run")
        self.engine_view.setReadOnly(True)
        self.engine_view.setTabChangesFocus(True)
        self.engine_view.setMaximumHeight(120)
        self.recheck = QPushButton("Check again")
        set_icon(self.recheck, "refresh")
        self.recheck.setObjectName("recheck")
        self.recheck.clicked.connect(self.validate)
        self.recheck.hide()
        self.name = QLineEdit()
        self.name.setObjectName("jobName")
        self.name.setPlaceholderText("a name to recognise the job by")
        self.name.textChanged.connect(self._name_changed)
        self.summary = QPlainTextEdit()
        self.summary.setObjectName("reviewSummary")
        self.summary.setReadOnly(True)
        self.summary.setTabChangesFocus(True)
        self.command = QPlainTextEdit()
        self.command.setObjectName("commandPreview")
        self.command.setReadOnly(True)
        self.command.setTabChangesFocus(True)
        self.command.setMaximumHeight(96)
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        self.command.setFont(mono)
        self.copy_button = QPushButton("Copy command")
        set_icon(self.copy_button, "copy")
        self.copy_button.setObjectName("copyCommand")
        self.copy_button.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.command.toPlainText()))
        self.exports = ExportBar(title="Export the plan:")
        self.exports.sig_exported.connect(
            lambda target, paths: self.set_problem(None, note="Saved " + " and ".join(paths))
        )
        self.exports.sig_export_failed.connect(lambda text: self.set_problem(None, note=text))
        form = QFormLayout()
        form_row(form, "Job name", self.name, "A name to recognise the job by on the Jobs page.", compact=True)
        self.body.addLayout(form)
        check_row = QHBoxLayout()
        check_row.addWidget(QLabel("What the engine would run:"))
        check_row.addStretch(1)
        check_row.addWidget(self.recheck)
        self.body.addLayout(check_row)
        self.body.addWidget(self.engine_view)
        self.body.addWidget(QLabel("Your choices:"))
        self.body.addWidget(self.summary, 1)
        row = QHBoxLayout()
        row.addWidget(QLabel("Same job from a terminal:"))
        row.addStretch(1)
        row.addWidget(self.copy_button)
        self.body.addLayout(row)
        self.body.addWidget(self.command)
        self.body.addWidget(self.exports)
        self.body.addWidget(self.message)

    def load(self) -> None:
        s = self.state
        self.name.setPlaceholderText(default_name(s))
        self.name.setText(s.name)
        self.refresh()
        self.exports.setVisible(s.planned)
        self.exports.set_plan(s.plan if s.planned else None)

    def validate(self) -> None:
        """Ask the engine to run the whole submission path for these choices, creating nothing."""
        self.verdict = None
        self.recheck.hide()
        self.engine_view.setPlainText("Asking the engine what it would run…")
        self.check_with_engine(self.wiz.check, self._checked, self._refused, "Checking the job with the engine…")

    def _checked(self, reply: dict[str, Any]) -> None:
        self.verdict = reply
        self.engine_view.setPlainText("\n".join(check_lines(reply)) or "The engine takes the job as it is.")
        self.set_problem(None, note="The engine checked the job: Launch starts it.", tone="ok")

    def _refused(self, error: BaseException) -> None:
        self.recheck.show()
        if isinstance(error, EngineError) and error.code == UNKNOWN_TYPE:
            # An engine from before `check`: it still refuses a bad job, only later, on Launch.
            self.engine_view.setPlainText("This engine cannot check a job before it starts.")
            self.set_problem(None, note="Not checked: this engine checks the job when it is launched.", tone="warn")
            return
        message = error_text(error)
        message += "" if message.endswith((".", "!", "?")) else "."
        self.engine_view.setPlainText(f"The engine would refuse this job:\n{message}")
        self.set_problem(f"The engine would refuse this job: {message} Go Back to change it.")

    def refresh(self) -> None:
        s = self.state
        label = (self.wiz.machine or {}).get("label", "")
        spec = json.dumps(s.to_spec(), indent=2)
        self.summary.setPlainText("\n".join([*describe_state(s, label), "", "Job specification (JSON):", spec]))
        self.command.setPlainText(s.command())

    def validatePage(self) -> bool:
        # Launch goes ahead only on the engine's yes: not while it is being asked, never over a refusal.
        return self.isComplete()

    def _name_changed(self, text: str) -> None:
        if not self.changing():
            self.state.name = text.strip()
            self.refresh()

    def nextId(self) -> int:
        return LAUNCH


class LaunchPage(StepPage):
    def __init__(self, wizard: WizardHost):
        super().__init__(wizard, "Launch", "Submitting the job to the engine.")
        self.status = QLabel()
        self.status.setObjectName("launchStatus")
        self.status.setWordWrap(True)
        self.retry = QPushButton("Try again")
        set_icon(self.retry, "refresh")
        self.retry.setObjectName("retryLaunch")
        self.retry.clicked.connect(self.submit)
        self.retry.hide()
        self.body.addWidget(self.status)
        self.body.addWidget(self.retry)
        self.body.addStretch(1)
        self.body.addWidget(self.message)
        self.setFinalPage(True)

    def load(self) -> None:
        self.submit()

    def submit(self) -> None:
        self.retry.hide()
        self.busy = True
        self.status.setText("Submitting…")
        self.set_problem(None)
        self.wiz.submit(self._submitted, self._failed)

    def _submitted(self, job_id: str) -> None:
        self.busy = False
        self.status.setText(f"Job {job_id} submitted.")
        self.set_problem(None)

    def _failed(self, message: str) -> None:
        self.busy = False
        self.status.setText("The engine did not take the job.")
        self.retry.show()
        self.set_problem(f"{message} Go Back to change it, or try again.")

    def nextId(self) -> int:
        return -1
