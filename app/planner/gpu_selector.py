"""Choosing GPUs: a check box per GPU, busy ones marked with the jobs on them, and the topology graph if wanted.

`BusyGpus` follows the engine's job records (a `jobs` request on connect, then
job events) and says which GPUs running jobs hold. `GpuSelector` shows a
machine's GPUs as check boxes; with `with_graph` the Topology page's clickable
graph sits above them and both stay in step.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, QSignalBlocker, Signal
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from rigpilot.app.topology.graph_view import TopologyGraphView
from rigpilot.app.topology.model import build_graph, gpu_model, gpu_title
from rigpilot.app.widgets.engine_messages import machine_dict
from rigpilot.app.widgets.style import set_status
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.jobs.store import ACTIVE_STATES

GIB = 1024**3


def busy_gpus(jobs: dict[str, dict[str, Any]] | list[dict[str, Any]]) -> dict[int, list[str]]:
    """GPU index -> names of the starting or running jobs on it."""
    records = jobs.values() if isinstance(jobs, dict) else jobs
    busy: dict[int, list[str]] = {}
    for j in records:
        if j.get("state") in ACTIVE_STATES:
            for g in j.get("gpus") or []:
                busy.setdefault(g, []).append(j.get("name") or j["id"])
    return busy


class BusyGpus(QObject):
    """Which GPUs the engine's running jobs hold, kept current from the link."""

    sig_changed = Signal(object)  # {gpu index: [job names]} (int keys: not a QVariantMap)

    def __init__(self, link: Any, parent: QObject | None = None):
        super().__init__(parent)
        self.link = link
        self.jobs: dict[str, dict[str, Any]] = {}
        self.busy: dict[int, list[str]] = {}
        self._events: dict[str, dict[str, Any]] | None = None  # job events while the `jobs` request is out
        link.sig_job.connect(self._on_job)
        link.sig_state.connect(self._on_state)
        if getattr(link, "state", None) == "connected":
            self.refresh()

    def refresh(self) -> None:
        self._events = {}
        self.link.call("jobs", on_done=self._on_jobs, on_error=lambda e: None)

    def _on_state(self, state: str, detail: str) -> None:
        if state == "connected":
            self.refresh()

    def _on_jobs(self, reply: dict[str, Any]) -> None:
        # Events that arrived while the request was out are newer than the reply.
        self.jobs = {j["id"]: j for j in reply.get("jobs", [])} | (self._events or {})
        self._events = None
        self._update()

    def _on_job(self, job: dict[str, Any]) -> None:
        self.jobs[job["id"]] = job
        if self._events is not None:
            self._events[job["id"]] = job
        self._update()

    def _update(self) -> None:
        busy = busy_gpus(self.jobs)
        if busy != self.busy:
            self.busy = busy
            self.sig_changed.emit(busy)


class GpuSelector(QWidget):
    sig_selection_changed = Signal(list)  # sorted GPU indices

    def __init__(self, parent: QWidget | None = None, *, with_graph: bool = False):
        super().__init__(parent)
        self.machine: Machine | None = None
        self.busy: dict[int, list[str]] = {}
        self.boxes: dict[int, QCheckBox] = {}
        self.graph: TopologyGraphView | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        if with_graph:
            self.graph = TopologyGraphView()
            self.graph.setMinimumHeight(180)
            self.graph.sig_gpus_selected.connect(self._from_graph)
            layout.addWidget(self.graph, 1)
        self.placeholder = QLabel("Waiting for the engine to say which GPUs this machine has…")
        self.placeholder.setWordWrap(True)
        layout.addWidget(self.placeholder)
        self.box_area = QVBoxLayout()
        self.box_area.setSpacing(2)
        layout.addLayout(self.box_area)
        row = QHBoxLayout()
        self.all_button = QPushButton("All")
        self.all_button.setObjectName("selectAllGpus")
        self.all_button.clicked.connect(lambda: self.set_selected(sorted(self.boxes)))
        self.free_button = QPushButton("Free ones")
        self.free_button.setObjectName("selectFreeGpus")
        self.free_button.setToolTip("Select every GPU no running job uses")
        self.free_button.clicked.connect(lambda: self.set_selected(self.free()))
        row.addWidget(self.all_button)
        row.addWidget(self.free_button)
        row.addStretch(1)
        layout.addLayout(row)

    # -- content ----------------------------------------------------------------------------
    def set_machine(self, message: dict[str, Any] | None) -> None:
        d = machine_dict(message)
        if not d:
            return
        machine = Machine.from_dict(d)
        before = self.selected()
        self.machine = machine
        for box in self.boxes.values():
            self.box_area.removeWidget(box)
            box.deleteLater()
        self.boxes = {}
        for g in machine.gpus:
            box = QCheckBox()
            box.setObjectName(f"gpu-{g.index}")
            box.toggled.connect(self._from_boxes)
            self.boxes[g.index] = box
            self.box_area.addWidget(box)
        self.placeholder.setVisible(not self.boxes)
        if self.graph is not None:
            self.graph.show_graph(machine, build_graph(machine))
        self._restyle()
        self.set_selected([g for g in before if g in self.boxes], emit=False)

    def set_busy(self, busy: dict[int, list[str]]) -> None:
        self.busy = dict(busy)
        if self.graph is not None:
            self.graph.set_busy(self.busy)
        self._restyle()

    def _restyle(self) -> None:
        if self.machine is None:
            return
        for g in self.machine.gpus:
            box = self.boxes[g.index]
            memory = f"{g.memory_total / GIB:.0f} GiB" if g.memory_total else "memory unknown"
            text = f"GPU {g.index} · {gpu_model(g)} · {memory}"
            tip = gpu_title(g) + (f", PCI {g.pci_bus_id}" if g.pci_bus_id else "")
            jobs = self.busy.get(g.index)
            if jobs:
                names = ", ".join(jobs)
                text += f" — busy: {names if len(names) <= 24 else names[:23] + '…'}"
                tip += f"\nIn use by: {names}"
                set_status(box, "warn")
            else:
                set_status(box, None)
            box.setText(text)
            box.setToolTip(tip)

    # -- selection ----------------------------------------------------------------------------
    def selected(self) -> list[int]:
        return sorted(i for i, b in self.boxes.items() if b.isChecked())

    def free(self) -> list[int]:
        return sorted(i for i in self.boxes if i not in self.busy)

    def busy_selected(self) -> dict[int, list[str]]:
        return {i: self.busy[i] for i in self.selected() if i in self.busy}

    def set_selected(self, gpus: list[int], emit: bool = True) -> None:
        before = self.selected()
        for i, box in self.boxes.items():
            with QSignalBlocker(box):
                box.setChecked(i in gpus)
        now = self.selected()
        if self.graph is not None:
            self.graph.set_selection(now, emit=False)
        if emit and now != before:
            self.sig_selection_changed.emit(now)

    def _from_boxes(self) -> None:
        now = self.selected()
        if self.graph is not None:
            self.graph.set_selection(now, emit=False)
        self.sig_selection_changed.emit(now)

    def _from_graph(self, gpus: list[int]) -> None:
        self.set_selected(gpus)
