"""A live chart of several series over time: crosshair read-out, legend check boxes, PNG and CSV export.

Built for redrawing ten times a second at little cost:

- curves are created once per set of series and then only fed with `setData`;
- x is "seconds before the newest point", so the view range and the time axis
  stay put while data scrolls through them (moving the view re-lays out the
  axis and every curve on each frame);
- data is thinned to two points per pixel column, incrementally, so an hour
  at 10 Hz costs about what a minute does;
- the y range only moves when the data leaves it or shrinks well inside it.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import numpy as np
import pyqtgraph as pg
import pyqtgraph.exporters
from PySide6.QtCore import QEvent, QObject, QPointF, Qt, Signal
from PySide6.QtGui import QColor, QIcon, QPalette, QPixmap
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QSizePolicy, QVBoxLayout, QWidget

from rigpilot.app.tasks import run_in_background
from rigpilot.app.widgets.chart_view import ChartView
from rigpilot.app.widgets.decimate import IncrementalMinMax
from rigpilot.app.widgets.elided_label import ElidedLabel
from rigpilot.app.widgets.palette import apply_plot_theme, series_color
from rigpilot.app.widgets.units import NA

# The y range is widened to the data plus this share of its span, and narrowed only when
# the data uses less than KEEP_SHARE of it: a range that twitches every frame is unreadable.
Y_PADDING = 0.1
KEEP_SHARE = 0.35
# The "now" read-out is text to read, not an animation: rewriting it at 10 Hz costs a relayout per frame.
READOUT_PERIOD_S = 0.5


class AgoAxis(pg.AxisItem):
    """Ticks in time before the newest point, at round seconds or minutes: "-45 s", "-10 min", "now"."""

    STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)
    MIN_LABEL_PX = 70

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._major = 60.0
        self.latest = "now"  # what the newest point is called ("job end" on a finished job's chart)

    def tickSpacing(self, minVal: float, maxVal: float, size: float) -> list[tuple[float, float]]:
        span = max(maxVal - minVal, 1e-9)
        fits = max(size / self.MIN_LABEL_PX, 1.0)
        self._major = float(next((s for s in self.STEPS if span / s <= fits), self.STEPS[-1]))
        return [(self._major, 0.0), (self._major / 5, 0.0)]

    def tickStrings(self, values: list[float], scale: float, spacing: float) -> list[str]:
        out = []
        for v in values:
            if spacing < self._major or abs(v / self._major - round(v / self._major)) > 1e-6:
                out.append("")  # minor ticks carry no label, so labels never mix seconds and minutes
            elif abs(v) < 1e-6:
                out.append(self.latest)
            elif self._major >= 60:
                out.append(f"{v / 60:.0f} min")
            else:
                out.append(f"{v:.0f} s")
        return out


def _swatch(color: QColor) -> QIcon:
    pixmap = QPixmap(12, 12)
    pixmap.fill(color)
    return QIcon(pixmap)


class TimeChart(QWidget):
    """Series `i` is row `i` of the values given to `set_data`, drawn in `series_color(i)`."""

    sig_exported = Signal(str)  # the path of a finished export
    sig_export_failed = Signal(str)  # what went wrong, for the user
    sig_series_toggled = Signal(int, bool)

    def __init__(self, parent: QWidget | None = None, *, titled: bool = False):
        """`titled`: the quantity is a title over the plot, not a label along its y axis (which a
        chart a few rows high cannot hold)."""
        super().__init__(parent)
        self._titled = titled
        self._names: list[str] = []
        self._notes: list[str | None] = []
        self._t = np.empty(0)
        self._values = np.empty((0, 0))
        self._window: float | None = 60.0
        self._paused = False
        self._title, self._unit, self._fmt = "", "", "{:.1f}"

        # A long read-out or many series must not widen a chart that shares a row with others: what does not
        # fit ends in "…" (a cut without one read as a broken line on a 4-GPU job's small charts), and the
        # whole read-out is in the tooltip.
        self.readout = ElidedLabel(NA)
        self.readout.setObjectName("chartReadout")
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._axis = AgoAxis(orientation="bottom")
        self.plot = ChartView(axisItems={"bottom": self._axis})
        self.plot.setObjectName("chartPlot")
        self.plot.setAccessibleName("Telemetry chart")
        self.plot.setMinimumHeight(180)
        item = self.plot.getPlotItem()
        # No grid: it is drawn by the axes across the whole plot, so every frame repaints it (a third of
        # the cost of a redraw); the hover read-out gives exact values instead.
        item.setMenuEnabled(False)
        item.hideButtons()
        self.plot.setMouseEnabled(x=False, y=False)  # a live chart scrolls by itself; pause to zoom
        self.crosshair = pg.InfiniteLine(angle=90, movable=False)
        self.crosshair.setVisible(False)
        item.addItem(self.crosshair, ignoreBounds=True)
        self._curves: list[pg.PlotCurveItem] = []
        self._thin = IncrementalMinMax()
        self._y_fixed: tuple[float, float] | None = None
        self._y_shown: tuple[float, float] | None = None
        self._end = 0.0  # absolute time of x = 0
        self._hover_time: float | None = None
        self._readout_written = -float("inf")  # monotonic time of the last "now" read-out
        self._mouse_proxy = pg.SignalProxy(self.plot.scene().sigMouseMoved, rateLimit=30, slot=self._on_mouse_moved)
        self.plot.installEventFilter(self)

        self.legend = QWidget()
        self.legend.setObjectName("chartLegend")
        self.legend.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self._legend_layout = QHBoxLayout(self.legend)
        self._legend_layout.setContentsMargins(0, 0, 0, 0)
        self._legend_layout.addStretch(1)
        self.checkboxes: list[QCheckBox] = []

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.readout)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.legend)
        self._apply_theme()

    # -- configuration ------------------------------------------------------------------
    def set_series(self, names: list[str]) -> None:
        """Name the series; curves and check boxes are rebuilt only when the names change."""
        if names == self._names:
            return
        item = self.plot.getPlotItem()
        for curve in self._curves:
            item.removeItem(curve)
        for box in self.checkboxes:
            self._legend_layout.removeWidget(box)
            box.deleteLater()
        self._names = list(names)
        self._notes = [None] * len(names)
        self._curves, self.checkboxes = [], []
        for i, name in enumerate(names):
            # PlotCurveItem, not PlotDataItem: the data is already cut to the window and thinned, and the
            # lighter item halves the cost of setData. Width 1: wider lines take Qt's slow stroking path.
            curve = pg.PlotCurveItem(pen=pg.mkPen(series_color(i), width=1), connect="finite")
            item.addItem(curve)
            self._curves.append(curve)
            box = QCheckBox(name)
            box.setObjectName(f"series{i}")
            box.setIcon(_swatch(series_color(i)))
            box.setChecked(True)
            box.toggled.connect(lambda on, i=i: self._on_toggled(i, on))
            self._legend_layout.insertWidget(i, box)
            self.checkboxes.append(box)
        self._t, self._values = np.empty(0), np.empty((len(names), 0))
        self._thin.reset()
        self._readout_written = -float("inf")

    def set_series_notes(self, notes: list[str | None]) -> None:
        """Per series, why it has no data (shown as "n/a" with the reason as tooltip), or None."""
        for i, (box, note) in enumerate(zip(self.checkboxes, notes, strict=False)):
            if note == self._notes[i]:
                continue
            self._notes[i] = note
            box.setText(f"{self._names[i]} ({NA})" if note else self._names[i])
            box.setToolTip(f"{self._names[i]}: {note}" if note else f"Show or hide {self._names[i]}")

    def set_quantity(
        self, title: str, unit: str, fmt: str = "{:.1f}", y_range: tuple[float, float] | None = None
    ) -> None:
        self._title, self._unit, self._fmt = title, unit, fmt
        item = self.plot.getPlotItem()
        label = f"{title} ({unit})" if unit else title
        if self._titled:
            self.plot.set_title(label)
        else:
            item.setLabel("left", label)
        # The unit is in the label: an axis that rescales itself ("x0.001") would contradict it.
        item.getAxis("left").enableAutoSIPrefix(False)
        item.disableAutoRange()
        self._y_fixed, self._y_shown = y_range, None
        if y_range is not None:
            item.setYRange(*y_range, padding=0.02)
        self._thin.reset()
        self._readout_written = -float("inf")

    def set_window(self, seconds: float | None) -> None:
        """How much time the chart shows, ending at the newest point; None shows everything."""
        self._window = seconds
        self._thin.reset()
        self._readout_written = -float("inf")
        self._update_x_range()

    @property
    def window(self) -> float | None:
        return self._window

    def set_paused(self, paused: bool) -> None:
        """Paused, the chart keeps what it shows and can be zoomed and panned; the caller stops feeding it."""
        self._paused = paused
        self.plot.setMouseEnabled(x=paused, y=paused)
        if not paused:
            self._update_x_range()

    @property
    def paused(self) -> bool:
        return self._paused

    def series_visible(self, index: int) -> bool:
        return self.checkboxes[index].isChecked()

    def set_series_visible(self, index: int, visible: bool) -> None:
        self.checkboxes[index].setChecked(visible)

    # -- data -----------------------------------------------------------------------------
    def set_data(self, t: np.ndarray, values: np.ndarray, epoch: int | None = None) -> None:
        """Times (n,) and one row of values per series (k, n); the arrays are kept, not copied.

        `epoch` lets a caller with long series promise that the data only grew at its end since
        the last call with the same epoch, so only the new part is thinned; it passes another
        epoch when older data changed (history merged in). None: thin everything every time.
        """
        self._t, self._values = t, values
        self._end = float(t[-1]) if len(t) else 0.0
        if epoch is None:
            self._thin.reset()
        shown_t, shown = self._thin.update(t, values, self._bin_seconds(), epoch or 0)
        x = shown_t - self._end
        for curve, row, box in zip(self._curves, shown, self.checkboxes, strict=False):
            if box.isChecked():
                curve.setData(x, row, connect="finite")
        self._update_x_range()
        self._update_y_range(shown)
        if self.crosshair.isVisible() and self._hover_time is not None:
            self.hover_at(self._hover_time)  # x is relative to the newest point, which just moved
        elif time.monotonic() - self._readout_written >= READOUT_PERIOD_S:
            self._readout_written = time.monotonic()
            self._set_readout(self._readout_at(len(t) - 1, self.latest_name))

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        """What the chart was last given: times and one row per series."""
        return self._t, self._values

    def _span(self) -> float:
        if self._window is not None:
            return self._window
        return float(self._t[-1] - self._t[0]) if len(self._t) > 1 else 1.0

    def seconds_per_pixel(self) -> float:
        """How much time one pixel column of the plot spans."""
        return self._span() / max(self.plot.getPlotItem().getViewBox().width(), 1.0)

    def _bin_seconds(self) -> float:
        """Thinning bins two pixels wide: each holds a low and a high point, one per pixel column."""
        # Rounded, so small resizes do not throw away the thinned data.
        pixels = max(100, round(self.plot.getPlotItem().getViewBox().width() / 50) * 50)
        return 2 * self._span() / pixels

    def _update_x_range(self) -> None:
        if self._paused or not len(self._t):
            return
        start = -self._window if self._window is not None else float(self._t[0]) - self._end
        self.plot.getPlotItem().setXRange(start, 0, padding=0)

    def _update_y_range(self, shown: np.ndarray) -> None:
        if self._y_fixed is not None or self._paused:
            return
        visible = [row for row, box in zip(shown, self.checkboxes, strict=False) if box.isChecked()]
        finite = np.concatenate(visible) if visible else np.empty(0)
        finite = finite[np.isfinite(finite)]
        if not len(finite):
            return
        lo, hi = float(finite.min()), float(finite.max())
        if self._y_shown is not None:
            cur_lo, cur_hi = self._y_shown
            if cur_lo <= lo and hi <= cur_hi and (hi - lo) >= KEEP_SHARE * (cur_hi - cur_lo):
                return
        span = (hi - lo) or max(abs(hi), 1.0)
        new_lo = 0.0 if 0 <= lo <= span else lo - Y_PADDING * span  # readings near zero keep zero in view
        self._y_shown = (new_lo, hi + Y_PADDING * span)
        self.plot.getPlotItem().setYRange(*self._y_shown, padding=0)

    # -- hover read-out --------------------------------------------------------------------
    def hover_at(self, x: float) -> str:
        """Put the crosshair at time `x` and return the read-out shown for it."""
        if not len(self._t):
            return NA
        i = int(np.clip(np.searchsorted(self._t, x), 0, len(self._t) - 1))
        if i > 0 and abs(self._t[i - 1] - x) < abs(self._t[i] - x):
            i -= 1
        self._hover_time = x
        self.crosshair.setPos(float(self._t[i]) - self._end)
        self.crosshair.setVisible(True)
        text = self._readout_at(i, time.strftime("%H:%M:%S", time.localtime(float(self._t[i]))))
        self._set_readout(text)
        return text

    def leave_hover(self) -> None:
        self._hover_time = None
        self.crosshair.setVisible(False)
        self._set_readout(self._readout_at(len(self._t) - 1, self.latest_name))

    @property
    def latest_name(self) -> str:
        return self._axis.latest

    def set_latest_name(self, name: str) -> None:
        """Call the newest point `name` on the axis and in the read-out: "now" while data is live, something
        else ("job end") where the chart shows a stretch that is over."""
        if name != self._axis.latest:
            self._axis.latest = name
            self._axis.picture = None  # the tick labels are cached in the axis's picture
            self._axis.update()
            if self._hover_time is None and len(self._t):
                self._set_readout(self._readout_at(len(self._t) - 1, name))

    def _set_readout(self, text: str) -> None:
        self.readout.setText(text)  # and its tooltip

    def _readout_at(self, i: int, when: str) -> str:
        if i < 0 or not self._names:
            return NA
        parts = []
        for k, name in enumerate(self._names):
            if not self.series_visible(k) or k >= len(self._values):
                continue
            v = float(self._values[k][i])
            parts.append(
                f"{name}: {NA if math.isnan(v) else self._fmt.format(v) + (' ' + self._unit if self._unit else '')}"
            )
        return f"{when} — " + "   ".join(parts) if parts else when

    def _on_mouse_moved(self, args: tuple[QPointF]) -> None:
        pos = args[0]
        vb = self.plot.getPlotItem().getViewBox()
        if not vb.sceneBoundingRect().contains(pos):
            self.leave_hover()
            return
        self.hover_at(vb.mapSceneToView(pos).x() + self._end)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.plot and event.type() == QEvent.Type.Leave:
            self.leave_hover()
        return super().eventFilter(watched, event)

    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._apply_theme()
        super().changeEvent(event)

    def _apply_theme(self) -> None:
        apply_plot_theme(self.plot, self.palette())
        self.crosshair.setPen(pg.mkPen(self.palette().color(QPalette.ColorRole.Text), style=Qt.PenStyle.DashLine))

    def _on_toggled(self, index: int, on: bool) -> None:
        self._curves[index].setVisible(on)
        self._y_shown = None
        self._thin.reset()
        self._readout_written = -float("inf")
        if len(self._t):
            self.set_data(self._t, self._values)  # hidden curves are not fed; catch this one up
        self.sig_series_toggled.emit(index, on)

    # -- export -----------------------------------------------------------------------------
    def export_png(self, path: str | Path) -> None:
        """Save the chart as drawn. Runs on the GUI thread: the exporter renders the scene."""
        try:
            pg.exporters.ImageExporter(self.plot.getPlotItem()).export(str(path))
        except Exception as e:  # any failure (bad folder, full disk) is told to the user, not raised
            self.sig_export_failed.emit(f"could not save {path}: {e}")
            return
        self.sig_exported.emit(str(path))

    def export_csv(self, path: str | Path) -> None:
        """Write the visible series in the shown window to CSV, off the GUI thread; sig_exported when done."""
        t, values = self._t, self._values
        if self._window is not None and len(t):
            first = int(np.searchsorted(t, t[-1] - self._window))
            t, values = t[first:], values[:, first:]
        columns = [k for k in range(len(self._names)) if self.series_visible(k)]
        unit = f" ({self._unit})" if self._unit else ""
        header = ["time", "unix_time", *(f"{self._title} {self._names[k]}{unit}".strip() for k in columns)]
        rows_t, rows_v = t.copy(), values[columns].copy()

        def write() -> str:
            with open(path, "w", newline="", encoding="utf-8") as f:
                out = csv.writer(f)
                out.writerow(header)
                for j, ts in enumerate(rows_t):
                    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
                    cells = ["" if math.isnan(v) else f"{v:.6g}" for v in rows_v[:, j].tolist()]
                    out.writerow([stamp, f"{ts:.3f}", *cells])
            return str(path)

        run_in_background(
            write, self.sig_exported.emit, lambda e: self.sig_export_failed.emit(f"could not save {path}: {e}")
        )
