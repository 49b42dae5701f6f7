"""The Dashboard page: a card per GPU, one big chart of a chosen metric, the host, and GPU processes.

Telemetry goes into the view-model as it arrives (cheap); drawing happens on a
timer, at most 10 times a second, only while the page is visible and only when
something new arrived. On every (re)connect the page asks the engine for the
telemetry history it missed, so the charts are full again after a reconnect.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QHideEvent, QResizeEvent, QShowEvent
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.dashboard.check_card import CheckCard
from rigpilot.app.dashboard.gpu_card import SPARK_METRICS, SPARK_SECONDS, GpuCard
from rigpilot.app.dashboard.host_panel import HostPanel
from rigpilot.app.dashboard.model import HISTORY_SECONDS, METRIC_BY_KEY, METRICS, WINDOWS, DashboardModel
from rigpilot.app.dashboard.process_table import ProcessTable
from rigpilot.app.engine_link import CONNECTED
from rigpilot.app.settings.model import read_refresh_hz
from rigpilot.app.widgets.engine_messages import machine_from_message
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import heading
from rigpilot.app.widgets.time_chart import TimeChart
from rigpilot.engine.hardware.machine import Gpu

HISTORY_PAGE = 3600  # samples per telemetry_history request
HISTORY_MAX_PAGES = 20  # a bound on paging, in case the engine keeps answering "more"
CARD_COLUMNS = 4
# Cards, host and process table are text people read: twice a second is plenty (nvitop refreshes every 2 s),
# while the chart may scroll at the full refresh rate.
CARDS_PERIOD_S = 0.5


class DashboardPage(QWidget):
    sig_metric_changed = Signal(str)  # metric key
    sig_window_changed = Signal(float)  # seconds
    sig_history_loaded = Signal(int)  # samples received in total
    sig_exported = Signal(str)  # path
    sig_message = Signal(str)  # a line shown under the chart (export done, errors)
    sig_open_machine_check = Signal(bool)  # the machine-check card's button; True: start a check too

    def __init__(self, link: Any, parent: QWidget | None = None):
        super().__init__(parent)
        self.link = link
        self.model = DashboardModel()
        self.cards: dict[int, GpuCard] = {}
        self._drawn_revision = -1
        self._cards_drawn_at = -float("inf")  # monotonic time
        self._chart_drawn_at: float | None = None  # the newest sample time the chart shows
        self._metric = METRICS[0].key
        self._history_received = 0
        self._loading_history = False
        self._job_events: dict[str, dict[str, Any]] | None = None  # job events since the `jobs` request went out

        self.check_card = CheckCard(link)
        self.check_card.sig_open.connect(self.sig_open_machine_check.emit)
        self.cards_area = self._build_cards_area()
        chart_box = self._build_chart_box()
        proc_box = self._build_process_box()
        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.setObjectName("dashboardSplitter")
        self.splitter.addWidget(self.cards_area)
        self.splitter.addWidget(chart_box)
        self.splitter.addWidget(proc_box)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([420, 360, 160])
        # Until the user drags the splitter, the cards' pane is as tall as the cards (no empty band on
        # machines with few GPUs) and the chart takes the rest.
        self._user_sized = False
        self.splitter.splitterMoved.connect(self._on_splitter_moved)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.splitter)

        self.timer = QTimer(self)
        self.timer.timeout.connect(self.refresh)
        self._apply_refresh_rate()
        self.set_metric(self._metric)
        self.chart.set_window(WINDOWS["1 min"])

        link.sig_machine.connect(self.on_machine)
        link.sig_telemetry.connect(self.on_telemetry)
        link.sig_job.connect(self.on_job)
        link.sig_state.connect(self.on_state)
        if getattr(link, "machine", None):
            self.on_machine(link.machine)
        if getattr(link, "state", None) == CONNECTED:
            self.on_state(CONNECTED, "")

    # -- layout ----------------------------------------------------------------------------
    def _build_cards_area(self) -> QWidget:
        """The host panel and a grid of GPU cards, scrolling."""
        self.host_panel = HostPanel()
        self._cards_box = QWidget()
        self._cards_grid = QGridLayout(self._cards_box)
        self._cards_grid.setContentsMargins(0, 0, 0, 0)
        self.no_gpus = QLabel("Waiting for the engine…")
        self.no_gpus.setObjectName("noGpus")
        self._cards_grid.addWidget(self.no_gpus, 0, 0)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        # Beside the host, not above it: no height taken from the GPU cards (an 8-GPU box shows them whole).
        host_row = QHBoxLayout()
        host_row.addWidget(self.host_panel, 3)
        host_row.addWidget(self.check_card, 2)
        top_layout.addLayout(host_row)
        top_layout.addWidget(self._cards_box)
        top_layout.addStretch(1)
        area = QScrollArea()
        area.setObjectName("cardsArea")
        area.setWidgetResizable(True)
        area.setWidget(top)
        area.setFocusPolicy(Qt.FocusPolicy.NoFocus)  # the cards hold no controls
        return area

    def _build_chart_box(self) -> QWidget:
        """The chart's controls, the chart with its legend, and a status line."""
        self.metric_box = QComboBox()
        self.metric_box.setObjectName("metric")
        self.metric_box.setAccessibleName("Chart metric")
        for m in METRICS:
            self.metric_box.addItem(m.title, m.key)
        self.metric_box.currentIndexChanged.connect(lambda i: self.set_metric(self.metric_box.itemData(i)))
        # Plain buttons, not a QButtonGroup: Tab skips the unchecked buttons of a group. set_window keeps one checked.
        self.window_buttons: list[QPushButton] = []
        window_row = QHBoxLayout()
        window_row.setSpacing(0)
        for label, seconds in WINDOWS.items():
            button = QPushButton(label)
            button.setObjectName(f"window {label}")
            button.setCheckable(True)
            button.setToolTip(f"Show the last {label}")
            button.setProperty("seconds", seconds)
            button.clicked.connect(lambda _=False, s=seconds: self.set_window(s))
            self.window_buttons.append(button)
            window_row.addWidget(button)
        self.window_buttons[0].setChecked(True)
        self.pause_button = QPushButton("Pause")
        set_icon(self.pause_button, "pause")
        self.pause_button.setObjectName("pause")
        self.pause_button.setCheckable(True)
        self.pause_button.setToolTip("Freeze the chart to read it, zoom and pan; data keeps being recorded")
        self.pause_button.toggled.connect(self.set_paused)
        self.png_button = QPushButton("Export PNG…")
        set_icon(self.png_button, "image")
        self.png_button.setObjectName("exportPng")
        self.png_button.clicked.connect(self._ask_png)
        self.csv_button = QPushButton("Export CSV…")
        set_icon(self.csv_button, "export")
        self.csv_button.setObjectName("exportCsv")
        self.csv_button.clicked.connect(self._ask_csv)
        controls = QHBoxLayout()
        controls.addWidget(QLabel("Chart"))
        controls.addWidget(self.metric_box)
        controls.addLayout(window_row)
        controls.addWidget(self.pause_button)
        controls.addStretch(1)
        controls.addWidget(self.png_button)
        controls.addWidget(self.csv_button)
        self.chart = TimeChart()
        self.chart.sig_exported.connect(self._on_exported)
        self.chart.sig_export_failed.connect(self.sig_message.emit)
        self.status = QLabel("")
        self.status.setObjectName("chartStatus")
        self.status.setWordWrap(True)
        self.sig_message.connect(self.status.setText)
        chart_box = QWidget()
        chart_layout = QVBoxLayout(chart_box)
        chart_layout.addLayout(controls)
        chart_layout.addWidget(self.chart, 1)
        chart_layout.addWidget(self.status)
        return chart_box

    def _build_process_box(self) -> QWidget:
        """The process table and its GPU filter."""
        self.process_filter = QComboBox()
        self.process_filter.setObjectName("processGpu")
        self.process_filter.setAccessibleName("Show processes of")
        self.process_filter.addItem("All GPUs", None)
        self.process_filter.currentIndexChanged.connect(lambda _: self._draw_processes())
        self.processes = ProcessTable()
        proc_box = QWidget()
        proc_layout = QVBoxLayout(proc_box)
        proc_head = QHBoxLayout()
        proc_head.addWidget(heading("Processes"))
        proc_head.addWidget(self.process_filter)
        proc_head.addStretch(1)
        proc_layout.addLayout(proc_head)
        proc_layout.addWidget(self.processes)
        return proc_box

    # -- engine events ----------------------------------------------------------------------
    def on_state(self, state: str, detail: str) -> None:
        if state == CONNECTED:
            self.load_history()
            self._job_events = {}
            self.link.call("jobs", on_done=self._on_jobs, on_error=self._report)

    def on_machine(self, message: dict[str, Any]) -> None:
        machine = machine_from_message(message)
        if machine is None:
            return
        if self.model.set_machine(machine):
            self._build_cards()

    def on_telemetry(self, sample: dict[str, Any]) -> None:
        before = list(self.model.gpu_indices)
        self.model.add_sample(sample)
        if self.model.gpu_indices != before:
            self._build_cards()

    def on_job(self, job: dict[str, Any]) -> None:
        self.model.update_job(job)
        if self._job_events is not None:
            self._job_events[job["id"]] = job

    def _on_jobs(self, reply: dict[str, Any]) -> None:
        # Events that arrived while the request was out are newer than the reply.
        self.model.set_jobs([*reply.get("jobs", []), *(self._job_events or {}).values()])
        self._job_events = None

    def _report(self, error: BaseException) -> None:
        self.sig_message.emit(f"Engine: {error}")

    # -- history ------------------------------------------------------------------------------
    def load_history(self) -> None:
        """Fetch what the engine recorded since our newest sample (or the last hour), page by page."""
        if self._loading_history:
            return
        self._loading_history = True
        self._history_received = 0
        newest = self.model.last_time
        since = max(newest, time.time() - HISTORY_SECONDS) if newest is not None else time.time() - HISTORY_SECONDS
        self._request_history(since, 1)

    def _request_history(self, since: float, page: int) -> None:
        self.link.call(
            "telemetry_history",
            since=since,
            limit=HISTORY_PAGE,
            on_done=lambda reply: self._on_history(reply, page),
            on_error=self._on_history_error,
        )

    def _on_history(self, reply: dict[str, Any], page: int) -> None:
        samples = reply.get("samples") or []
        before = list(self.model.gpu_indices)
        self.model.merge_history(samples)
        if self.model.gpu_indices != before:
            self._build_cards()
        self._history_received += len(samples)
        if reply.get("more") and samples and page < HISTORY_MAX_PAGES:
            self._request_history(reply.get("next_since") or samples[-1]["time"], page + 1)
            return
        self._loading_history = False
        self.refresh()  # show the filled charts now rather than at the next tick
        self.sig_history_loaded.emit(self._history_received)

    def _on_history_error(self, error: BaseException) -> None:
        self._loading_history = False
        self._report(error)

    # -- cards ---------------------------------------------------------------------------------
    def _build_cards(self) -> None:
        for card in self.cards.values():
            self._cards_grid.removeWidget(card)
            card.deleteLater()
        self.cards = {}
        machine = self.model.machine
        gpus = {g.index: g for g in machine.gpus} if machine else {}
        indices = self.model.gpu_indices
        self.no_gpus.setVisible(not indices)
        self.no_gpus.setText("This machine has no GPUs." if machine is not None else "Waiting for the engine…")
        columns = min(CARD_COLUMNS, max(len(indices), 1))
        compact = len(indices) > CARD_COLUMNS  # a second row of cards: each reads on fewer lines
        for n, index in enumerate(indices):
            card = GpuCard(gpus.get(index) or Gpu(index=index, name=f"GPU {index}"))
            card.set_compact(compact)
            self.cards[index] = card
            self._cards_grid.addWidget(card, n // columns, n % columns)
        self.chart.set_series([f"GPU {i}" for i in indices])
        QTimer.singleShot(0, self, self.fit_cards_pane)  # once the new cards are laid out
        current = self.process_filter.currentData()
        self.process_filter.blockSignals(True)
        self.process_filter.clear()
        self.process_filter.addItem("All GPUs", None)
        for i in indices:
            self.process_filter.addItem(f"GPU {i}", i)
        self.process_filter.setCurrentIndex(max(self.process_filter.findData(current), 0))
        self.process_filter.blockSignals(False)
        self._drawn_revision = -1
        self._chart_drawn_at = None

    # -- controls ------------------------------------------------------------------------------
    @property
    def metric(self) -> str:
        return self._metric

    def set_metric(self, key: str) -> None:
        metric = METRIC_BY_KEY[key]
        changed = key != self._metric
        self._metric = key
        self.metric_box.setCurrentIndex(self.metric_box.findData(key))
        self.chart.set_quantity(metric.title, metric.unit, metric.fmt, metric.y_range)
        self._draw_chart(even_paused=True, even_unmoved=True)
        if changed:
            self.sig_metric_changed.emit(key)

    @property
    def window(self) -> float:
        return self.chart.window or WINDOWS["1 h"]

    def set_window(self, seconds: float) -> None:
        for button in self.window_buttons:
            button.setChecked(button.property("seconds") == seconds)
        self.chart.set_window(seconds)
        self._draw_chart(even_paused=True, even_unmoved=True)
        self.sig_window_changed.emit(seconds)

    def set_paused(self, paused: bool) -> None:
        if self.pause_button.isChecked() != paused:
            self.pause_button.setChecked(paused)  # re-enters through toggled
            return
        self.pause_button.setText("Resume" if paused else "Pause")
        self.chart.set_paused(paused)
        if not paused:
            self._draw_chart(even_paused=True, even_unmoved=True)

    def export_png(self, path: str | Path) -> None:
        self.chart.export_png(path)

    def export_csv(self, path: str | Path) -> None:
        """Written off the GUI thread; sig_exported(path) when the file is complete."""
        self.chart.export_csv(path)

    def _default_name(self, suffix: str) -> str:
        return f"rigpilot-{self._metric}-{time.strftime('%Y%m%d-%H%M%S')}.{suffix}"

    def _ask_png(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Export chart as PNG", self._default_name("png"), "PNG image (*.png)"
        )
        if path:
            self.export_png(path)

    def _ask_csv(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Export chart data as CSV", self._default_name("csv"), "CSV (*.csv)"
        )
        if path:
            self.export_csv(path)

    def _on_exported(self, path: str) -> None:
        self.sig_message.emit(f"Saved {path}")
        self.sig_exported.emit(path)

    # -- drawing ------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Redraw what changed since the last call; a no-op while hidden."""
        if not force and (not self.isVisible() or self.model.revision == self._drawn_revision):
            return
        self._drawn_revision = self.model.revision
        self._draw_chart(even_unmoved=force)
        now = time.monotonic()
        if force or now - self._cards_drawn_at >= CARDS_PERIOD_S:
            self._cards_drawn_at = now
            self._draw_cards()
            self.host_panel.show_sample(self.model.host)
            t, host = self.model.host_series(SPARK_SECONDS)
            self.host_panel.show_history(t, host[0])
            self._draw_processes()

    def _draw_chart(self, *, even_paused: bool = False, even_unmoved: bool = False) -> None:
        if self.chart.paused and not even_paused:
            return
        last = self.model.last_time
        if not even_unmoved and last is not None and self._chart_drawn_at is not None:
            # In a long window new data moves the curves by less than a pixel; wait until it shows.
            if 0 <= last - self._chart_drawn_at < self.chart.seconds_per_pixel():
                return
        self._chart_drawn_at = last
        t, values = self.model.series(self._metric, self.chart.window)
        self.chart.set_data(t, values, self.model.epoch)
        self.chart.set_series_notes(self.model.metric_notes(self._metric))

    def _draw_cards(self) -> None:
        for index, card in self.cards.items():
            card.show_sample(self.model.latest.get(index), self.model.jobs_on(index))
            t, rows = self.model.gpu_series(index, SPARK_METRICS, SPARK_SECONDS)
            card.show_history(t, rows)

    def _draw_processes(self) -> None:
        self.processes.show_processes(
            self.model.processes(self.process_filter.currentData()), self.model.processes_unavailable()
        )

    # -- visibility and persistence --------------------------------------------------------------
    def _on_splitter_moved(self, *_: object) -> None:
        self._user_sized = True

    def fit_cards_pane(self) -> None:
        """Give the cards' pane the height of its content, at most 60 % of the page (it scrolls beyond)."""
        sizes = self.splitter.sizes()
        total = sum(sizes)
        if self._user_sized or total <= 0:
            return
        content = self.cards_area.widget().sizeHint().height() + 2 * self.cards_area.frameWidth()
        top = min(content, int(total * 0.6))
        rest = total - top
        proc = min(sizes[2], rest // 3) if sizes[2] else rest // 4
        self.splitter.setSizes([top, rest - proc, proc])

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        QTimer.singleShot(0, self, self.fit_cards_pane)  # after the splitter has taken the new size

    def _apply_refresh_rate(self) -> None:
        self.timer.setInterval(int(1000 / read_refresh_hz()))

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self._apply_refresh_rate()  # the Settings page may have changed it while we were hidden
        self.timer.start()
        self.refresh(force=True)
        # Cards made while hidden (a machine switched from Settings) were laid out with no size to fit to.
        QTimer.singleShot(0, self, self.fit_cards_pane)

    def hideEvent(self, event: QHideEvent) -> None:
        super().hideEvent(event)
        self.timer.stop()

    def save_state(self, settings: QSettings, prefix: str) -> None:
        if self._user_sized:  # otherwise the fitted sizes follow the machine's cards
            settings.setValue(f"{prefix}/splitter", self.splitter.saveState())
        else:
            settings.remove(f"{prefix}/splitter")
        settings.setValue(f"{prefix}/metric", self._metric)
        settings.setValue(f"{prefix}/window", float(self.window))

    def restore_state(self, settings: QSettings, prefix: str) -> None:
        state = settings.value(f"{prefix}/splitter")
        if isinstance(state, QByteArray) and self.splitter.restoreState(state):
            self._user_sized = True
        metric = settings.value(f"{prefix}/metric")
        if metric in METRIC_BY_KEY:
            self.set_metric(metric)
        try:
            window = float(settings.value(f"{prefix}/window", WINDOWS["1 min"]))
        except (TypeError, ValueError):
            window = WINDOWS["1 min"]
        if window in WINDOWS.values():
            self.set_window(window)
