"""The GPU model of an imported machine whose files name none (`nvidia-smi topo -m` alone): the user picks it
from the GPU spec table, the machine takes that row's name and memory, and it can be planned for."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QPushButton, QWidget

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.importers import unknown_model_gpus, with_gpu_model
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.specs import load_specs


class GpuModelChoice(QWidget):
    """'Which GPU is it?' with the spec table's products; emits the machine with the chosen model."""

    sig_chosen = Signal(dict)  # the machine (Machine.to_dict()) with the chosen model

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._machine: dict[str, Any] | None = None
        self.label = QLabel()
        self.label.setObjectName("gpuModelQuestion")
        self.label.setWordWrap(True)
        self.models = QComboBox()
        self.models.setObjectName("gpuModel")
        self.models.setAccessibleName("GPU model")
        self.models.addItem("Choose the GPU model…", None)
        # Newest products last within each vendor, as the table lists them; the memory tells variants apart.
        for spec in sorted(load_specs(), key=lambda s: (s.vendor != "NVIDIA", s.vendor)):
            self.models.addItem(f"{spec.vendor} {spec.name} ({spec.memory_gib:g} GB)", spec.key)
        self.use = QPushButton("Use this model")
        self.use.setObjectName("useGpuModel")
        self.use.setEnabled(False)
        self.use.clicked.connect(self._choose)
        self.models.currentIndexChanged.connect(lambda _: self.use.setEnabled(self.models.currentData() is not None))
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.label, 1)
        row.addWidget(self.models)
        row.addWidget(self.use)
        self.hide()

    def show_machine(self, d: dict[str, Any] | None) -> None:
        """Ask for the model of an imported machine whose GPUs have none; hidden for every other machine."""
        unknown = unknown_model_gpus(Machine.from_dict(d)) if d is not None else []
        self._machine = d if unknown else None
        self.setVisible(bool(unknown))
        if unknown:
            every = len(unknown) == len((d or {}).get("gpus") or [])
            gpus = "its GPUs" if every else f"GPU {', '.join(map(str, unknown))}"
            self.label.setText(f"Which GPU is it? The imported topo -m output names no model for {gpus}, so "
                               "their memory is unknown; choose it to plan for this machine.")  # fmt: skip
            self.models.setCurrentIndex(0)

    def _choose(self) -> None:
        key = self.models.currentData()
        if self._machine is None or key is None:
            return
        try:
            chosen = with_gpu_model(Machine.from_dict(self._machine), key)
        except UserError as e:  # the table changed under the list: say so rather than fail
            self.label.setText(str(e))
            return
        self.sig_chosen.emit(chosen.to_dict())
