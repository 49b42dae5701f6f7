"""The Topology page: how this machine's GPUs are wired, drawn, as a `topo -m` matrix and in words.

It can also show another machine, imported from saved `nvidia-smi` output, to
compare or plan for it; "Back to this machine" returns to the engine's one.
Imported machines are kept in one list (`ImportedMachines`) the Planner shares,
and "Plan for this machine" asks the main window to open the Planner on the
machine shown. GPUs are selected by clicking them; other pages listen to
`sig_gpus_selected`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.doctor.model import link_marks
from rigpilot.app.doctor.source import CheckSource
from rigpilot.app.engine_link import CONNECTED
from rigpilot.app.tasks import run_in_background
from rigpilot.app.topology.gpu_model import GpuModelChoice
from rigpilot.app.topology.graph_view import MAX_DRAWN_PAIRS, TopologyGraphView
from rigpilot.app.topology.imported import HERE, ImportedMachines, plan_block
from rigpilot.app.topology.matrix import BandwidthHeatMap, TopoLegend, TopoMatrixTable
from rigpilot.app.topology.model import TopologyGraph, build_graph, machine_title, measured_bandwidth, topo_matrix
from rigpilot.app.widgets.elided_label import ElidedLabel
from rigpilot.app.widgets.engine_messages import machine_dict
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import set_status
from rigpilot.engine.hardware.importers import import_machine
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.topology import describe
from rigpilot.engine.jobs.store import ACTIVE_STATES

IMPORT_FILTER = "nvidia-smi output (*.txt *.xml *.log *.out);;All files (*)"
CHOICE_WIDTH = 28  # characters a machine list shows before eliding; the tooltip has the whole name


class TopologyPage(QWidget):
    sig_gpus_selected = Signal(list)  # GPU indices chosen on the graph, of the machine shown
    sig_machine_shown = Signal(dict)  # Machine.to_dict() of what the page now shows (this machine or an import)
    sig_import_failed = Signal(str)  # the message shown to the user
    sig_plan_for_machine = Signal(str)  # HERE, or the ImportedMachines key of the machine shown

    def __init__(self, link: Any, parent: QWidget | None = None, *, machines: ImportedMachines | None = None):
        super().__init__(parent)
        self.link = link
        self.machines = machines if machines is not None else ImportedMachines(parent=self)
        self.shown_key = HERE
        self.local: dict[str, Any] | None = None  # the engine's machine
        self.shown: Machine | None = None
        self.shown_dict: dict[str, Any] | None = None
        self.imported = False
        self.graph: TopologyGraph | None = None
        self.jobs: dict[str, dict[str, Any]] = {}
        self._job_events: dict[str, dict[str, Any]] | None = None  # job events since the `jobs` request went out

        # Elided: an imported machine's title names its files, and a long name must not widen the window.
        self.title = ElidedLabel("Waiting for the engine…")
        self.title.setObjectName("machineTitle")
        font = QFont(self.title.font())
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.15)
        self.title.setFont(font)
        self.import_button = QPushButton("Import nvidia-smi output…")
        set_icon(self.import_button, "import")
        self.import_button.setObjectName("importMachine")
        self.import_button.setToolTip("Show another machine from saved `nvidia-smi topo -m`, `-q` or `-q -x` output")
        self.import_button.clicked.connect(self._ask_import)
        self.back_button = QPushButton("Back to this machine")
        set_icon(self.back_button, "back")
        self.back_button.setObjectName("backToLocal")
        self.back_button.clicked.connect(self.show_local)
        self.back_button.hide()
        self.choice = QComboBox()
        self.choice.setObjectName("shownMachine")
        self.choice.setAccessibleName("Machine shown")
        self.choice.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.choice.setMinimumContentsLength(CHOICE_WIDTH)
        self.choice.activated.connect(self._choice_activated)
        self.plan_button = QPushButton("Plan for this machine")
        set_icon(self.plan_button, "plan")
        self.plan_button.setObjectName("planForMachine")
        self.plan_button.clicked.connect(lambda: self.sig_plan_for_machine.emit(self.shown_key))
        head = QHBoxLayout()
        head.addWidget(self.title, 1)
        head.addWidget(self.choice)
        head.addWidget(self.import_button)
        head.addWidget(self.back_button)
        head.addWidget(self.plan_button)
        self.error = QLabel()
        self.error.setObjectName("importError")
        self.error.setWordWrap(True)
        self.error.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        set_status(self.error, "bad")
        self.error.hide()
        self.gpu_model = GpuModelChoice()
        self.gpu_model.sig_chosen.connect(self._on_gpu_model)
        self.notes = QLabel()
        self.notes.setObjectName("machineNotes")
        self.notes.setWordWrap(True)
        self.notes.hide()
        # A file name has no place to wrap: these wrap at the width they are given instead of asking for more.
        for label in (self.error, self.notes):
            label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

        self.graph_view = TopologyGraphView()
        self.graph_view.sig_gpus_selected.connect(self.sig_gpus_selected.emit)
        self.selection_label = QLabel("Click GPUs to select them")
        self.selection_label.setObjectName("selection")
        self.sig_gpus_selected.connect(self._show_selection)
        graph_box = QWidget()
        graph_layout = QVBoxLayout(graph_box)
        graph_layout.setContentsMargins(0, 0, 0, 0)
        graph_layout.addWidget(self.graph_view, 1)
        graph_layout.addWidget(self.selection_label)

        self.matrix = TopoMatrixTable()
        self.legend = TopoLegend()
        self.summary = QLabel()
        self.summary.setObjectName("topologySummary")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.heat_title = QLabel("<b>Measured bandwidth (GB/s)</b>")
        self.heat_map = BandwidthHeatMap()
        self.heat_note = QLabel("From a calibration run: all-reduce bus bandwidth between each pair of GPUs.")
        self.heat_note.setWordWrap(True)
        matrix_box = QWidget()
        matrix_layout = QVBoxLayout(matrix_box)
        matrix_layout.setContentsMargins(0, 0, 0, 0)
        matrix_layout.addWidget(QLabel("<b>Matrix</b> (nvidia-smi topo -m)"))
        matrix_layout.addWidget(self.matrix)
        matrix_layout.addWidget(self.legend)
        words_box = QWidget()
        words_layout = QVBoxLayout(words_box)
        words_layout.setContentsMargins(0, 0, 0, 0)
        words_layout.addWidget(QLabel("<b>In words</b>"))
        words_layout.addWidget(self.summary)
        words_layout.addWidget(self.heat_title)
        words_layout.addWidget(self.heat_map)
        words_layout.addWidget(self.heat_note)
        words_layout.addStretch(1)
        details = QWidget()
        details_layout = QHBoxLayout(details)
        details_layout.addWidget(matrix_box, 3)
        details_layout.addWidget(words_box, 2)
        self.details_area = QScrollArea()
        self.details_area.setWidgetResizable(True)
        self.details_area.setWidget(details)
        self.details_area.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # its tables take focus themselves

        # The drawing gets the full width: text in it stays readable without scaling it down much.
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.setObjectName("topologySplitter")
        self.splitter.addWidget(graph_box)
        self.splitter.addWidget(self.details_area)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setStretchFactor(1, 2)
        self.splitter.setSizes([480, 360])
        layout = QVBoxLayout(self)
        layout.addLayout(head)
        layout.addWidget(self.error)
        layout.addWidget(self.gpu_model)
        layout.addWidget(self.notes)
        layout.addWidget(self.splitter, 1)
        self.check_note = QLabel()
        self.check_note.setObjectName("checkNote")
        self.check_note.setWordWrap(True)
        self.check_note.hide()
        words_layout.insertWidget(2, self.check_note)
        self.set_measured_bandwidth({})
        # The machine check's figures and broken links, drawn on this machine's links (never on an import's).
        self.check = CheckSource(link, self)
        self.check.sig_changed.connect(lambda _state: self._show_check())
        self.machines.sig_changed.connect(self._fill_choice)
        self._fill_choice()

        link.sig_machine.connect(self.on_machine)
        link.sig_telemetry.connect(self.on_telemetry)
        link.sig_job.connect(self.on_job)
        link.sig_state.connect(self.on_state)
        if getattr(link, "machine", None):
            self.on_machine(link.machine)
        if getattr(link, "state", None) == CONNECTED:  # built after the link connected (the window builds it late)
            self.on_state(CONNECTED, "")

    # -- engine events ---------------------------------------------------------------------------
    def on_state(self, state: str, detail: str) -> None:
        if state == CONNECTED:
            self._job_events = {}
            self.link.call("jobs", on_done=self._on_jobs, on_error=lambda e: None)

    def on_machine(self, message: dict[str, Any]) -> None:
        d = machine_dict(message)
        if not d:
            return
        self.local = d
        if not self.imported:
            self._show(d, imported=False)

    def on_telemetry(self, sample: dict[str, Any]) -> None:
        # Live link traffic belongs to this machine only; an imported one has none.
        if not self.imported and self.isVisible():
            self.graph_view.show_throughput(sample)

    def on_job(self, job: dict[str, Any]) -> None:
        self.jobs[job["id"]] = job
        if self._job_events is not None:
            self._job_events[job["id"]] = job
        self._mark_busy()

    def _on_jobs(self, reply: dict[str, Any]) -> None:
        # Events that arrived while the request was out are newer than the reply.
        self.jobs = {j["id"]: j for j in reply.get("jobs", [])} | (self._job_events or {})
        self._job_events = None
        self._mark_busy()

    def _mark_busy(self) -> None:
        busy: dict[int, list[str]] = {}
        if not self.imported:
            for j in self.jobs.values():
                if j.get("state") in ACTIVE_STATES:
                    for i in j.get("gpus") or []:
                        busy.setdefault(i, []).append(j.get("name") or j["id"])
        self.graph_view.set_busy(busy)

    # -- showing a machine ---------------------------------------------------------------------------
    def _show(self, d: dict[str, Any], imported: bool, key: str = HERE) -> None:
        machine = Machine.from_dict(d)
        if self.shown_dict is not None and (
            imported != self.imported or d.get("label") != self.shown_dict.get("label")
        ):
            self.graph_view.set_selection([])  # a selection names GPUs of the machine it was made on
        self.shown, self.shown_dict, self.imported, self.shown_key = machine, d, imported, key
        self.title.setText(machine_title(machine) if imported else d.get("label") or machine.label)
        self.back_button.setVisible(imported)
        self._select_choice(key)
        blocked = plan_block(d)
        self.gpu_model.show_machine(d if imported else None)
        self.plan_button.setEnabled(not blocked)
        self.plan_button.setToolTip(blocked or "Open the Planner with this machine as the one to plan for")
        notes = list(d.get("notes") or [])
        self.notes.setText("\n".join(f"• {n}" for n in notes))
        self.notes.setVisible(bool(notes))
        graph = build_graph(machine)
        self.graph = graph
        self.graph_view.show_graph(machine, graph)
        self.matrix.show_matrix(topo_matrix(machine))
        self.summary.setText("\n".join(f"• {line}" for line in describe(machine)))
        self.set_measured_bandwidth(measured_bandwidth(d))
        self._show_check()
        self._mark_busy()
        self._show_selection(sorted(self.graph_view.selected))
        self.sig_machine_shown.emit(d)

    def show_local(self) -> None:
        self.error.hide()
        if self.local is not None:
            self._show(self.local, imported=False)
        else:
            self.imported = False
            self.shown_key = HERE
            self.back_button.hide()
            self._select_choice(HERE)

    def show_imported(self, key: str) -> None:
        """Show a machine from the imported list."""
        entry = self.machines.get(key)
        if entry is not None:
            self.error.hide()
            self._show(entry.machine, imported=True, key=key)

    def _fill_choice(self) -> None:
        self.choice.blockSignals(True)
        self.choice.clear()
        self.choice.addItem("This machine", HERE)
        self.choice.setItemData(0, "The machine the engine runs on", Qt.ItemDataRole.ToolTipRole)
        for entry in self.machines.items():
            self.choice.addItem(entry.title, entry.key)
            self.choice.setItemData(self.choice.count() - 1, entry.title, Qt.ItemDataRole.ToolTipRole)
        self.choice.blockSignals(False)
        self._select_choice(self.shown_key)
        self.choice.setVisible(self.choice.count() > 1)

    def _select_choice(self, key: str) -> None:
        i = self.choice.findData(key)
        if i >= 0:
            self.choice.blockSignals(True)
            self.choice.setCurrentIndex(i)
            self.choice.blockSignals(False)
        # The list is narrower than a long file name: the whole name is a hover away.
        self.choice.setToolTip(f"Showing {self.choice.currentText()}. Show this machine or one imported before")

    def _choice_activated(self, index: int) -> None:
        key = self.choice.itemData(index)
        if key == HERE:
            self.show_local()
        elif key:
            self.show_imported(key)

    def _show_check(self) -> None:
        report = self.check.state.report if not self.imported else None
        marks = link_marks(report)
        self.graph_view.set_link_marks(marks)
        self.matrix.set_link_marks(marks)
        broken = [m for m in marks.values() if m.broken]
        if report is None:
            self.check_note.hide()
            return
        sim = " (simulated: CPU figures)" if report.simulated else ""
        if len(marks) <= MAX_DRAWN_PAIRS:
            line = f"On each GPU pair's link, drawn and in the matrix: the all-reduce the machine check measured{sim}."
        else:
            line = (f"Under each GPU pair's link in the matrix: the all-reduce the machine check measured{sim}; "
                    "the drawing shows the broken links only.")  # fmt: skip
        if broken:
            line += " Broken links in red: " + "; ".join(m.findings[0] for m in broken if m.findings)
        self.check_note.setText(line)
        set_status(self.check_note, "bad" if broken else None)
        self.check_note.show()

    def set_measured_bandwidth(self, values: dict[tuple[int, int], float]) -> None:
        """The hook for calibration results: GPU pair (a < b) -> measured GB/s; empty hides the heat map."""
        gpus = [g.index for g in self.shown.gpus] if self.shown else []
        self.heat_map.show_values(gpus, values)
        for w in (self.heat_title, self.heat_map, self.heat_note):
            w.setVisible(bool(values))

    # -- import ----------------------------------------------------------------------------------------
    def _ask_import(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Import nvidia-smi output", str(Path.home()), IMPORT_FILTER)
        if paths:
            self.import_files([Path(p) for p in paths])

    def import_files(self, paths: list[Path]) -> None:
        """Read the files off the GUI thread, then show that machine, or say why they could not be read."""
        self.import_button.setEnabled(False)
        self.error.hide()
        run_in_background(lambda: import_machine(paths).to_dict(), self._on_imported, self._on_import_failed)

    def _on_imported(self, d: dict[str, Any]) -> None:
        self.import_button.setEnabled(True)
        entry = self.machines.add(d)
        self._show(d, imported=True, key=entry.key)

    def _on_gpu_model(self, d: dict[str, Any]) -> None:
        entry = self.machines.add(d)  # the same files: it replaces the entry without a model
        self._show(d, imported=True, key=entry.key)

    def _on_import_failed(self, error: BaseException) -> None:
        self.import_button.setEnabled(True)
        message = f"Could not import: {error}"
        self.error.setText(message)
        self.error.show()
        self.sig_import_failed.emit(message)

    # -- selection -------------------------------------------------------------------------------------
    def selected_gpus(self) -> list[int]:
        return sorted(self.graph_view.selected)

    def select_gpus(self, gpus: list[int]) -> None:
        self.graph_view.set_selection(gpus)

    def _show_selection(self, gpus: list[int]) -> None:
        if gpus:
            self.selection_label.setText(f"Selected: GPU {', '.join(map(str, gpus))} (Esc clears)")
        else:
            self.selection_label.setText("Click GPUs (or use arrow keys and Space) to select them")

    # -- persistence -------------------------------------------------------------------------------------
    def save_state(self, settings: QSettings, prefix: str) -> None:
        settings.setValue(f"{prefix}/splitter", self.splitter.saveState())

    def restore_state(self, settings: QSettings, prefix: str) -> None:
        state = settings.value(f"{prefix}/splitter")
        if isinstance(state, QByteArray):
            self.splitter.restoreState(state)
