"""The last two wizard pages: review everything (and the equivalent command), then launch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtGui import QFont, QGuiApplication
from PySide6.QtWidgets import QFormLayout, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton

from app.planner.export_bar import ExportBar
from app.planner.model import summary_lines
from app.wizard.page_base import LAUNCH, StepPage
from app.wizard.state import CALIBRATE, INFER, KIND_TITLES, SCRIPT, WizardState, default_name

if TYPE_CHECKING:
    from app.wizard.wizard import JobWizard


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
        if s.train_method == "lora":
            lines.append(
                f"LoRA rank {t.lora_rank}, alpha {t.lora_alpha}, targets {','.join(t.lora_targets or ['default'])}"
            )
    elif s.kind == INFER:
        i = s.infer
        lines.append(
            f"New tokens {i.max_new_tokens}, batch {i.batch_size}, temperature {i.temperature:g}, top-p {i.top_p:g}"
        )
    if s.planned:  # the kinds that load a model, where its own code could run
        lines.append(
            f"Trust remote code: {'ON — the model repository code will run' if s.trust_remote_code else 'off'}"
        )
    return lines


class ReviewPage(StepPage):
    def __init__(self, wizard: JobWizard):
        super().__init__(wizard, "Review", "Everything the job will run with. Back changes any of it.")
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
        self.copy_button.setObjectName("copyCommand")
        self.copy_button.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.command.toPlainText()))
        self.exports = ExportBar(title="Export the plan:")
        self.exports.sig_exported.connect(
            lambda target, paths: self.set_problem(None, note="Saved " + " and ".join(paths))
        )
        self.exports.sig_export_failed.connect(lambda text: self.set_problem(None, note=text))
        form = QFormLayout()
        form.addRow("Job name", self.name)
        self.body.addLayout(form)
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

    def refresh(self) -> None:
        s = self.state
        label = (self.wiz.machine or {}).get("label", "")
        spec = json.dumps(s.to_spec(), indent=2)
        self.summary.setPlainText("\n".join([*describe_state(s, label), "", "Job specification (JSON):", spec]))
        self.command.setPlainText(s.command())

    def _name_changed(self, text: str) -> None:
        if not self.changing():
            self.state.name = text.strip()
            self.refresh()

    def nextId(self) -> int:
        return LAUNCH


class LaunchPage(StepPage):
    def __init__(self, wizard: JobWizard):
        super().__init__(wizard, "Launch", "Submitting the job to the engine.")
        self.status = QLabel()
        self.status.setObjectName("launchStatus")
        self.status.setWordWrap(True)
        self.retry = QPushButton("Try again")
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
