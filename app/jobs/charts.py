"""Live charts of one job: loss (raw, smoothed, eval, and a second run to compare), learning rate,
tokens/s, step time, MFU, peak memory per rank against the plan, and its GPUs' memory and utilisation.

The charts read a `JobSeries` and a `GpuUsage` (bounded ring buffers) and are
redrawn by `refresh()`, which the page calls on a timer; a redraw happens only
while the charts are visible and only when something they show has changed.
Curves are made once and then fed with `setData`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QPalette, QResizeEvent
from PySide6.QtWidgets import QGridLayout, QLabel, QWidget

from rigpilot.app.jobs.chart_turns import Pacer, paint_steps
from rigpilot.app.jobs.gaps import break_gaps
from rigpilot.app.jobs.series import GIB, GpuUsage, JobSeries
from rigpilot.app.widgets.chart_view import ZOOM_HINT, ChartView
from rigpilot.app.widgets.decimate import minmax_bins
from rigpilot.app.widgets.palette import BAD, apply_plot_theme, series_color
from rigpilot.app.widgets.time_chart import TimeChart

TELEMETRY_WINDOW_S = 600.0
JOB_END = "job end"  # the newest point of a finished job's GPU charts
EMPTY = np.empty(0)
OFF_SCALE = 10.0  # a plan figure this many times above or below what was measured is not drawn
# Two rows of four charts fit the job page of a 1280x800 window; below this height a row scrolls.
CHART_MIN_HEIGHT = 120
COLUMNS = 4
NARROW_PX, WIDE_PX = 980, 1030  # below the first, two columns; from the second, four again
THIN_POINTS = 1000  # series shorter than twice this are drawn point for point
STAGGER_MS = 25  # between drawing one chart and the next: eight charts in 200 ms, well inside a refresh
# The workers divide by the device's peak FLOP/s (engine/workers/metrics.py), which a CPU rank has not.
NO_MFU_ON_CPU = (
    "No MFU on CPU ranks: it is the share of a GPU's peak arithmetic a step uses, and this job runs on the "
    "CPU of a simulated machine, where there is no peak to measure against."
)
SIMULATED_PLAN = "the plan is for the machine's real GPUs; this run is on CPU ranks of a simulated machine"


def round_up(value: float) -> float:
    """The next round number at or above `value` (1, 1.5, 2, 3, 4, 5, 6, 8 times a power of ten)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 1.5, 2, 3, 4, 5, 6, 8, 10) if m * power >= value)


def compact(value: float, unit: str = "") -> str:
    """Three significant digits and a k/M/G suffix: 4662000 -> "4.66M", 0.0125 s -> "12.5 ms"."""
    if unit == "s":
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if abs(value) >= scale or name == "µs":
                return f"{value / scale:.3g} {name}"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}" + (f" {unit}" if unit else "")
    return f"{value:.3g}" + (f" {unit}" if unit else "")


