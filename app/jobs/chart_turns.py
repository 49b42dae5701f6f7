"""A chart's next paint, cut into event-loop turns done before it.

pyqtgraph does a plot's costly work inside the paint that follows a change:
it lays the plot out, fits the view to the data and draws each axis's ticks
and labels into a picture (generateDrawSpecs: a text layout per label). That
is 5 ms of one chart's 6 ms paint on an idle machine, and one slice of eight
times that wall time on a busy one, in which the window cannot answer
(benchmarks/gui_job_open.py). The same work can be done ahead of the paint,
one piece per turn, while the chart's updates are off: the paint that follows
replays pictures that are ready.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import pyqtgraph as pg
from PySide6.QtGui import QPainter, QPicture

AXES = ("left", "bottom", "right", "top")
MAX_REST_S = 0.25  # the most a turn waits for the one before it, however busy the machine


def paint_steps(view: pg.PlotWidget) -> list[Callable[[], None]]:
    """What `view`'s next paint would do, as steps to run one per turn (each a millisecond or two)."""
    item = view.getPlotItem()
    axes = [axis for axis in (item.getAxis(name) for name in AXES) if axis.isVisible()]
    return [partial(fit, view), *(partial(draw_axis, axis) for axis in axes), partial(settle, view)]


def fit(view: pg.PlotWidget) -> None:
    """Lay the plot out and fit its range now: both invalidate the axes' pictures, so they come first."""
    layout = view.getPlotItem().layout
    if layout is not None:
        layout.activate()
    view.scene().prepareForPaint()


def draw_axis(axis: pg.AxisItem) -> None:
    """Draw `axis` into the picture its paint replays, as AxisItem.paint does when it has none."""
    if axis.picture is not None or not axis.isVisible():
        return
    picture = QPicture()
    painter = QPainter(picture)
    try:
        if axis.style["tickFont"]:
            painter.setFont(axis.style["tickFont"])
        specs = axis.generateDrawSpecs(painter)
        if specs is not None:
            axis.drawPicture(painter, *specs)
    finally:
        painter.end()
    axis.picture = picture


def settle(view: pg.PlotWidget) -> None:
    """Lay out again and redraw what that undid: an axis whose labels came out wider than it was
    is widened, which leaves it without a picture (rare, and then one axis)."""
    fit(view)
    item = view.getPlotItem()
    for name in AXES:
        draw_axis(item.getAxis(name))


class Pacer:
    """How long to rest before the next turn of a chain: as long as the turns were kept waiting for the CPU.

    A chain of turns that never rests keeps the GUI thread runnable from the click until the page is
    drawn; on a busy machine the scheduler then counts it as a CPU hog like the busy processes, and makes
    each of its wake-ups wait as long as theirs (the window stopped answering for hundreds of
    milliseconds between turns of a few). Resting as long as it was kept waiting leaves the thread idle
    part of the time, so it wakes up promptly when the window is asked something. On an idle machine
    nothing waits and the chain runs at full speed.
    """

    def __init__(self) -> None:
        self._at = time.perf_counter()
        self._cpu = time.thread_time()
        self._rest = 0.0

    def start(self) -> None:
        """A chain starts: what happened before it is not a wait."""
        self._at, self._cpu, self._rest = time.perf_counter(), time.thread_time(), 0.0

    def rest_ms(self, least_ms: int = 0) -> int:
        """The rest before the next turn (at least `least_ms`), to call at the end of each turn."""
        now, cpu = time.perf_counter(), time.thread_time()
        waited = (now - self._at) - (cpu - self._cpu) - self._rest
        self._at, self._cpu = now, cpu
        self._rest = min(max(waited, least_ms / 1000), MAX_REST_S)
        return round(self._rest * 1000)
