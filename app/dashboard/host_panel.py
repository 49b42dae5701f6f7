"""The host beside the GPUs: CPU load and memory, which starve data loaders long before GPUs idle."""

from __future__ import annotations

from typing import Any

import numpy as np
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QWidget

from rigpilot.app.widgets.meter import Meter
from rigpilot.app.widgets.sparkline import Sparkline
from rigpilot.app.widgets.style import heading, set_surface
from rigpilot.app.widgets.units import NA, gib

SPARK_SECONDS = 60.0


class HostPanel(QFrame):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("hostPanel")
        set_surface(self, "card")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.title = heading("Host")
        self.cpu = Meter("Host CPU load")
        self.cpu.setObjectName("hostCpu")
        self.cpu_spark = Sparkline(y_range=(0.0, 100.0))
        self.memory = Meter("Host memory in use")
        self.memory.setObjectName("hostMemory")
        self.swap = QLabel(NA)
        grid = QGridLayout(self)
        grid.setContentsMargins(8, 6, 8, 6)
        grid.addWidget(self.title, 0, 0, 1, 3)
        grid.addWidget(QLabel("CPU"), 1, 0)
        grid.addWidget(self.cpu, 1, 1)
        grid.addWidget(self.cpu_spark, 1, 2)
        grid.addWidget(QLabel("RAM"), 2, 0)
        grid.addWidget(self.memory, 2, 1)
        grid.addWidget(self.swap, 2, 2)
        grid.setColumnStretch(1, 1)
        grid.setColumnStretch(2, 1)
        self.show_sample(None)

    def show_sample(self, host: dict[str, Any] | None) -> None:
        cpus = (host or {}).get("cpu_percent") or []
        if cpus:
            load = sum(cpus) / len(cpus)
            self.cpu.set_value(load / 100, f"{load:.0f} % of {len(cpus)} threads")
            busiest = max(cpus)
            self.cpu.setToolTip(f"Average over {len(cpus)} logical CPUs; busiest at {busiest:.0f} %")
        else:
            self.cpu.set_value(None, NA)
            self.cpu.setToolTip("CPU load: no reading yet")
        used, total = (host or {}).get("memory_used"), (host or {}).get("memory_total")
        if used is not None and total:
            self.memory.set_value(used / total, f"{used / 2**30:.1f} / {gib(total)}")
            self.memory.setToolTip("Host memory in use")
        else:
            self.memory.set_value(None, NA)
            self.memory.setToolTip("Host memory: no reading yet")
        swap_used, swap_total = (host or {}).get("swap_used"), (host or {}).get("swap_total")
        self.swap.setText(f"swap {gib(swap_used)} of {gib(swap_total)}" if swap_total else "no swap" if host else NA)

    def show_history(self, t: np.ndarray, cpu: np.ndarray) -> None:
        if len(t):
            self.cpu_spark.set_data(t, cpu, (float(t[-1]) - SPARK_SECONDS, float(t[-1])))