class StepPlot(ChartView):
    """A plot against the training step, with an optional dashed line for the plan's prediction.

    The title stays short (a unit, a figure): the explanation is in the tooltip, so it is never cut.
    """

    def __init__(self, title: str, unit: str = "", name: str = "", about: str = ""):
        super().__init__()
        self.setObjectName(name or title)
        self.setAccessibleName(f"{title} chart")
        self.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # mouse-only zoom; the numbers are in the tables
        self.setMinimumHeight(CHART_MIN_HEIGHT)
        item = self.getPlotItem()
        self.title = title
        self.unit = unit
        self.about = about or f"{title}, against the training step."
        self.setToolTip(f"{self.about}\n{ZOOM_HINT}")
        self.set_title(title)
        # No grid: the axes draw it across the whole plot, so every new point would repaint it (most of
        # the cost of a frame); the y ticks and the tables carry the numbers.
        item.setMenuEnabled(False)
        vb = item.getViewBox()
        vb.disableAutoRange(axis=pg.ViewBox.XAxis)  # fit_steps moves x in round steps, not on every step
        vb.sigRangeChangedManually.connect(self._on_zoomed)
        item.autoBtn.clicked.connect(self._on_unzoomed)
        self._x_span: tuple[float, float] | None = None
        self._zoomed = False  # the user zoomed (Ctrl+wheel, drag): the chart stops moving its x range
        self.legend: pg.LegendItem | None = None
        self.prediction = pg.InfiniteLine(
            angle=0, movable=False, pen=pg.mkPen(BAD, width=1.5, style=Qt.PenStyle.DashLine)
        )
        self.prediction.setVisible(False)
        self.off_scale = False  # the plan's figure is too far from the measured one to draw on this scale
        self.plan_note = ""  # what the tooltip says about the plan's figure
        self.missing = False  # the job reports steps but not this figure
        self.why = ""  # why it does not, where that is known: shown in the chart's place
        self.reason: QLabel | None = None
        item.addItem(self.prediction, ignoreBounds=False)
        apply_plot_theme(self, self.palette())

    def add_legend(self) -> pg.LegendItem:
        """A legend in a row under the plot, where it never covers a curve."""
        item = self.getPlotItem()
        self.legend = pg.LegendItem(colCount=3, labelTextSize="8pt", frame=False, verSpacing=-6)
        item.layout.addItem(self.legend, 4, 1)
        return self.legend

    def fit_steps(self, first: float, last: float) -> None:
        """Show steps `first` to a round number past `last`: the axis is redrawn a few times a decade,
        not on every step."""
        if self._zoomed:
            return
        span = (float(first), round_up(max(float(last), float(first) + 1.0)))
        if span != self._x_span:
            self._x_span = span
            self.getPlotItem().getViewBox().setXRange(*span, padding=0)

    def _on_zoomed(self, *_: object) -> None:
        self._zoomed = True

    def _on_unzoomed(self, *_: object) -> None:
        self._zoomed, self._x_span = False, None
        self.getPlotItem().getViewBox().disableAutoRange(axis=pg.ViewBox.XAxis)

    def curve(
        self, name: str, color_index: int, *, width: float = 1.0, dashed: bool = False, alpha: int = 255
    ) -> pg.PlotDataItem:
        color = series_color(color_index)
        color.setAlpha(alpha)
        # Width 1 (cosmetic): wider lines are drawn segment by segment, several times slower.
        pen = pg.mkPen(color, width=width, style=Qt.PenStyle.DashLine if dashed else Qt.PenStyle.SolidLine)
        curve = self.getPlotItem().plot(pen=pen, name=name, connect="finite")
        curve.setDownsampling(auto=True, method="peak")
        curve.setClipToView(True)
        if self.legend is not None:
            self.legend.addItem(curve, name)
        return curve

    def show_prediction(
        self, value: float | None, measured: np.ndarray | None = None, *, simulated: bool = False
    ) -> None:
        """The plan's figure as a dashed line; named in the title instead where it cannot be compared.

        A simulated machine's plan is for its GPUs while CPU ranks measure: the line is not drawn
        and the title calls the figure the GPU plan's. On a real machine a figure beyond OFF_SCALE
        times the measured one either way would squash the curve flat: it is only named.
        """
        self.off_scale = False
        if value is None or not math.isfinite(value):
            self.plan_note = ""
            self._show_line(False)
            self._set_title(self.title)
            self.setToolTip(f"{self.about}\n{ZOOM_HINT}")
            return
        seen = measured[np.isfinite(measured)] if measured is not None else EMPTY
        top = float(np.abs(seen).max()) if seen.size else 0.0
        self.off_scale = top > 0 and not top / OFF_SCALE <= abs(value) <= top * OFF_SCALE
        figure = compact(value, "s" if self.unit == "s" else "")  # the title names any other unit
        self.prediction.setPos(value)
        if simulated:
            self.plan_note = f"GPU plan: {figure} ({SIMULATED_PLAN}), so it is not drawn."
            self._show_line(False)
            self._set_title(f"{self.title} · GPU plan {figure}")
        else:
            arrow = " ↑" if self.off_scale and abs(value) > top else " ↓" if self.off_scale else ""
            self.plan_note = f"Plan: {figure}" + (
                ", too far from the measured values to draw on this scale." if self.off_scale
                else " (dashed line)."
            )  # fmt: skip
            self._show_line(not self.off_scale)
            self._set_title(f"{self.title} · plan {figure}{arrow}")
        self.prediction.setToolTip(self.plan_note)
        self.setToolTip(f"{self.about}\n{self.plan_note}\n{ZOOM_HINT}")

    def _show_line(self, visible: bool) -> None:
        if self.prediction.isVisible() != visible:
            self.prediction.setVisible(visible)
            self.getPlotItem().getViewBox().updateAutoRange()  # a hidden line no longer counts

    def show_missing(self, missing: bool, why: str = "") -> None:
        """Say so in the title when the job's steps come without this figure (an empty chart says nothing),
        and `why`, where it is known, in the chart's place."""
        why = why if missing else ""
        if missing == self.missing and why == self.why:
            return
        self.missing, self.why = missing, why
        self._set_title(self.title)
        said = ("This job's ranks do not report it." + (f" {why}" if why else "") + "\n") if missing else ""
        self.setToolTip(f"{self.about}\n{said}{ZOOM_HINT}")
        if why and self.reason is None:
            self.reason = QLabel(self.viewport())
            self.reason.setObjectName("chartReason")
            self.reason.setWordWrap(True)
            self.reason.setAlignment(Qt.AlignmentFlag.AlignCenter)
            self.reason.setForegroundRole(QPalette.ColorRole.PlaceholderText)
            self.reason.setAttribute(Qt.WidgetAttribute.WA_TransparentForMouseEvents)
            # Opaque, over the empty axes: an axis with nothing on it reads as a broken chart.
            self.reason.setAutoFillBackground(True)
            self.reason.setBackgroundRole(QPalette.ColorRole.Base)
        if self.reason is not None:
            self.reason.setText(why)
            self.reason.setVisible(bool(why))
            self._place_reason()

    def _place_reason(self) -> None:
        reason = getattr(self, "reason", None)  # GraphicsView resizes itself before __init__ gets this far
        if reason is not None:
            reason.setGeometry(self.viewport().rect().adjusted(0, 22, 0, 0))  # the title stays in view

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._place_reason()

    def _set_title(self, title: str) -> None:
        self.set_title(f"{self.title} · not reported" if self.missing else title, self.title)


