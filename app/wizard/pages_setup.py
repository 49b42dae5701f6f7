"""The first four wizard pages: what to do, with which model, on which data, on which GPUs."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QPlainTextEdit,
    QPushButton,
    QRadioButton,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.planner.gpu_selector import GpuSelector
from rigpilot.app.planner.model_picker import ModelPicker
from rigpilot.app.widgets.form_row import form_row
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.path_field import path_field
from rigpilot.app.wizard.data_check import DataReport, inspect_dataset, inspect_prompts, tokens_text
from rigpilot.app.wizard.host import DATA, GPUS, MODEL, PLAN, REVIEW, WizardHost
from rigpilot.app.wizard.model_check import missing_weights
from rigpilot.app.wizard.node_choice import NodeChoice
from rigpilot.app.wizard.page_base import StepPage
from rigpilot.app.wizard.slurm_choice import SlurmChoice
from rigpilot.app.wizard.state import CALIBRATE, FINETUNE, INFER, KINDS, SCRATCH, SCRIPT
from rigpilot.engine.given_path import PathRefused, check_given_path
from rigpilot.engine.hardware.machine import is_simulated
from rigpilot.engine.models.job_model import describe_for_job

CHECK_DELAY_MS = 300  # typing pauses this long before a model or file is checked
DATA_FILTER = "Text and JSONL (*.txt *.md *.jsonl *.json *.ndjson);;All files (*)"


class TaskPage(StepPage):
    def __init__(self, wizard: WizardHost):
        super().__init__(wizard, "What do you want to do?", "Pick a task; the next pages ask only what it needs.")
        self.group = QButtonGroup(self)
        self.buttons: dict[str, QRadioButton] = {}
        for key, title, what in KINDS:
            button = QRadioButton(title)
            button.setObjectName(f"task-{key}")
            button.setToolTip(what)
            note = QLabel(what)
            note.setWordWrap(True)
            note.setIndent(24)
            note.setBuddy(button)
            self.group.addButton(button)
            self.buttons[key] = button
            self.body.addWidget(button)
            self.body.addWidget(note)
            button.toggled.connect(lambda on, k=key: on and self._chosen(k))
        self.body.addStretch(1)
        self.body.addWidget(self.message)

    def load(self) -> None:
        self.buttons[self.state.kind].setChecked(True)

    def _chosen(self, kind: str) -> None:
        if not self.changing():
            self.state.kind = kind
            self.validate()

    def nextId(self) -> int:
        return GPUS if self.state.kind == CALIBRATE else MODEL


class ModelPage(StepPage):
    def __init__(self, wizard: WizardHost):
        super().__init__(wizard, "Model")
        self.described: Any = None  # the ModelSpec of the model last checked
        self.picker = ModelPicker(config_files=True)
        self.picker.sig_model_changed.connect(self._model_typed)
        self.method = QComboBox()
        self.method.setObjectName("trainMethod")
        self.method.addItem("LoRA adapters (light: only small adapter matrices train)", "lora")
        self.method.addItem("QLoRA (LoRA adapters over a 4-bit NF4 base: least memory)", "qlora")
        self.method.addItem("Full fine-tune (every weight trains: most memory)", "full")
        self.method.currentIndexChanged.connect(self._method_changed)
        self.precision = QComboBox()
        self.precision.setObjectName("precision")
        for p, text in (("bf16", "bf16 mixed precision"), ("fp16", "fp16 mixed precision"), ("fp32", "fp32")):
            self.precision.addItem(text, p)
        self.precision.currentIndexChanged.connect(self._precision_changed)
        self.trust = QCheckBox("Trust remote code: run the model repository's own Python code")
        self.trust.setObjectName("trustRemoteCodeModel")
        self.trust.toggled.connect(self._trust_changed)
        self.trust.hide()
        self.about = QLabel()
        self.about.setObjectName("modelAbout")
        self.about.setWordWrap(True)
        self.scratch_button = QPushButton("Train from scratch instead")
        self.scratch_button.setObjectName("switchToScratch")
        self.scratch_button.setToolTip("Start from random weights built from this config.json")
        self.scratch_button.clicked.connect(self.switch_to_scratch)
        self.scratch_button.hide()
        self.model_box = QGroupBox("Which model")
        ml = QVBoxLayout(self.model_box)
        ml.addWidget(self.picker)
        ml.addWidget(self.trust)
        ml.addWidget(self.about)
        ml.addWidget(self.scratch_button, 0, Qt.AlignmentFlag.AlignLeft)
        self.options = QFormLayout()
        self.method_row = form_row(
            self.options, "Training", self.method,
            "Full trains every weight; LoRA trains small adapters; QLoRA trains adapters over a 4-bit base.",
        )  # fmt: skip
        self.precision_row = form_row(
            self.options, "Precision", self.precision,
            "Training: mixed precision in this dtype (fp32: none). Inference: the weights' dtype.",
        )  # fmt: skip

        self.script, _, row = path_field("scriptPath", "scriptBrowse", "path/to/train.py", self._ask_script)
        self.script.textChanged.connect(self._script_changed)
        self.script_args = QLineEdit()
        self.script_args.setObjectName("scriptArgs")
        self.script_args.setPlaceholderText("--epochs 1 --lr 3e-4")
        self.script_args.textChanged.connect(self._script_changed)
        self.script_box = QGroupBox("Your script")
        sl = QFormLayout(self.script_box)
        sl.addRow("Script", row)
        sl.addRow("Arguments", self.script_args)
        hint = QLabel("Each GPU gets one process (torchrun). Report metrics with: from rigpilot import report")
        hint.setWordWrap(True)
        sl.addRow(hint)

        self.body.addWidget(self.model_box)
        self.body.addLayout(self.options)
        self.body.addWidget(self.script_box)
        self.body.addStretch(1)
        self.body.addWidget(self.message)
        self._timer = QTimer(self, singleShot=True, interval=CHECK_DELAY_MS, timeout=self.validate)

    def load(self) -> None:
        s = self.state
        script = s.kind == SCRIPT
        self.model_box.setVisible(not script)
        self.script_box.setVisible(script)
        self.options.setRowVisible(self.method_row, s.kind == FINETUNE)
        self.options.setRowVisible(self.precision_row, not script)
        self.scratch_button.hide()
        if self.picker.config_button is not None:
            self.picker.config_button.setVisible(s.kind == SCRATCH)
        if s.kind == SCRATCH:
            self.setTitle("Model configuration")
            self.setSubTitle("A config.json (or a folder with one) and a tokenizer beside it; weights start random.")
        elif script:
            self.setTitle("Script")
            self.setSubTitle("The Python script to run on each GPU, and its arguments.")
        else:
            self.setTitle("Model")
            self.setSubTitle("A preset, a local folder with config.json, or a Hugging Face id.")
        if self.picker.model() != s.model:
            self.picker.set_model(s.model, chosen=False)
        self.method.setCurrentIndex(max(self.method.findData(s.method), 0))
        self.precision.setCurrentIndex(max(self.precision.findData(s.precision), 0))
        self.trust.setChecked(s.trust_remote_code)
        self.script.setText(s.script)
        self.script_args.setText(s.script_args)

    # -- edits -----------------------------------------------------------------------------------
    def _model_typed(self, ref: str) -> None:
        if self.changing():
            return
        self.state.model = ref
        self.cancel_checks()
        self.busy = True  # until the check has run: Next must not race it
        self.set_problem(None, note="Checking the model…")
        self._timer.start()

    def _method_changed(self) -> None:
        if not self.changing():
            self.state.method = self.method.currentData()

    def switch_to_scratch(self) -> None:
        """Train the chosen configuration from random weights: the offer made for a folder without weights."""
        self.state.kind = SCRATCH
        self.initializePage()

    def _precision_changed(self) -> None:
        if not self.changing():
            self.state.set_precision(self.precision.currentData())

    def _trust_changed(self, on: bool) -> None:
        if not self.changing():
            self.state.trust_remote_code = on
            self.validate()

    def _script_changed(self) -> None:
        if self.changing():
            return
        self.state.script = self.script.text().strip()
        self.state.script_args = self.script_args.text()
        self.busy = True
        self._timer.start()

    def _ask_script(self) -> None:
        start = str(Path(os.path.expanduser(self.state.script)).parent) if self.state.script else str(Path.home())
        path, _ = QFileDialog.getOpenFileName(self, "Script to run", start, "Python (*.py);;All files (*)")
        if path:
            self.script.setText(path)

    # -- checks ------------------------------------------------------------------------------------
    def validate(self) -> None:
        self._timer.stop()
        s = self.state
        if s.kind == SCRIPT:
            self._validate_script()
            return
        if not s.model:
            self.cancel_checks()
            self.about.setText("")
            what = "a model configuration (config.json)" if s.kind == SCRATCH else "a model"
            self.set_problem(f"Choose {what}.")
            return
        ref, trust = s.model, s.trust_remote_code
        self.check_in_background(
            lambda: (describe_for_job(ref, trust), missing_weights(ref)), self._described, "Checking the model…"
        )

    def _described(self, found: tuple[Any, str | None]) -> None:
        spec, no_weights = found
        self.described = spec
        params = spec.params_total / 1e9
        size = f"{params:.1f}B" if params >= 1 else f"{spec.params_total / 1e6:.1f}M"
        context = f", context {spec.max_position_embeddings} tokens" if spec.max_position_embeddings else ""
        self.about.setText(
            f"{spec.architecture or spec.model_type}: {size} parameters, {spec.num_layers} layers{context}."
        )
        if no_weights and self.state.kind == FINETUNE:
            self.set_problem(
                f"{no_weights} has a config.json but no weights (*.safetensors or *.bin): fine-tuning needs "
                "trained weights. Train from scratch to start from random ones, or choose a folder with weights."
            )
            self.scratch_button.show()
            return
        self.scratch_button.hide()
        # A sequence length from another model (or the defaults) that this one cannot take is set within it.
        self.set_problem(None, note=self.state.fit_to_context(spec.max_position_embeddings))

    def set_problem(self, problem: str | None, *, note: str | None = None, tone: str = "info") -> None:
        if problem and "remote code" in problem.lower():
            self.trust.show()  # the model needs its own code to be described: offer the switch here
        if problem:
            self.about.setText("")
        super().set_problem(problem, note=note, tone=tone)

    def _validate_script(self) -> None:
        path, args = self.state.script, self.state.script_args
        if not path:
            self.cancel_checks()
            self.set_problem("Choose the script to run.")
            return
        try:
            shlex.split(args)
        except ValueError as e:
            self.cancel_checks()
            self.set_problem(f"The arguments cannot be read: {e} (check the quotes).")
            return

        def check() -> str | None:
            try:
                p = check_given_path(path, "script")
            except PathRefused as e:
                return f"{e}."
            return None if p.suffix == ".py" else f"{p.name} is not a Python script (.py)."

        self.check_in_background(check, self.set_problem, "Checking the script…")

    def nextId(self) -> int:
        return GPUS if self.state.kind == SCRIPT else DATA


class DataPage(StepPage):
    def __init__(self, wizard: WizardHost):
        super().__init__(wizard, "Data")
        self.report: DataReport | None = None
        self.files = QListWidget()
        self.files.setObjectName("dataFiles")
        self.files.setAccessibleName("Data files")
        self.files.setMaximumHeight(110)
        self.add_button = QPushButton("Add files…")
        set_icon(self.add_button, "add")
        self.add_button.setObjectName("addData")
        self.add_button.clicked.connect(self._ask_files)
        self.remove_button = QPushButton("Remove")
        set_icon(self.remove_button, "remove")
        self.remove_button.setObjectName("removeData")
        self.remove_button.clicked.connect(self._remove_selected)
        self.text_field = QComboBox()
        self.text_field.setObjectName("textField")
        self.text_field.setEditable(True)
        self.text_field.setToolTip("The JSONL field that holds the text (chat and instruction records need none)")
        self.text_field.currentTextChanged.connect(self._text_field_changed)
        self.train_box = QWidget()
        tl = QVBoxLayout(self.train_box)
        tl.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        row.addWidget(self.files, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.add_button)
        buttons.addWidget(self.remove_button)
        buttons.addStretch(1)
        row.addLayout(buttons)
        tl.addWidget(QLabel("Training files: plain text, JSONL with a text field, or instruction / chat JSONL"))
        tl.addLayout(row)
        field_row = QFormLayout()
        field_row.addRow("Text field (JSONL)", self.text_field)
        tl.addLayout(field_row)

        self.prompts_file, _, prow = path_field(
            "promptsFile", "promptsBrowse", 'prompts.jsonl with a "prompt" field per line (or type prompts below)',
            self._ask_prompts,
        )  # fmt: skip
        self.prompts_file.textChanged.connect(self._prompts_changed)
        self.prompts = QPlainTextEdit()
        self.prompts.setObjectName("promptsText")
        self.prompts.setPlaceholderText("One prompt per line")
        self.prompts.setTabChangesFocus(True)
        self.prompts.setMaximumHeight(110)
        self.prompts.textChanged.connect(self._prompts_changed)
        self.infer_box = QWidget()
        il = QFormLayout(self.infer_box)
        il.setContentsMargins(0, 0, 0, 0)
        il.addRow("Prompts file", prow)
        il.addRow("Or prompts", self.prompts)

        self.summary = QLabel()
        self.summary.setObjectName("dataSummary")
        self.summary.setWordWrap(True)
        self.preview = QPlainTextEdit()
        self.preview.setObjectName("dataPreview")
        self.preview.setReadOnly(True)
        self.preview.setTabChangesFocus(True)
        self.preview.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.preview.setPlaceholderText("The first records of each file show here.")
        self.body.addWidget(self.train_box)
        self.body.addWidget(self.infer_box)
        self.body.addWidget(self.summary)
        self.body.addWidget(QLabel("Preview"))
        self.body.addWidget(self.preview, 1)
        self.body.addWidget(self.message)
        self._timer = QTimer(self, singleShot=True, interval=CHECK_DELAY_MS, timeout=self.validate)

    def load(self) -> None:
        s = self.state
        infer = s.kind == INFER
        self.train_box.setVisible(not infer)
        self.infer_box.setVisible(infer)
        self.setSubTitle(
            "Prompts to generate from." if infer else "What to train on. Files are checked here; nothing is copied."
        )
        self.files.clear()
        self.files.addItems(s.dataset)
        self.text_field.setCurrentText(s.text_field)
        self.prompts_file.setText(s.prompts_file)
        self.prompts.setPlainText("\n".join(s.prompts))

    # -- edits ---------------------------------------------------------------------------------------
    def _ask_files(self) -> None:
        start = str(Path(self.state.dataset[-1]).parent) if self.state.dataset else str(Path.home())
        paths, _ = QFileDialog.getOpenFileNames(self, "Training data", start, DATA_FILTER)
        if paths:
            self.add_files(paths)

    def add_files(self, paths: list[str]) -> None:
        for p in paths:
            if p not in self.state.dataset:
                self.state.dataset.append(p)
                self.files.addItem(p)
        self.validate()

    def _remove_selected(self) -> None:
        for item in self.files.selectedItems() or ([self.files.currentItem()] if self.files.currentItem() else []):
            self.state.dataset.remove(item.text())
            self.files.takeItem(self.files.row(item))
        self.validate()

    def _text_field_changed(self, text: str) -> None:
        if not self.changing():
            self.state.text_field = text.strip() or "text"
            self.busy = True
            self._timer.start()

    def _prompts_changed(self) -> None:
        if self.changing():
            return
        self.state.prompts_file = self.prompts_file.text().strip()
        self.state.prompts = [p for p in self.prompts.toPlainText().splitlines() if p.strip()]
        self.busy = True
        self._timer.start()

    def _ask_prompts(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Prompts", str(Path.home()), "JSONL (*.jsonl *.json);;All files (*)"
        )
        if path:
            self.prompts_file.setText(path)

    # -- checks ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        self._timer.stop()
        s = self.state
        if s.kind == INFER:
            if s.prompts_file:
                path = s.prompts_file
                self.check_in_background(lambda: inspect_prompts(path), self._show_report, "Reading the prompts…")
            else:
                self.cancel_checks()
                self.report = None
                self.preview.setPlainText("\n".join(s.prompts[:5]))
                self.summary.setText(f"{len(s.prompts)} prompt{'s' if len(s.prompts) != 1 else ''} typed.")
                self.set_problem(None if s.prompts else "Give a prompts file or type at least one prompt.")
            return
        paths, field = list(s.dataset), s.text_field
        self.check_in_background(lambda: inspect_dataset(paths, field), self._show_report, "Reading the data…")

    def _show_report(self, report: DataReport) -> None:
        self.report = report
        lines = []
        for f in report.files:
            if not f.path:
                continue
            lines.append(f"── {Path(f.path).name} ({f.format}, {f.size:,} bytes)")
            lines += [f"   {p}" for p in f.preview]
        self.preview.setPlainText("\n".join(lines))
        known = self.text_field.currentText()
        with_fields = [k for k in report.fields if k != known]
        if with_fields and self.text_field.count() != len(with_fields) + 1:
            with self.quietly():
                self.text_field.clear()
                self.text_field.addItems([known, *with_fields])
                self.text_field.setCurrentText(known)
        if self.state.kind == INFER:
            self.summary.setText(f"Format: {report.files[0].format}." if not report.problem else "")
        else:
            formats = sorted({f.format for f in report.files if f.kind})
            self.summary.setText(
                f"{len(report.files)} file{'s' if len(report.files) != 1 else ''}, {report.total_bytes:,} bytes"
                + (f" ({', '.join(formats)})" if formats else "")
                + f"; {tokens_text(report.token_estimate)}."
            )
        self.set_problem(report.problem)

    def nextId(self) -> int:
        return GPUS


class GpuPage(StepPage):
    def __init__(self, wizard: WizardHost):
        super().__init__(wizard, "GPUs", "Click GPUs in the drawing or tick them below. Busy GPUs are marked.")
        self.selector = GpuSelector(with_graph=True)
        self.selector.sig_selection_changed.connect(self._selected)
        self.queue = QCheckBox("If a chosen GPU is busy, queue the job until it is free")
        self.queue.setObjectName("queueIfBusy")
        self.queue.toggled.connect(self._queue_changed)
        self.note = QLabel()
        self.note.setObjectName("gpuNote")
        self.note.setWordWrap(True)
        self.nodes = NodeChoice()
        self.nodes.sig_changed.connect(self._nodes_changed)
        self.slurm = SlurmChoice()
        self.slurm.sig_changed.connect(self._slurm_changed)
        self.body.addWidget(self.selector, 1)
        self.body.addWidget(self.queue)
        self.body.addWidget(self.nodes)
        self.body.addWidget(self.slurm)
        self.body.addWidget(self.note)
        self.body.addWidget(self.message)
        wizard.busy.sig_changed.connect(self._busy_changed)

    def load(self) -> None:
        machine = self.wiz.machine
        if machine and self.selector.machine is None:
            self.selector.set_machine(machine)
        self.selector.set_busy(self.wiz.busy.busy)
        self.selector.set_selected(self.state.gpus, emit=False)
        self.queue.setChecked(self.state.queue_if_busy)
        self.nodes.load(getattr(self.wiz, "link", None), self.state.nodes)
        self.slurm.load(self.state.slurm)
        self._where_shown()
        simulated = is_simulated(machine)
        self.note.setText(
            "Simulated machine: each chosen GPU runs as one CPU process (a few at most), so keep to two or so."
            if simulated else ""
        )  # fmt: skip
        self.note.setVisible(simulated)

    def machine_changed(self, machine: dict[str, Any]) -> None:
        self.selector.set_machine(machine)
        if self.isVisible():
            self.validate()

    def _selected(self, gpus: list[int]) -> None:
        if not self.changing():
            self.state.gpus = list(gpus)
            self.validate()

    def _nodes_changed(self, names: list[str]) -> None:
        if not self.changing():
            self.state.nodes = list(names)

    def _slurm_changed(self, options: dict[str, str] | None) -> None:
        if not self.changing():
            self.state.slurm = options
            self._where_shown()

    def _where_shown(self) -> None:
        # SLURM chooses the job's nodes and queues it itself: the node list and "queue if busy" do not apply.
        on_slurm = self.state.slurm is not None
        self.nodes.set_allowed(not on_slurm)
        self.queue.setVisible(not on_slurm)

    def _queue_changed(self, on: bool) -> None:
        if not self.changing():
            self.state.queue_if_busy = on
            self.validate()

    def _busy_changed(self, busy: dict[int, list[str]]) -> None:
        self.selector.set_busy(busy)
        if self.isVisible():
            self.validate()

    def validate(self) -> None:
        if self.selector.machine is None:
            self.set_problem("Waiting for the engine to say which GPUs this machine has.")
            return
        if not self.state.gpus:
            self.set_problem("Select at least one GPU.")
            return
        busy = {g: jobs for g, jobs in self.wiz.busy.busy.items() if g in self.state.gpus}
        if busy:
            which = "; ".join(f"GPU {g} runs {', '.join(jobs)}" for g, jobs in sorted(busy.items()))
            if self.state.queue_if_busy:
                self.set_problem(None, note=f"Busy: {which}. The job waits until they are free.", tone="warn")
            else:
                self.set_problem(f"Busy: {which}. Choose free GPUs, or tick the box to queue the job.")
            return
        self.set_problem(None)

    def nextId(self) -> int:
        return PLAN if self.state.planned else REVIEW
