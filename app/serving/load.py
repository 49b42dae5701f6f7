"""The Serving page's Load area: how the selected served model is doing, over time and now.

Four small charts (tokens/s, requests/s, time to first token, queued and running requests) and a read-out
of the totals, from the serve job's "serve" records. A JobHandle reads them, as it does for the Jobs page:
the history paged in when the job is selected, then the live stream; another selection closes it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from rigpilot.app.jobs.handle import JobHandle
from rigpilot.app.jobs.serve_series import IDLE_PERIODS, SERVE_FIELDS, with_idle
from rigpilot.app.serving.served import ServedJob
from rigpilot.app.widgets.style import heading
from rigpilot.app.widgets.time_chart import TimeChart
from rigpilot.app.widgets.units import NA, gib, mib
from rigpilot.engine.workers.serve_setup import METRICS_EVERY_S

LOAD_WINDOW_S = 600.0
CHART_PLOT_HEIGHT = 90  # four of them and the chat share the page's lower half at 1280x800
NOTHING_SELECTED = "Select a served model to see its load."
READING = "Reading the load so far…"
NO_REQUESTS = "No requests yet: the charts start with the first one."
# Which columns of a ServeSeries row each chart draws, and how: title, unit, format, series names, scale.
CHARTS = (
    ("serveTokensChart", "Generation speed", "tokens/s", "{:.1f}", ("generated",), ("tokens_per_s",), 1.0),
    ("serveRequestsChart", "Requests finished", "per s", "{:.2f}", ("finished",), ("requests_per_s",), 1.0),
    ("serveTtftChart", "Time to first token", "ms", "{:.0f}", ("mean",), ("time_to_first_token",), 1000.0),
    ("serveQueueChart", "Requests in the server", "", "{:.0f}", ("queued", "running"), ("queue_depth", "running"), 1.0),
)  # fmt: skip


def where(row: ServedJob) -> str:
    """Where the job runs, as the page says it: a simulated machine's job is a CPU rank."""
    if row.simulated:
        return "simulated (CPU rank)"
    if row.gpus:
        return ("GPU " if len(row.gpus) == 1 else "GPUs ") + ", ".join(str(g) for g in row.gpus)
    return ""


def size(n: float | None) -> str:
    if n is None:
        return NA
    return gib(n) if n >= 2**30 else mib(n)


def totals(latest: dict[str, Any] | None) -> str:
    """The read-out of the newest "serve" record: what counts up rather than over a window."""
    if latest is None:
        return ""

    def number(key: str) -> float | None:
        v = latest.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    served, dropped = number("requests"), number("dropped")
    kv = number("kv_cache_bytes")
    return "   ".join((
        f"Requests served: {NA if served is None else f'{served:,.0f}'}",
        f"dropped: {NA if dropped is None else f'{dropped:,.0f}'}",
        f"KV cache: {size(kv)}",
    ))  # fmt: skip


class ServeLoad(QWidget):
    def __init__(self, link: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.link = link
        self.handle: JobHandle | None = None
        self.row: ServedJob | None = None

        self.title = heading("Load")
        self.title.setObjectName("loadTitle")
        self.readout = QLabel()
        self.readout.setObjectName("loadReadout")
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.empty = QLabel(NOTHING_SELECTED)
        self.empty.setObjectName("loadEmpty")
        self.empty.setWordWrap(True)
        self.empty.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        self.charts: dict[str, TimeChart] = {}
        self.box = QWidget()
        grid = QGridLayout(self.box)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setSpacing(4)
        for n, (name, title, unit, fmt, series, _fields, _scale) in enumerate(CHARTS):
            chart = TimeChart(titled=True)
            chart.setObjectName(name)
            chart.plot.setAccessibleName(f"{title} of the served model")
            chart.plot.setMinimumHeight(CHART_PLOT_HEIGHT)
            chart.plot.setFocusPolicy(Qt.FocusPolicy.NoFocus)
            chart.set_series(list(series))
            chart.set_quantity(title, unit, fmt)
            chart.set_window(LOAD_WINDOW_S)
            chart.legend.setVisible(len(series) > 1)  # one series: its name is in the read-out already
            self.charts[name] = chart
            grid.addWidget(chart, n // 2, n % 2)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.title)
        layout.addWidget(self.readout)
        layout.addWidget(self.box, 1)
        layout.addWidget(self.empty, 1)

        # Idle servers write nothing: the charts' "now" moves on without records, this often.
        self.clock = QTimer(self)
        self.clock.setInterval(int(METRICS_EVERY_S * 1000))
        self.clock.timeout.connect(self.redraw)
        self.redraw()

    # -- which job ------------------------------------------------------------------------------
    def set_job(self, row: ServedJob | None) -> None:
        """Show `row`'s load (None: nothing selected); a job already shown keeps its handle."""
        same = row is not None and self.handle is not None and self.handle.id == row.id
        self.row = row
        if not same:
            self._close()
            for chart in self.charts.values():  # nothing of the last job's, should it be shown before new data
                chart.set_data(np.empty(0), np.empty((len(chart.checkboxes), 0)))
            if row is not None:
                self.handle = JobHandle(self.link, row.id, {"id": row.id, "state": row.state})
                self.handle.setParent(self)  # goes with the page
                self.handle.sig_metrics.connect(self._on_metrics)
                self.handle.sig_history_loaded.connect(self._on_metrics)
                self.handle.open()
        place = where(row) if row is not None else ""
        self.title.setText(f"Load of {row.name}" + (f" — {place}" if place else "") if row else "Load")
        self.redraw()

    def _close(self) -> None:
        if self.handle is not None:
            self.handle.sig_metrics.disconnect(self._on_metrics)
            self.handle.sig_history_loaded.disconnect(self._on_metrics)
            self.handle.close()
            self.handle.deleteLater()
            self.handle = None

    def showEvent(self, event: Any) -> None:
        super().showEvent(event)
        self.redraw()  # the clock stops while hidden

    # -- drawing ------------------------------------------------------------------------------
    def _on_metrics(self, _count: int) -> None:
        self.redraw()

    def redraw(self) -> None:
        handle = self.handle
        load = handle.series.serve if handle is not None else None
        last = load.last_time if load is not None else None
        if handle is None or load is None or last is None:
            self.empty.setText(
                NOTHING_SELECTED if handle is None else READING if handle.loading_history else NO_REQUESTS
            )
            self.empty.show()
            self.box.hide()
            self.readout.hide()
            self.clock.stop()
            return
        listening = self.row is not None and self.row.listening
        now = time.time() if listening else None
        # The charts show the last LOAD_WINDOW_S: a day's records are not thinned again every two seconds.
        # The newest record stays in, so a server idle for longer draws its idle line from there.
        since = max(last, now or last) - LOAD_WINDOW_S - IDLE_PERIODS * METRICS_EVERY_S
        times, values = with_idle(*load.window(min(since, last)), until=now)
        for name, _title, _unit, _fmt, _series, fields, scale in CHARTS:
            rows = np.stack([values[SERVE_FIELDS.index(f)] * scale for f in fields])
            self.charts[name].set_data(times, rows)
            self.charts[name].set_latest_name("now" if listening else "last record")
        self.readout.setText(totals(load.latest))
        self.empty.hide()
        self.box.show()
        self.readout.show()
        if listening and self.isVisible():
            self.clock.start()  # from now: records coming keep it from firing
        else:
            self.clock.stop()