class MemoryPerRankPlot(ChartView):
    """Peak memory of each rank as bars, beside the plan's predicted peak per GPU."""

    TITLE = "Peak memory"

    def __init__(self) -> None:
        super().__init__()
        self.setObjectName("peakMemoryChart")
        self.setAccessibleName("Peak memory per rank chart")
        self.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.setMinimumHeight(CHART_MIN_HEIGHT)
        item = self.getPlotItem()
        self.set_title(f"{self.TITLE} (GiB)")
        item.setMenuEnabled(False)
        self.setToolTip(f"The highest memory each rank reported, against the plan's peak per GPU.\n{ZOOM_HINT}")
        self._ranks: list[int] = []
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.6, brush=series_color(0))
        item.addItem(self.bars)
        self.prediction = pg.InfiniteLine(
            angle=0, movable=False, pen=pg.mkPen(BAD, width=1.5, style=Qt.PenStyle.DashLine)
        )
        self.prediction.setVisible(False)
        item.addItem(self.prediction)
        apply_plot_theme(self, self.palette())

    def show_memory(self, peak_by_rank: dict[int, float], predicted_bytes: float | None, simulated: bool = False) -> None:
        ranks = sorted(peak_by_rank)
        self.bars.setOpts(x=ranks, height=[peak_by_rank[r] / GIB for r in ranks], width=0.6)
        item = self.getPlotItem()
        if ranks != self._ranks:
            self._ranks = ranks
            item.getAxis("bottom").setTicks([[(r, f"rank {r}") for r in ranks]])
        if predicted_bytes:
            self.prediction.setPos(predicted_bytes / GIB)
            plan = "GPU plan" if simulated else "plan"
            why = f" ({SIMULATED_PLAN})" if simulated else ""
            self.prediction.setToolTip(f"{plan}: {predicted_bytes / GIB:.1f} GiB per GPU{why}")
            title = f"{self.TITLE} · {plan} {predicted_bytes / GIB:.2g} GiB"
        else:
            title = f"{self.TITLE} (GiB)"
        self.set_title(title, f"{self.TITLE} (GiB)")
        self.prediction.setVisible(bool(predicted_bytes))

    def bar_heights(self) -> list[float]:
        return [float(h) for h in (self.bars.opts.get("height") if self.bars.opts.get("height") is not None else [])]


