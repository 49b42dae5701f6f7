"""Predicted memory per GPU as stacked bars (weights at the bottom, overhead on top) against each GPU's capacity.

One `BarGraphItem` per memory part spans all GPUs; its bars sit on the sum of
the parts below (`y0`). A short line over each bar marks that GPU's capacity,
so a bar that crosses its line does not fit. Hovering a GPU reads out its parts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from rigpilot.app.planner.model import GIB, MEMORY_PARTS, gpu_label, memory_stack
from rigpilot.app.widgets.chart_view import ChartView
from rigpilot.app.widgets.palette import BAD, apply_plot_theme, series_color

BAR_WIDTH = 0.6
# Low enough that the ranked plans above keep five rows at 1280×800; the bars still read against their lines.
PLOT_MIN_HEIGHT = 100


class MemoryChart(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.memory: list[dict[str, Any]] = []
        self.plot = ChartView()
        self.plot.setObjectName("memoryChart")
        self.plot.setAccessibleName("Predicted memory per GPU")
        self.plot.setMinimumHeight(PLOT_MIN_HEIGHT)
        self.plot.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # nothing to do with the keyboard in it
        item = self.plot.getPlotItem()
        item.setMenuEnabled(False)
        item.hideButtons()
        item.setMouseEnabled(x=False, y=False)
        item.showGrid(y=True, alpha=0.15)
        item.setLabel("left", "GiB")
        self.bars: dict[str, pg.BarGraphItem] = {}
        for i, (key, _) in enumerate(MEMORY_PARTS):
            bar = pg.BarGraphItem(x=[], height=[], y0=[], width=BAR_WIDTH, brush=series_color(i), pen=None)
            self.bars[key] = bar
            item.addItem(bar)
        self.capacity = pg.PlotDataItem([], [], connect="pairs", pen=pg.mkPen(BAD, width=2))
        item.addItem(self.capacity)
        # The legend lives outside the plot, where it can never hide a bar or a capacity line.
        swatches = [
            f"<span style='color:{series_color(i).name()}'>■</span>&nbsp;{title.replace(' ', '&nbsp;')}"
            for i, (_, title) in enumerate(MEMORY_PARTS)
        ]
        swatches.append(f"<span style='color:{BAD.name()}'>━</span>&nbsp;GPU&nbsp;capacity")
        self.legend = QLabel(" &nbsp; ".join(swatches))
        self.legend.setObjectName("memoryLegend")
        self.legend.setWordWrap(True)
        self.readout = QLabel("")
        self.readout.setObjectName("memoryReadout")
        self.readout.setWordWrap(True)
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.legend)
        layout.addWidget(self.readout)
        self.plot.scene().sigMouseMoved.connect(self._hover)
        apply_plot_theme(self.plot, self.palette())

    def show_memory(self, memory: list[dict[str, Any]]) -> None:
        """Draw the plan's `memory[]` (MemoryBreakdown dicts, bytes), one bar per GPU in plan order."""
        self.memory = list(memory)
        x = np.arange(len(memory), dtype=float)
        bottom = np.zeros(len(memory))
        for key, heights in memory_stack(memory).items():
            h = np.asarray(heights, dtype=float)
            self.bars[key].setOpts(x=x, height=h, y0=bottom.copy(), width=BAR_WIDTH)
            bottom += h
        caps = np.array([m["capacity"] / GIB for m in memory], dtype=float)
        self.capacity.setData(np.repeat(x, 2) + np.tile([-0.45, 0.45], len(memory)), np.repeat(caps, 2))
        item = self.plot.getPlotItem()
        item.getAxis("bottom").setTicks([[(i, gpu_label(m, memory, short=True)) for i, m in enumerate(memory)]])
        top = float(max(bottom.max(initial=0.0), caps.max(initial=0.0)))
        item.setXRange(-0.6, max(len(memory) - 0.4, 0.6), padding=0)
        item.setYRange(0, top * 1.08 if top > 0 else 1, padding=0)
        self.readout.setText(self._peak_text())

    def clear(self) -> None:
        self.show_memory([])
        self.readout.setText("")

    def heights(self, key: str) -> list[float]:
        """GiB of one part on each GPU, as drawn."""
        return [float(v) for v in self.bars[key].opts["height"]]

    def bottoms(self, key: str) -> list[float]:
        return [float(v) for v in self.bars[key].opts["y0"]]

    def _peak_text(self) -> str:
        if not self.memory:
            return ""
        over = [m for m in self.memory if m["headroom"] < 0]
        if over:
            worst = min(over, key=lambda m: m["headroom"])
            return (
                f"Does not fit: {gpu_label(worst, self.memory)} needs {_shown(worst) / GIB:.1f} GiB{_traced(worst)} "
                f"of {worst['capacity'] / GIB:.1f} GiB. Hover a bar for its parts."
            )
        peak = max(self.memory, key=lambda m: _shown(m) / max(m["capacity"], 1))
        return (
            f"Fullest {gpu_label(peak, self.memory)}: {_shown(peak) / GIB:.1f} of {peak['capacity'] / GIB:.1f} GiB{_traced(peak)}. "
            "Hover a bar for its parts."
        )

    def _hover(self, pos: QPointF) -> None:
        if not self.memory:
            return
        point = self.plot.getPlotItem().vb.mapSceneToView(pos)
        i = round(point.x())
        if not 0 <= i < len(self.memory) or abs(point.x() - i) > BAR_WIDTH / 2:
            self.readout.setText(self._peak_text())
            return
        m = self.memory[i]
        parts = ", ".join(f"{title.lower()} {m[key] / GIB:.2f}" for key, title in MEMORY_PARTS if m[key])
        self.readout.setText(f"{gpu_label(m, self.memory)}: {parts} — total {m['total'] / GIB:.2f} of {m['capacity'] / GIB:.1f} GiB")

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            apply_plot_theme(self.plot, self.palette())


def _shown(m: dict[str, Any]) -> int:
    return max(int(m["total"]), int(m.get("traced") or 0))


def _traced(m: dict[str, Any]) -> str:
    """' (formula 12.4 GiB · traced 13.1 GiB)' when the plan's memory was traced, else ''."""
    if m.get("traced") is None:
        return ""
    return f" (formula {m['total'] / GIB:.1f} GiB · traced {m['traced'] / GIB:.1f} GiB)"
