"""The Planner page: will this model fit on these GPUs, and what is the fastest way to split it?

The form on the left asks; the engine's `plan` request answers (or, with no
engine connected, the same planner runs here in a background task). The right
side shows the ranked plans, the chosen plan's memory per GPU against each
GPU's capacity, why it won and why the others lost, suggestions when nothing
fits, exports, and "Launch with this plan…", which opens the job wizard.
Every failure ends up as one line above the results, never a dialog.

The machine planned for is this one (the engine's), a simulated profile or
an imported machine (the list the Topology page keeps): another machine is
planned by the engine too (the `plan` request's `machine`), without this
machine's calibration; its plans export, and launch only on this machine.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, QSignalBlocker, Qt, Signal
from PySide6.QtGui import QShowEvent, QStandardItemModel
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.planner.export_bar import ExportBar
from rigpilot.app.planner.gpu_selector import BusyGpus, GpuSelector
from rigpilot.app.planner.memory_chart import MemoryChart
from rigpilot.app.planner.model import (
    FORCE_TP_TEXT,
    METHODS,
    NODE_LINK_CHOICES,
    NODES_MAX,
    OFFLOAD,
    PRECISIONS,
    QUANTIZATION,
    TASKS,
    PlanRequest,
    context_to_fit,
    error_text,
    gui_words,
    plan_rows,
    plan_runs_here,
    plans_of,
    search_locally,
    summary_lines,
)
from rigpilot.app.planner.model_picker import ModelPicker
from rigpilot.app.planner.rented_view import RentedTable
from rigpilot.app.tasks import run_in_background
from rigpilot.app.topology.imported import HERE, ImportedMachines, plan_block
from rigpilot.app.topology.model import machine_title
from rigpilot.app.widgets.engine_messages import machine_dict
from rigpilot.app.widgets.form_row import form_row
from rigpilot.app.widgets.palette import BAD, GOOD
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.simulated import list_profiles, load_profile
from rigpilot.engine.planner.calibration import NOT_CALIBRATED
from rigpilot.engine.schema import ADAPTER_METHODS

TABLE_COLUMNS = ["#", "Plan", "Layout", "GPUs", "Speed", "Step", "To finish", "Fullest GPU", "Runs here"]
RUNS_HERE_COLUMN = TABLE_COLUMNS.index("Runs here")
FULLEST_COLUMN = TABLE_COLUMNS.index("Fullest GPU")
RUNS_HERE_WIDTH = 160  # a reason is elided to this; its tooltip has the whole sentence
# Suggestions that change what is asked on this machine can be applied to the form; hardware ones cannot.
APPLICABLE_SUGGESTIONS = ("method", "quantize", "seq", "batch", "gpus")
PROFILE, IMPORTED = "profile:", "import:"  # prefixes of the machine list's keys (HERE is the engine's machine)
TARGET_WIDTH = 26  # characters the machine list shows before eliding; each item's tooltip has its whole name


def _combo(name: str, items: list[tuple[Any, str]]) -> QComboBox:
    box = QComboBox()
    box.setObjectName(name)
    for value, text in items:
        box.addItem(text, value)
    return box


def duration_short(seconds: float) -> str:
    """A measured time that never reads "0.00 s": milliseconds below a second."""
    if seconds < 0.001:
        return "under 1 ms"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _spin(name: str, low: int, high: int, value: int, step: int = 1) -> QSpinBox:
    box = QSpinBox()
    box.setObjectName(name)
    box.setRange(low, high)
    box.setValue(value)
    box.setSingleStep(step)
    box.setAccelerated(True)
    return box


def _select(box: QComboBox, value: Any) -> None:
    index = box.findData(value)
    if index >= 0:
        box.setCurrentIndex(index)


class PlannerPage(QWidget):
    sig_plan_ready = Signal(dict)  # the search result (SearchResult.to_dict()) now shown
    sig_plan_failed = Signal(str)  # the message shown instead
    sig_plan_shown = Signal(dict)  # the plan (Plan.to_dict()) the chart, exports and launch now use
    sig_wizard_opened = Signal(object)  # the JobWizard "Launch with this plan…" opened
    sig_job_submitted = Signal(str)  # a job id, submitted from a wizard this page opened

    def __init__(self, link: Any, parent: QWidget | None = None, *, machines: ImportedMachines | None = None):
        super().__init__(parent)
        self.link = link
        self.machines = machines if machines is not None else ImportedMachines(parent=self)
        self.machine: dict[str, Any] | None = None  # the engine's machine
        self._profiles: dict[str, dict[str, Any]] = {}  # simulated profiles loaded, by id
        self.result: dict[str, Any] | None = None
        self.plan: dict[str, Any] | None = None  # the plan shown in the chart
        self.wizard: Any = None
        self._serial = 0  # replies to older requests are dropped

        # -- the form ------------------------------------------------------------------------
        self.picker = ModelPicker()
        self.picker.sig_model_chosen.connect(lambda _: self.request_plan())
        self.task = _combo("task", TASKS)
        self.method = _combo("method", METHODS)
        self.method.setToolTip(
            "Full: every weight trains. LoRA: small adapters train. QLoRA: adapters over a 4-bit base"
        )
        self.lora_rank = _spin("loraRank", 1, 1024, 16)
        self.lora_rank.setToolTip("Rank of the LoRA adapters: more capacity, more memory")
        self.quant = _combo("quantization", QUANTIZATION)
        self.seq_len = _spin("seqLen", 1, 1_048_576, 2048, 256)
        self.seq_len.setToolTip("Tokens per sequence (training) or context of prompt plus answer (inference)")
        self.batch = _spin("batch", 1, 65_536, 16)
        self.new_tokens = _spin("newTokens", 1, 1_048_576, 256, 64)
        self.new_tokens.setToolTip("Tokens generated per sequence; the rest of the context is the prompt")
        self.tokens = QDoubleSpinBox()
        self.tokens.setObjectName("tokenBudget")
        self.tokens.setRange(0.0, 1_000_000.0)
        self.tokens.setDecimals(2)
        self.tokens.setSuffix(" billion tokens")
        # Nothing else depends on it: without a budget the plans still say tokens/s and time per step.
        self.tokens.setSpecialValueText("not set: no time to finish")
        self.tokens.setToolTip(
            "How many tokens to train on, in billions. Set it to get a predicted time to finish "
            "(the “To finish” column); plans are the same either way"
        )
        self.precision = _combo("precision", PRECISIONS)
        self.precision.setToolTip("Training: mixed precision in this dtype. Inference: the weights' dtype")
        self.offload = _combo("offload", OFFLOAD)
        self.offload.setToolTip(
            "CPU offload moves parameters, gradients and optimizer state to host RAM (FSDP2's CPUOffloadPolicy): "
            "it fits larger models and runs slower. Auto tries it only where nothing else fits"
        )
        self.force_tp = QCheckBox(FORCE_TP_TEXT)
        self.force_tp.setObjectName("forceTp")
        self.force_tp.setToolTip(
            "Tensor parallelism is kept within GPUs joined by NVLink or one PCIe switch; "
            "check this to consider it over slower links too"
        )
        workload = QFormLayout()
        workload.addRow("Task", self.task)
        workload.addRow("Method", self.method)
        workload.addRow("LoRA rank", self.lora_rank)
        workload.addRow("Weights", self.quant)
        workload.addRow("Sequence length", self.seq_len)
        self.batch_label = QLabel("Batch")
        workload.addRow(self.batch_label, self.batch)
        workload.addRow("New tokens", self.new_tokens)
        workload.addRow("Train on", self.tokens)
        workload.addRow("Precision", self.precision)
        workload.addRow("CPU offload", self.offload)
        workload.addRow(self.force_tp)
        self.workload_form = workload
        self.task.currentIndexChanged.connect(self._task_changed)
        self.method.currentIndexChanged.connect(self._task_changed)

        self.gpus = GpuSelector()
        self.busy = BusyGpus(link, self)
        self.busy.sig_changed.connect(self._busy_changed)
        self.gpus.sig_selection_changed.connect(self._user_selected)
        self._default_selection = True  # until the user picks, the selection follows which GPUs are free
        self.plan_button = QPushButton("Plan")
        self.plan_button.setObjectName("planButton")
        self.plan_button.setDefault(True)
        self.plan_button.setToolTip("Find the fastest way to split this workload over the selected GPUs")
        self.plan_button.clicked.connect(self.request_plan)
        self.target = QComboBox()
        self.target.setObjectName("planMachine")
        self.target.setAccessibleName("Machine to plan for")
        # A long imported file name elides here instead of widening the form (each item's tooltip has it whole).
        self.target.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.target.setMinimumContentsLength(TARGET_WIDTH)
        self.target.currentIndexChanged.connect(self._target_changed)
        self.target.activated.connect(lambda _: self._plan_if_asked())
        self.target_note = QLabel("")
        self.target_note.setObjectName("planMachineNote")
        self.target_note.setWordWrap(True)
        self.target_note.hide()
        self.status = QLabel("")
        self.status.setObjectName("planStatus")
        self.status.setWordWrap(True)

        form = QWidget()
        form_layout = QVBoxLayout(form)
        model_box = QGroupBox("Model")
        QVBoxLayout(model_box).addWidget(self.picker)
        workload_box = QGroupBox("Workload")
        workload_box.setLayout(workload)
        gpu_box = QGroupBox("GPUs")
        gpu_layout = QVBoxLayout(gpu_box)
        gpu_layout.addWidget(QLabel("Plan for:"))
        gpu_layout.addWidget(self.target)
        gpu_layout.addWidget(self.target_note)
        gpu_layout.addWidget(self.gpus)
        gpu_layout.addLayout(self._nodes_form())
        form_layout.addWidget(model_box)
        form_layout.addWidget(workload_box)
        form_layout.addWidget(gpu_box)
        form_layout.addWidget(self.plan_button)
        form_layout.addWidget(self.status)
        form_layout.addStretch(1)
        self.form_area = QScrollArea()
        self.form_area.setWidgetResizable(True)
        self.form_area.setWidget(form)
        self.form_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.form_area.setFocusPolicy(Qt.FocusPolicy.NoFocus)

        # -- the results ----------------------------------------------------------------------
        self.message = QLabel()
        self.message.setObjectName("planMessage")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.message.setStyleSheet(f"color: {BAD.name()}; font-weight: bold;")
        self.message.hide()
        # A refusal with a known fix (a sequence longer than the model's context) offers it in one click.
        self.fix_button = QPushButton()
        self.fix_button.setObjectName("planFix")
        self.fix_button.clicked.connect(self._apply_fix)
        self.fix_button.hide()
        self._fix: Callable[[], None] | None = None
        self.summary = QLabel("Choose a model and GPUs, then Plan.")
        self.summary.setObjectName("planSummary")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # The splitter below takes any height it is given; keep the headlines readable.
        self.summary.setMinimumHeight(self.summary.fontMetrics().lineSpacing() * 4 + 4)
        self.summary.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)

        # Which speed numbers were measured (and when), or that the priors stand: the engine's planner says.
        self.calibration = QLabel("")
        self.calibration.setObjectName("planCalibration")
        self.calibration.setWordWrap(True)
        self.calibration.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.calibration.hide()

        self.table = QTableWidget(0, len(TABLE_COLUMNS))
        self.table.setObjectName("planTable")
        self.table.setAccessibleName("Ranked plans, best first: within 5% of the fastest, the most free memory")
        self.table.setHorizontalHeaderLabels(TABLE_COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setTabKeyNavigation(False)  # Tab leaves the table; arrows move between plans
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(RUNS_HERE_COLUMN, QHeaderView.ResizeMode.Interactive)
        header.resizeSection(RUNS_HERE_COLUMN, RUNS_HERE_WIDTH)
        self.table.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.table.setWordWrap(False)
        self.table.itemSelectionChanged.connect(self._row_selected)

        self.chart = MemoryChart()
        self.explanation = QPlainTextEdit()
        self.explanation.setObjectName("planExplanation")
        self.explanation.setReadOnly(True)
        self.explanation.setTabChangesFocus(True)
        self.rejected = QTableWidget(0, 3)
        self.rejected.setObjectName("rejectedPlans")
        self.rejected.setHorizontalHeaderLabels(["Family", "Why not", "Needs per GPU"])
        self.rejected.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.rejected.setTabKeyNavigation(False)
        self.rejected.verticalHeader().hide()
        self.rejected.setWordWrap(True)
        rh = self.rejected.horizontalHeader()
        rh.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        rh.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        rh.setSectionResizeMode(2, QHeaderView.ResizeMode.ResizeToContents)
        self.suggestions = QListWidget()
        self.suggestions.setObjectName("planSuggestions")
        self.suggestions.setWordWrap(True)
        self.suggestions.currentRowChanged.connect(self._suggestion_selected)
        self.apply_button = QPushButton("Apply this change")
        self.apply_button.setObjectName("applySuggestion")
        self.apply_button.setEnabled(False)
        self.apply_button.clicked.connect(self.apply_suggestion)
        suggestions_box = QWidget()
        sl = QVBoxLayout(suggestions_box)
        sl.setContentsMargins(0, 0, 0, 0)
        sl.addWidget(QLabel("The smallest changes that make it fit, each checked by planning again:"))
        sl.addWidget(self.suggestions, 1)
        sl.addWidget(self.apply_button, 0, Qt.AlignmentFlag.AlignLeft)
        self.tabs = QTabWidget()
        self.tabs.setObjectName("planDetails")
        self.tabs.addTab(self.explanation, "Why this plan")
        self.tabs.addTab(self.rejected, "Rejected")
        self.tabs.addTab(suggestions_box, "Suggestions")
        self.rented = RentedTable()  # this job here against the rented machines of Settings
        self.tabs.addTab(self.rented, "Rented machines")

        self.exports = ExportBar()
        self.exports.sig_exported.connect(self._exported)
        self.exports.sig_export_failed.connect(self._show_message)
        self.launch_button = QPushButton("Launch with this plan…")
        self.launch_button.setObjectName("launchPlan")
        self.launch_button.setEnabled(False)
        self.launch_button.clicked.connect(self.open_wizard)
        # Two rows, so five export buttons and the launch button fit a 1024-pixel-wide screen.
        actions = QVBoxLayout()
        actions.addWidget(self.exports)
        self.launch_note = QLabel("")
        self.launch_note.setObjectName("launchNote")
        self.launch_note.setWordWrap(True)
        self.launch_note.setStyleSheet(f"color: {BAD.name()};")
        self.launch_note.hide()
        launch_row = QHBoxLayout()
        launch_row.addWidget(self.launch_note, 1)
        launch_row.addWidget(self.launch_button)
        actions.addLayout(launch_row)
        self.export_note = QLabel("")
        self.export_note.setObjectName("exportNote")
        self.export_note.setWordWrap(True)
        self.export_note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.results_splitter = QSplitter(Qt.Orientation.Vertical)
        self.results_splitter.setObjectName("plannerResultsSplitter")
        self.results_splitter.addWidget(self.table)
        self.results_splitter.addWidget(self.chart)
        self.results_splitter.addWidget(self.tabs)
        self.results_splitter.setSizes([170, 300, 170])
        results = QWidget()
        rl = QVBoxLayout(results)
        rl.setContentsMargins(0, 0, 0, 0)
        message_row = QHBoxLayout()
        message_row.addWidget(self.message, 1)
        message_row.addWidget(self.fix_button, 0, Qt.AlignmentFlag.AlignTop)
        rl.addLayout(message_row)
        rl.addWidget(self.summary)
        rl.addWidget(self.calibration)
        rl.addWidget(self.results_splitter, 1)
        rl.addLayout(actions)
        rl.addWidget(self.export_note)

        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("plannerSplitter")
        self.splitter.addWidget(self.form_area)
        self.splitter.addWidget(results)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([360, 760])
        layout = QVBoxLayout(self)
        layout.addWidget(self.splitter)
        self._task_changed()
        self._show_result(None)
        self.machines.sig_changed.connect(self._fill_targets)
        self._fill_targets()

        link.sig_machine.connect(self.on_machine)
        if getattr(link, "machine", None):
            self.on_machine(link.machine)

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        # Scroll up and down only: the form is as wide as its widest row (known once styled), plus the scroll bar.
        form = self.form_area.widget()
        if form is None:
            return
        scroll_bar = self.form_area.verticalScrollBar().sizeHint().width()
        self.form_area.setMinimumWidth(form.minimumSizeHint().width() + scroll_bar + 2 * self.form_area.frameWidth())

    # -- engine events ---------------------------------------------------------------------------
    def on_machine(self, message: dict[str, Any]) -> None:
        d = machine_dict(message)
        if not d:
            return
        self.machine = d
        self.target.setItemText(0, f"This machine ({d.get('label', '')})")
        self.target.setItemData(0, f"This machine ({d.get('label', '')}): the one the engine runs jobs on",
                                Qt.ItemDataRole.ToolTipRole)  # fmt: skip
        if self.target_key() != HERE:
            return
        self.gpus.set_machine(d)
        if self._default_selection or not self.gpus.selected():
            self._default_selection = True
            self.gpus.set_selected(self.gpus.free() or sorted(self.gpus.boxes), emit=False)

    def _busy_changed(self, busy: dict[int, list[str]]) -> None:
        if self.target_key() != HERE:
            return  # jobs run here; another machine's GPUs are all free
        self.gpus.set_busy(busy)
        if self._default_selection:
            self.gpus.set_selected(self.gpus.free() or sorted(self.gpus.boxes), emit=False)

    # -- the machine planned for -------------------------------------------------------------------
    def _fill_targets(self) -> None:
        """This machine, each simulated profile, each imported machine; the choice stays where it was."""
        key = self.target_key() or HERE
        with QSignalBlocker(self.target):
            self.target.clear()
            here = f"This machine ({self.machine.get('label', '')})" if self.machine else "This machine"
            self.target.addItem(here, HERE)
            self.target.setItemData(0, f"{here}: the one the engine runs jobs on", Qt.ItemDataRole.ToolTipRole)
            for p in list_profiles():
                self._add_target(f"Simulated: {p['title']}", PROFILE + p["id"], f"{p['label']} ({p['title']})")
            for entry in self.machines.items():
                self._add_target(entry.title, IMPORTED + entry.key, entry.title, plan_block(entry.machine))
            index = self.target.findData(key)
            self.target.setCurrentIndex(max(index, 0))
        if index < 0:
            self._target_changed()  # the machine chosen went away: back to this one

    def _add_target(self, text: str, key: str, tip: str, blocked: str = "") -> None:
        self.target.addItem(text, key)
        i = self.target.count() - 1
        self.target.setItemData(i, f"{tip}\n{blocked}" if blocked else tip, Qt.ItemDataRole.ToolTipRole)
        if blocked:
            model = self.target.model()
            if isinstance(model, QStandardItemModel):
                model.item(i).setEnabled(False)

    def use_machines(self, machines: ImportedMachines) -> None:
        """Share another page's list of imported machines (the main window gives the Topology page's)."""
        self.machines.sig_changed.disconnect(self._fill_targets)
        self.machines = machines
        machines.sig_changed.connect(self._fill_targets)
        self._fill_targets()

    def target_key(self) -> str:
        return str(self.target.currentData() or HERE)

    def target_machine(self) -> dict[str, Any] | None:
        """Machine.to_dict() of the machine planned for (None until the engine says what this one is)."""
        key = self.target_key()
        if key.startswith(PROFILE):
            pid = key[len(PROFILE) :]
            if pid not in self._profiles:
                self._profiles[pid] = load_profile(pid).to_dict()
            return self._profiles[pid]
        if key.startswith(IMPORTED):
            entry = self.machines.get(key[len(IMPORTED) :])
            return entry.machine if entry else None
        return self.machine

    def _machine_arg(self) -> str | dict[str, Any] | None:
        """The `plan` request's `machine`: None for this one, a profile's id, or an imported machine."""
        key = self.target_key()
        if key.startswith(PROFILE):
            return key[len(PROFILE) :]
        if key.startswith(IMPORTED):
            return self.target_machine()
        return None

    def select_machine(self, key: str, *, plan: bool = False) -> bool:
        """Plan for HERE, a "profile:<id>" or an imported machine's key (as the Topology page names it);
        with `plan`, plan the form's model for it at once."""
        if key != HERE and not key.startswith(PROFILE) and not key.startswith(IMPORTED):
            key = IMPORTED + key
        index = self.target.findData(key)
        if index < 0:
            return False
        self.target.setCurrentIndex(index)
        if plan:
            self._plan_if_asked()
        return True

    def _plan_if_asked(self) -> None:
        # A machine picked by the user: plan the model already in the form for it.
        if self.picker.model().strip():
            self.request_plan()

    def _target_changed(self) -> None:
        d = self.target_machine()
        self._serial += 1  # a reply for the machine before is not for this one
        self.plan_button.setEnabled(True)
        self.status.setText("")
        self._hide_message()
        self._show_result(None)
        self._show_target_note()
        if d is None:
            return
        here = self.target_key() == HERE
        # The engine's verdict on a layout holds on any machine; on another one, "here" would say the wrong thing.
        header = self.table.horizontalHeaderItem(RUNS_HERE_COLUMN)
        if header is not None:
            header.setText("Runs here" if here else "Rigpilot runs it")
            header.setToolTip(
                "Whether Rigpilot's engine runs this layout"
                + ("" if here else " (on that machine, were it installed there)")
            )
        self.gpus.set_busy(self.busy.busy if here else {})
        self.gpus.set_machine(d)
        self._default_selection = True
        self.gpus.set_selected((self.gpus.free() if here else []) or sorted(self.gpus.boxes), emit=False)

    def _show_target_note(self) -> None:
        d = self.target_machine()
        if self.target_key() == HERE or d is None:
            self.target_note.hide()
            self.target.setToolTip("The machine to plan for: this one, a simulated profile, or an imported one")
            return
        here = (self.machine or {}).get("label", "the engine's machine")
        self.target_note.setText(
            f"Planning for {self._target_title()}: this machine's calibration does not apply, "
            f"and jobs launch only on this one ({here}). Export the plans to run them there."
        )
        self.target_note.setToolTip(self.target.currentText())
        self.target_note.show()
        self.target.setToolTip(self.target.currentText())

    def _target_title(self) -> str:
        """The machine planned for, in a few words (an imported machine's file names are in the list's tooltip)."""
        d = self.target_machine()
        return machine_title(Machine.from_dict(d), origin=False) if d else "another machine"

    def _nodes_form(self) -> QFormLayout:
        """Several machines: how many nodes like this one, and the link between them (training only)."""
        self.nodes = _spin("nodes", 1, NODES_MAX, 1)
        self.internode = _combo("internode", NODE_LINK_CHOICES)
        _select(self.internode, PlanRequest(model="").internode)
        form = QFormLayout()
        self.nodes_row = form_row(
            form, "Nodes", self.nodes,
            "Identical machines like this one, each with the selected GPUs. Tensor parallelism stays inside a "
            "node; data or pipeline parallelism spans nodes, and fewer nodes are used where more would not pay.",
            compact=True,
        )  # fmt: skip
        self.internode_row = form_row(
            form, "Link between nodes", self.internode,
            "The network joining the nodes: its bandwidth decides what can cross it each step.", compact=True,
        )  # fmt: skip
        self.nodes_form = form
        self.nodes.valueChanged.connect(self._nodes_changed)
        self._nodes_changed()
        return form

    def _nodes_changed(self) -> None:
        training = self.task.currentData() == "train"
        self.nodes_form.setRowVisible(self.nodes_row, training)
        self.nodes_form.setRowVisible(self.internode_row, training and self.nodes.value() > 1)

    def _user_selected(self, gpus: list[int]) -> None:
        self._default_selection = False

    # -- the form ------------------------------------------------------------------------------------
    def _task_changed(self) -> None:
        training = self.task.currentData() == "train"
        lora = training and self.method.currentData() in ADAPTER_METHODS
        rows = self.workload_form
        rows.setRowVisible(self.method, training)
        rows.setRowVisible(self.lora_rank, lora)
        rows.setRowVisible(self.quant, not training)
        rows.setRowVisible(self.new_tokens, not training)
        rows.setRowVisible(self.tokens, training)
        rows.setRowVisible(self.offload, training)
        if hasattr(self, "nodes_form"):
            self._nodes_changed()
        self.batch_label.setText("Batch (sequences per step)" if training else "Sequences at once")
        self.batch.setToolTip(
            "Sequences per optimizer step, over all GPUs" if training else "Sequences generated at the same time"
        )

    def plan_request(self) -> PlanRequest:
        return PlanRequest(
            model=self.picker.model(),
            task=self.task.currentData(),
            method=self.method.currentData(),
            precision=self.precision.currentData(),
            seq_len=self.seq_len.value(),
            batch=self.batch.value(),
            gpus=self.gpus.selected(),
            lora_rank=self.lora_rank.value(),
            weight_bits=self.quant.currentData(),
            new_tokens=self.new_tokens.value(),
            token_budget=round(self.tokens.value() * 1e9) or None,
            force_tp=self.force_tp.isChecked(),
            offload=self.offload.currentData(),
            nodes=self.nodes.value(),
            internode=self.internode.currentData(),
        )

    def set_request(self, r: PlanRequest) -> None:
        """Fill the form (a suggestion applied, restored settings, a test)."""
        self.picker.set_model(r.model, chosen=False)
        _select(self.task, r.task)
        _select(self.method, r.method)
        _select(self.precision, r.precision)
        _select(self.quant, r.weight_bits)
        self.seq_len.setValue(r.seq_len)
        self.batch.setValue(r.batch)
        self.lora_rank.setValue(r.lora_rank)
        self.new_tokens.setValue(r.new_tokens)
        self.tokens.setValue((r.token_budget or 0) / 1e9)
        self.force_tp.setChecked(r.force_tp)
        _select(self.offload, r.offload)
        self.nodes.setValue(r.nodes)
        _select(self.internode, r.internode)
        if r.gpus:
            self.gpus.set_selected(r.gpus)

    # -- planning --------------------------------------------------------------------------------------
    def request_plan(self) -> None:
        """Plan what the form asks; the answer (or the reason there is none) shows when it arrives."""
        request = self.plan_request()
        problem = request.problem()
        if problem:
            self._show_message(problem)
            return
        self._serial += 1
        serial = self._serial
        self._hide_message()
        self.status.setText(f"Planning {request.model}…")
        self.plan_button.setEnabled(False)
        on_done = lambda reply: self._on_plan(serial, reply)  # noqa: E731
        on_error = lambda e: self._on_plan_error(serial, e)  # noqa: E731
        target = self.target_machine()
        if getattr(self.link, "state", None) == "connected":
            other = self._machine_arg()
            self.link.call(
                "plan", on_done=on_done, on_error=on_error,
                model=request.model, workload=request.workload_args(), gpus=request.gpus,
                options=request.options_args(), **({"machine": other} if other is not None else {}),
            )  # fmt: skip
        elif target is not None:
            run_in_background(lambda: search_locally(request, target), on_done, on_error)
        else:
            self.plan_button.setEnabled(True)
            self.status.setText("")
            self._show_message("Not connected to the engine yet, and no machine is known to plan for.")

    def _on_plan(self, serial: int, reply: dict[str, Any]) -> None:
        if serial != self._serial:
            return
        self.plan_button.setEnabled(True)
        result = reply.get("result", reply)
        trace = result.get("trace") or {}
        self.status.setText(
            f"{result.get('considered', 0)} layouts searched in {duration_short(result.get('elapsed_s') or 0.0)}."
            + (f" Memory traced for {trace['traced']} of {trace['tried']} plan(s) in {trace['seconds']:.1f} s."
               if trace else "")
        )  # fmt: skip
        self._hide_message()
        self._show_result(result)
        self.rented.show_for(self.plan_request(), result, self.target_machine())
        self.sig_plan_ready.emit(result)

    def _on_plan_error(self, serial: int, error: BaseException) -> None:
        if serial != self._serial:
            return
        self.plan_button.setEnabled(True)
        self.status.setText("")
        self._show_result(None)
        message = error_text(error)
        self._show_message(gui_words(message))
        context = context_to_fit(error)
        if context is not None:
            self._offer_fix(f"Use {context} tokens (the model's context)", lambda: self._use_seq_len(context))
        self.sig_plan_failed.emit(self.message.text())

    def _show_message(self, text: str) -> None:
        self.message.setText(text)
        self.message.show()
        self._offer_fix("", None)

    def _hide_message(self) -> None:
        self.message.hide()
        self._offer_fix("", None)

    def _offer_fix(self, label: str, fix: Callable[[], None] | None) -> None:
        self._fix = fix
        self.fix_button.setText(label)
        self.fix_button.setVisible(fix is not None)

    def _apply_fix(self) -> None:
        fix, self._fix = self._fix, None
        self.fix_button.hide()
        if fix is not None:
            fix()

    def _use_seq_len(self, tokens: int) -> None:
        self.seq_len.setValue(tokens)
        self.new_tokens.setValue(min(self.new_tokens.value(), max(tokens // 2, 1)))
        self.request_plan()

    # -- showing a result --------------------------------------------------------------------------------
    def _show_result(self, result: dict[str, Any] | None) -> None:
        self.result = result
        rows = plan_rows(result) if result else []
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            values = [row.rank, row.family, row.layout, row.gpus, row.tokens_per_s, row.step, row.to_budget, row.peak,
                      row.runs_here]  # fmt: skip
            for c, value in enumerate(values):
                item = QTableWidgetItem(value)
                item.setToolTip(value)
                if c == RUNS_HERE_COLUMN and value != "yes":
                    item.setForeground(BAD)
                    item.setToolTip(f"The engine does not run this plan: {value}")
                if c == FULLEST_COLUMN and not row.fits:
                    item.setForeground(BAD)
                    item.setToolTip(f"Does not fit: the fullest GPU would need {value}")
                self.table.setItem(r, c, item)
        lines = (result or {}).get("explanation", [])
        self.explanation.setPlainText("\n".join(f"• {gui_words(line)}" for line in lines))
        self._show_calibration(result)
        self._show_rejected((result or {}).get("rejected", []))
        self._show_suggestions((result or {}).get("suggestions", []))
        if rows:
            # Shown outright: when row 0 was already selected, selecting it again signals nothing, and the
            # headline and chart would go on showing the previous result's best plan.
            with QSignalBlocker(self.table.selectionModel()):
                self.table.selectRow(0)
            self._show_plan(plans_of(result or {})[0])
            self.tabs.setCurrentIndex(0)
        else:
            self._show_plan(None)
            if result is not None:
                self.summary.setText(f"Nothing fits on GPU {', '.join(map(str, result.get('gpu_indices', [])))}.")
                self.tabs.setCurrentIndex(2 if result.get("suggestions") else 1)
            else:
                self.summary.setText("Choose a model and GPUs, then Plan.")

    def _show_calibration(self, result: dict[str, Any] | None) -> None:
        # A search made here, without the engine, used no calibration.
        cal = (result or {}).get("calibration") or {}
        text = "" if result is None else cal.get("line") or NOT_CALIBRATED
        self.calibration.setText(text)
        self.calibration.setToolTip(
            "Measured numbers replace the speed priors of the GPUs and links they measured. "
            "Measure them with a calibration job (the job wizard, or `rigpilot run calibrate`)."
        )
        self.calibration.setVisible(bool(text))

    def _show_rejected(self, rejected: list[dict[str, Any]]) -> None:
        self.rejected.setRowCount(len(rejected))
        for r, rej in enumerate(rejected):
            need = rej.get("need_bytes")
            have = rej.get("have_bytes")
            needs = f"{need / 2**30:.1f} of {have / 2**30:.1f} GiB" if need and have else ""
            for c, value in enumerate([rej.get("family", ""), gui_words(rej.get("reason", "")), needs]):
                item = QTableWidgetItem(value)
                item.setToolTip(value)
                self.rejected.setItem(r, c, item)
        self.rejected.resizeRowsToContents()

    def _show_suggestions(self, suggestions: list[dict[str, Any]]) -> None:
        self.suggestions.clear()
        for s in suggestions:
            item = QListWidgetItem(gui_words(s["change"]))
            item.setData(Qt.ItemDataRole.UserRole, s)
            self.suggestions.addItem(item)
        self.apply_button.setEnabled(False)

    def _row_selected(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        plans = plans_of(self.result or {})
        if rows and rows[0].row() < len(plans):
            self._show_plan(plans[rows[0].row()])

    def _suggestion_selected(self, row: int) -> None:
        item = self.suggestions.item(row)
        s = item.data(Qt.ItemDataRole.UserRole) if item else None
        applicable = bool(s) and s is not None and s.get("kind") in APPLICABLE_SUGGESTIONS
        self.apply_button.setEnabled(applicable)
        if s:
            self._show_plan(s["plan"], heading=f"With this change ({gui_words(s['change'])}):")
            # Other hardware is for comparing and exporting; a job can only launch on this machine.
            self._offer_launch(s["plan"] if applicable else None)

    def _show_plan(self, plan: dict[str, Any] | None, heading: str = "") -> None:
        self.plan = plan
        self.exports.set_plan(plan)
        self._offer_launch(plan)
        if plan is None:
            self.chart.clear()
            return
        self.chart.show_memory(plan.get("memory") or [])
        lines = summary_lines(plan)
        fits = all(m["headroom"] >= 0 for m in plan.get("memory") or [])
        colour = GOOD if fits else BAD
        if not heading and self.target_key() != HERE:
            heading = f"Plan for {html.escape(self._target_title())}:"
        head = f"<b>{heading or 'Plan'}</b> <span style='color:{colour.name()}'>{lines[0]}</span>"
        self.summary.setText("<br>".join([head, *lines[1:]]))
        self.sig_plan_shown.emit(plan)

    def _offer_launch(self, plan: dict[str, Any] | None) -> None:
        """Launch only a plan the engine runs; for one it does not, say why beside the disabled button."""
        runs, why = plan_runs_here(plan) if plan is not None else (False, "")
        reason = "" if plan is None or runs else f"Does not run here: {why}"
        if plan is not None and runs and self.target_key() != HERE:
            runs = False
            here = (self.machine or {}).get("label", "the engine's machine")
            reason = f"Planned for another machine: jobs launch only on this one ({here}). Export the plan instead."
        self.launch_button.setEnabled(plan is not None and runs)
        self.launch_button.setToolTip(reason or "Open the job wizard filled from this plan")
        self.launch_note.setText(reason)
        self.launch_note.setToolTip(reason)
        self.launch_note.setVisible(bool(reason))

    def apply_suggestion(self) -> None:
        """Put the selected suggestion's workload and GPUs into the form, and plan again."""
        item = self.suggestions.currentItem()
        s = item.data(Qt.ItemDataRole.UserRole) if item else None
        if not s:
            return
        plan = s["plan"]
        w = plan["workload"]
        r = self.plan_request()
        r.task, r.method, r.precision = w["task"], w["method"], w["precision"]
        r.seq_len, r.batch, r.weight_bits = w["seq_len"], w["global_batch"], w.get("weight_bits", 16)
        if w.get("new_tokens"):
            r.new_tokens = w["new_tokens"]
        if s.get("kind") == "gpus":
            r.gpus = list(plan["parallelism"]["gpu_indices"])
        self.set_request(r)
        self.request_plan()

    # -- exports and launching -------------------------------------------------------------------------
    def _exported(self, target: str, paths: list[str]) -> None:
        self._hide_message()
        self.export_note.setText("Saved " + " and ".join(paths))

    def open_wizard(self) -> Any:
        """Open the job wizard filled from the plan shown; returns it."""
        if self.plan is None:
            return None
        from rigpilot.app.wizard.wizard import open_wizard

        wizard = open_wizard(self.link, self, plan=self.plan)
        wizard.sig_submitted.connect(self.sig_job_submitted.emit)
        self.wizard = wizard
        self.sig_wizard_opened.emit(wizard)
        return wizard

    # -- persistence -------------------------------------------------------------------------------------
    def save_state(self, settings: QSettings, prefix: str) -> None:
        r = self.plan_request()
        settings.setValue(f"{prefix}/model", r.model)
        settings.setValue(f"{prefix}/task", r.task)
        settings.setValue(f"{prefix}/method", r.method)
        settings.setValue(f"{prefix}/precision", r.precision)
        settings.setValue(f"{prefix}/seq_len", r.seq_len)
        settings.setValue(f"{prefix}/batch", r.batch)
        settings.setValue(f"{prefix}/lora_rank", r.lora_rank)
        settings.setValue(f"{prefix}/weight_bits", r.weight_bits)
        settings.setValue(f"{prefix}/new_tokens", r.new_tokens)
        settings.setValue(f"{prefix}/force_tp", int(r.force_tp))
        settings.setValue(f"{prefix}/offload", r.offload)
        settings.setValue(f"{prefix}/nodes", r.nodes)
        settings.setValue(f"{prefix}/internode", r.internode)
        settings.setValue(f"{prefix}/machine", self.target_key())
        settings.setValue(f"{prefix}/splitter", self.splitter.saveState())
        settings.setValue(f"{prefix}/results_splitter", self.results_splitter.saveState())

    def restore_state(self, settings: QSettings, prefix: str) -> None:
        def value(key: str, default: Any, kind: type) -> Any:
            v = settings.value(f"{prefix}/{key}", default)
            try:
                return kind(v)
            except (TypeError, ValueError):
                return default

        d = PlanRequest(model="")
        self.set_request(
            PlanRequest(
                model=value("model", "", str),
                task=value("task", d.task, str),
                method=value("method", d.method, str),
                precision=value("precision", d.precision, str),
                seq_len=value("seq_len", d.seq_len, int),
                batch=value("batch", d.batch, int),
                lora_rank=value("lora_rank", d.lora_rank, int),
                weight_bits=value("weight_bits", d.weight_bits, int),
                new_tokens=value("new_tokens", d.new_tokens, int),
                force_tp=bool(value("force_tp", 0, int)),
                offload=value("offload", d.offload, str),
                nodes=min(max(value("nodes", d.nodes, int), 1), NODES_MAX),
                internode=value("internode", d.internode, str),
            )
        )
        self.select_machine(value("machine", HERE, str))
        for key, splitter in (("splitter", self.splitter), ("results_splitter", self.results_splitter)):
            state = settings.value(f"{prefix}/{key}")
            if isinstance(state, QByteArray):
                splitter.restoreState(state)