class JobCharts(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.series: JobSeries | None = None
        self.compare: JobSeries | None = None
        self.compare_name = ""
        self.usage = GpuUsage()
        self.predicted: dict[str, Any] | None = None
        self.ranks = 1
        self.smoothing = 0.9
        self._drawn: tuple[Any, ...] | None = None

        self.simulated = False
        self._gpu_names: list[str] = []
        self._latest_name = "now"

        self.loss = StepPlot("Loss", name="lossChart", about="Training loss of rank 0 against the step: "
                             "raw, smoothed (the Smoothing weight), and the eval loss as dots.")
        self.loss.add_legend()
        self.loss_raw = self.loss.curve("loss", 0, alpha=90)
        self.loss_ema = self.loss.curve("smoothed", 0)
        self.eval_loss = self.loss.getPlotItem().plot(
            pen=None, symbol="o", symbolSize=6, symbolBrush=series_color(2), name="eval"
        )
        assert self.loss.legend is not None
        self.loss.legend.addItem(self.eval_loss, "eval")
        self.compare_raw = self.loss.curve("compared", 1, dashed=True, alpha=90)
        self.compare_ema = self.loss.curve("compared, smoothed", 1, dashed=True)
        self._show_compare_in_legend("")
        self.lr = StepPlot("Learning rate", name="lrChart", about="Learning rate of the optimizer, per step.")
        self.lr_curve = self.lr.curve("lr", 3)
        self.speed = StepPlot(
            "Tokens/s per GPU", "tokens/s", name="speedChart",
            about="Tokens per second of one GPU (rank 0), per step; the plan's figure is the job's rate "
                  "divided by its GPUs.",
        )  # fmt: skip
        self.speed_curve = self.speed.curve("tokens/s", 4)
        self.step_time = StepPlot("Step time", "s", name="stepTimeChart", about="Seconds per optimizer step.")
        self.step_time_curve = self.step_time.curve("step time", 5)
        self.mfu = StepPlot("MFU (%)", name="mfuChart", about="Model FLOPs utilisation: the share of the GPUs' "
                            "peak arithmetic the step used.")
        self.mfu_curve = self.mfu.curve("MFU", 6)
        self.memory_per_rank = MemoryPerRankPlot()
        self.gpu_memory = TimeChart(titled=True)
        self.gpu_memory.setObjectName("gpuMemoryChart")
        self.gpu_memory.plot.setAccessibleName("Memory used on the job's GPUs")
        self.gpu_memory.set_quantity("GPU memory", "GiB")
        self.gpu_memory.set_window(TELEMETRY_WINDOW_S)
        self.gpu_util = TimeChart(titled=True)
        self.gpu_util.setObjectName("gpuUtilChart")
        self.gpu_util.plot.setAccessibleName("Utilisation of the job's GPUs")
        self.gpu_util.set_quantity("GPU utilisation", "%", "{:.0f}", (0.0, 100.0))
        self.gpu_util.set_window(TELEMETRY_WINDOW_S)
        for chart in (self.gpu_memory, self.gpu_util):
            chart.plot.setFocusPolicy(Qt.FocusPolicy.NoFocus)
            chart.plot.setMinimumHeight(CHART_MIN_HEIGHT - 40)  # the read-out and legend rows make up the rest

        # Eight equal cells, two rows of four: at 1280x800 every chart is on screen at once. A narrower
        # page gets two columns (and scrolls) rather than charts too narrow for their titles.
        self.grid = QGridLayout(self)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setSpacing(4)
        self.columns = 0
        self._lay_out(COLUMNS)
        for held in self.charts():
            # A chart held back from its first show (hold_until_drawn) keeps its cell: the others stay put.
            policy = held.sizePolicy()
            policy.setRetainSizeWhenHidden(True)
            held.setSizePolicy(policy)

        # Each chart's draw; the loss chart's also draws the compared run.
        self._draws: dict[QWidget, Callable[[], None]] = {
            self.loss: self._draw_loss,
            self.lr: lambda: self._draw_step_chart(self.lr, self.lr_curve, "lr"),
            self.speed: lambda: self._draw_step_chart(self.speed, self.speed_curve, "tokens_per_s"),
            self.step_time: lambda: self._draw_step_chart(self.step_time, self.step_time_curve, "step_time"),
            self.mfu: lambda: self._draw_step_chart(self.mfu, self.mfu_curve, "mfu", 100.0),
            self.memory_per_rank: self._draw_memory_per_rank,
            self.gpu_memory: self._draw_gpu_memory,
            self.gpu_util: self._draw_gpu_util,
        }
        self._to_draw: set[QWidget] = set()  # charts whose data changed since they were drawn
        self._to_show: set[QWidget] = set()  # charts held back from their first show (hold_until_drawn)
        self._pending: list[QWidget] = []  # charts waiting for their turns, in grid order
        self._current: QWidget | None = None  # the chart whose turns are under way
        self._steps: list[Callable[[], None]] = []  # the rest of its turns
        self._turn = QTimer(self)
        self._turn.setSingleShot(True)
        self._turn.timeout.connect(self._next_turn)
        self._pacer = Pacer()

    def _lay_out(self, columns: int) -> None:
        if columns == self.columns:
            return
        self.columns = columns
        for n, chart in enumerate(self.charts()):
            self.grid.removeWidget(chart)
            self.grid.addWidget(chart, n // columns, n % columns)
        for column in range(COLUMNS):
            self.grid.setColumnStretch(column, 1 if column < columns else 0)
        rows = -(-len(self.charts()) // columns)
        for row in range(self.grid.rowCount()):
            # Rows share the height equally: the loss chart must not be the short one beside tall neighbours.
            self.grid.setRowStretch(row, 1 if row < rows else 0)

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        # Apart by more than a scroll bar's width, so that showing one cannot flip the layout back.
        width = event.size().width()
        if width < NARROW_PX:
            self._lay_out(2)
        elif width >= WIDE_PX:
            self._lay_out(COLUMNS)

    def charts(self) -> list[QWidget]:
        """Every chart, in grid order."""
        return [self.loss, self.lr, self.speed, self.step_time,
                self.mfu, self.memory_per_rank, self.gpu_memory, self.gpu_util]  # fmt: skip

    # -- what to show ---------------------------------------------------------------------------
    def set_job(
        self,
        series: JobSeries | None,
        gpus: list[int],
        ranks: int,
        predicted: dict[str, Any] | None,
        simulated: bool = False,
        ended: bool = False,
    ) -> None:
        """Show another job (or the same one with a new record): its series, GPUs and the plan's figures.

        `simulated`: the job runs as CPU ranks standing in for a simulated machine's GPUs, so the
        plan's figures (for those GPUs) are labelled as GPU predictions rather than compared.
        `ended`: the GPU charts show the job's own last minutes, whose newest point is its end, not now.
        """
        self.simulated = simulated
        # The GPU charts take their names when they are drawn: a new set of GPUs builds curves and
        # check boxes, which is the chart's own turn's work, not the click's.
        self._gpu_names = [f"GPU {g}" for g in gpus]
        self._latest_name = JOB_END if ended else "now"
        if series is not self.series:
            self.series = series
            self.usage = GpuUsage()
        self.usage.set_gpus(gpus)
        self.ranks = max(ranks, 1)
        self.predicted = predicted
        self._drawn = None

    def set_compare(self, series: JobSeries | None, name: str = "") -> None:
        if series is self.compare and name == self.compare_name:
            return
        self.compare, self.compare_name = series, name
        self._show_compare_in_legend(name if series is not None else "")
        self._drawn = None

    def _show_compare_in_legend(self, name: str) -> None:
        legend = self.loss.legend
        if legend is None:  # None until add_legend, which the loss chart calls when it is built
            return
        legend.removeItem(self.compare_raw)
        legend.removeItem(self.compare_ema)
        if name:
            legend.addItem(self.compare_raw, "compared")
            legend.addItem(self.compare_ema, "compared, smoothed")
        # The compared run's name is in the picker above; the legend stays one short row.
        self.loss.about = "Training loss of rank 0 against the step: raw, smoothed (the Smoothing weight), " \
            "and the eval loss as dots." + (f" Dashed: {name}." if name else "")
        self.loss.setToolTip(f"{self.loss.about}\n{ZOOM_HINT}")

    def set_smoothing(self, weight: float) -> None:
        self.smoothing = min(max(weight, 0.0), 0.999)
        self._drawn = None

    def add_telemetry(self, samples: list[dict[str, Any]]) -> None:
        self.usage.add_samples(samples)

    # -- drawing --------------------------------------------------------------------------------
    def _state(self) -> tuple[Any, ...]:
        return (
            id(self.series), self.series.revision if self.series else None,
            id(self.compare), self.compare.revision if self.compare else None,
            id(self.usage), self.usage.revision, self.smoothing,
        )  # fmt: skip

    def refresh(self, force: bool = False) -> bool:
        """Redraw if visible and changed (or forced); True when it drew.

        The loss chart's data is drawn at once; from the next turn on, each chart in turn, STAGGER_MS
        apart, is drawn and its paint prepared in turns of its own (chart_turns) while its updates are
        off, so no turn holds more than a millisecond or two of one chart's work (all eight in one
        frame kept a busy machine's window from answering for a few hundred milliseconds). On a busy
        machine the turns rest as long as they were kept waiting (chart_turns.Pacer). `force` draws
        everything now.
        """
        state = self._state()
        if not force and (not self.isVisible() or state == self._drawn):
            return False
        self._drawn = state
        self._to_draw = set(self._draws)
        if force:
            self._finish_now()
            return True
        self._pending = [c for c in self.charts() if c is not self._current]
        for chart in self._pending:
            # Until its turn a chart keeps what it showed: a change made now (a new job's GPUs) would
            # otherwise paint in the same turn as the click that made it.
            chart.setUpdatesEnabled(False)
        self._draw(self.loss)
        if not self._turn.isActive() and self._current is None:
            self._pacer.start()
            self._turn.start(0)  # its first show and paint: not in the caller's turn
        return True

    @property
    def drawing(self) -> bool:
        """Charts are still being drawn or shown, a turn at a time."""
        return bool(self._pending or self._current is not None)

    def hold_until_drawn(self) -> None:
        """Hide the charts until the next `refresh` draws them, each shown in its own turns.

        A chart's first show lays it out and its first paint draws its axes and title (a few
        milliseconds, ten times that on a busy machine); all eight in the turn that first shows the
        job page held the window for up to a second (benchmarks/gui_job_open.py). A held chart keeps
        its cell in the grid, so the others do not move as it appears. Nothing is drawn until then:
        a job's charts drawn empty while its history loads, and again once it is in, cost twice the
        turns for a picture nobody needs (the page refreshes when the history is in).
        """
        self._turn.stop()
        self._pending, self._current, self._steps = [], None, []
        held = [c for c in self.charts() if not c.isHidden()]
        for chart in held:
            chart.hide()
        self._to_show.update(held)

    def _draw(self, chart: QWidget) -> None:
        """Draw `chart`'s data with its updates off: its paint waits until its turns have prepared it."""
        chart.setUpdatesEnabled(False)
        if chart in self._to_draw:
            self._to_draw.discard(chart)
            self._draws[chart]()

    def _chart_steps(self, chart: QWidget) -> list[Callable[[], None]]:
        def begin() -> None:
            self._draw(chart)
            if chart in self._to_show:
                self._to_show.discard(chart)
                chart.show()

        view = chart.plot if isinstance(chart, TimeChart) else chart
        assert isinstance(view, pg.PlotWidget)  # a StepPlot or the peak memory chart
        return [begin, *paint_steps(view), lambda: chart.setUpdatesEnabled(True)]

    def _next_turn(self) -> None:
        if self._current is None:
            if not self._pending:
                return
            self._current = self._pending.pop(0)
            self._steps = self._chart_steps(self._current)
        self._steps.pop(0)()
        if self._steps:
            # The next piece in a later turn: the window answers in between.
            self._turn.start(self._pacer.rest_ms())
            return
        self._current = None
        if self._pending:
            self._turn.start(self._pacer.rest_ms(STAGGER_MS))

    def _finish_now(self) -> None:
        self._turn.stop()
        self._pending, self._current, self._steps = [], None, []
        for chart in self.charts():
            self._draw(chart)
            if chart in self._to_show:
                self._to_show.discard(chart)
                chart.show()
            chart.setUpdatesEnabled(True)

    def _draw_loss(self) -> None:
        s = self.series
        if s is None:
            for curve in (self.loss_raw, self.loss_ema, self.eval_loss):
                curve.setData(EMPTY, EMPTY)
        else:
            steps, loss = s.series("loss")
            _, smoothed = s.smoothed_loss(self.smoothing)
            x, loss, smoothed = self._thin(self.loss, steps, loss, smoothed)
            self.loss_raw.setData(x, loss)
            self.loss_ema.setData(x, smoothed)
            self.eval_loss.setData(*s.eval_loss())
            self._fit(self.loss, steps)
        self._draw_compare()

    def _thin(self, plot: StepPlot, steps: np.ndarray, *rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """At most two points (the lowest and the highest) per pixel column of `plot`, broken at gaps.

        A long job has tens of thousands of steps; handing them all to pyqtgraph makes every frame
        bin them again and search them for the y range. Bins are a power of two steps wide, so
        they stay put as the job goes on and the curve does not shimmer.
        """
        if len(steps) < 2 * THIN_POINTS:
            return break_gaps(steps, *rows)
        pixels = max(plot.getPlotItem().getViewBox().width(), 100.0)
        width = 2.0 ** math.ceil(math.log2(max((steps[-1] - steps[0]) / pixels, 1.0)))
        thinned_steps, thinned = minmax_bins(steps, np.vstack(rows), width)
        return break_gaps(thinned_steps, *thinned)

    def _fit(self, plot: StepPlot, steps: np.ndarray) -> None:
        if len(steps):
            plot.fit_steps(float(steps[0]), float(steps[-1]))

    def _draw_step_chart(self, plot: StepPlot, curve: pg.PlotDataItem, name: str, scale: float = 1.0) -> None:
        s = self.series
        if s is None:
            curve.setData(EMPTY, EMPTY)
            plot.show_prediction(None)
            return
        steps, values = s.series(name)
        curve.setData(*self._thin(plot, steps, values * scale if scale != 1.0 else values))
        self._fit(plot, steps)
        missing = bool(len(steps)) and not np.isfinite(values).any()
        plot.show_missing(missing, NO_MFU_ON_CPU if plot is self.mfu and self.simulated else "")
        p = self.predicted or {}
        if plot is self.speed:
            total = p.get("tokens_per_s")
            # The plan predicts the job's rate; the chart shows one GPU's, as the ranks report it.
            per_gpu = total / self.ranks if isinstance(total, int | float) else None
            plot.show_prediction(per_gpu, values, simulated=self.simulated)
        elif plot is self.step_time:
            plot.show_prediction(p.get("step_time_s"), values, simulated=self.simulated)

    def _draw_memory_per_rank(self) -> None:
        s = self.series
        p = self.predicted or {}
        self.memory_per_rank.show_memory(s.peak_memory if s else {}, p.get("peak_memory_bytes") if s else None,
                                         self.simulated)  # fmt: skip

    def _draw_compare(self) -> None:
        c = self.compare
        if c is None:
            self.compare_raw.setData(EMPTY, EMPTY)
            self.compare_ema.setData(EMPTY, EMPTY)
            return
        steps, loss = c.series("loss")
        x, loss, smoothed = self._thin(self.loss, steps, loss, c.smoothed_loss(self.smoothing)[1])
        self.compare_raw.setData(x, loss)
        self.compare_ema.setData(x, smoothed)

    def _name_gpu_series(self, chart: TimeChart) -> None:
        chart.set_series(self._gpu_names)
        chart.set_latest_name(self._latest_name)

    def _draw_gpu_memory(self) -> None:
        self._name_gpu_series(self.gpu_memory)
        since = (self.usage.last_time or 0.0) - TELEMETRY_WINDOW_S
        self.gpu_memory.set_data(*_two(break_gaps(*self.usage.memory(since))))

    def _draw_gpu_util(self) -> None:
        self._name_gpu_series(self.gpu_util)
        since = (self.usage.last_time or 0.0) - TELEMETRY_WINDOW_S
        self.gpu_util.set_data(*_two(break_gaps(*self.usage.utilization(since))))


def _two(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Times and values, as TimeChart.set_data takes them (break_gaps returns as many arrays as it was given)."""
    t, values = arrays
    return t, values
