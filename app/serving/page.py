"""The Serving page: the models the engine serves now (name, URL, uptime), Copy URL and Stop, and a chat with
the one selected beside its load (app.serving.load).

A served model is a "serve" job (engine.workers.serve); its rows come from ServedModels and Stop cancels it.
"""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.jobs.model import duration
from rigpilot.app.serving.chat import ChatPanel
from rigpilot.app.serving.load import ServeLoad
from rigpilot.app.serving.served import ServedJob, served_models
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import heading

NAME, URL, UPTIME, STATE = range(4)
UPTIME_MS = 1000
NOTHING_SERVED = (
    "Nothing is served now. Serve a finished training job's model from its page (Use this model → Serve), "
    "or from a terminal: rigpilot serve MODEL"
)


def state_text(row: ServedJob) -> str:
    if row.listening:
        return "serving on a CPU rank (simulated machine)" if row.simulated else "serving"
    if row.state == "running":
        return "serving (asking the engine for its URL)"
    return "starting: loading the model" if row.state == "starting" else row.state


def uptime(row: ServedJob, now: float) -> str:
    since = row.since if row.since is not None else row.started
    return duration(now - since) if since is not None and row.listening else ""


class ServingPage(QWidget):
    sig_message = Signal(str)

    def __init__(self, link: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.link = link
        self.served = served_models(link)
        self.rows: list[ServedJob] = []
        self._wanted: str | None = None  # a job to select once it shows (one just submitted)

        self.count = QLabel()
        self.count.setObjectName("servedCount")
        self.table = QTableWidget(0, 4)
        self.table.setObjectName("servedTable")
        self.table.setAccessibleName("Served models")
        self.table.setHorizontalHeaderLabels(["Model", "URL", "Uptime", "State"])
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setTabKeyNavigation(False)
        self.table.setWordWrap(False)
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(NAME, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(URL, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(UPTIME, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(STATE, QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._on_selection)
        self.empty = QLabel(NOTHING_SERVED)
        self.empty.setObjectName("nothingServed")
        self.empty.setWordWrap(True)
        self.empty.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)  # under the heading

        self.copy_button = QPushButton("&Copy URL")
        self.copy_button.setObjectName("copyServedUrl")
        self.copy_button.setToolTip("Copy the OpenAI-compatible API's base URL (…/v1) to the clipboard")
        self.copy_button.clicked.connect(self.copy_url)
        self.stop_button = QPushButton("S&top serving")
        set_icon(self.stop_button, "cancel")
        self.stop_button.setObjectName("stopServing")
        self.stop_button.setToolTip("Cancel the serve job: the model stops answering")
        self.stop_button.clicked.connect(self.stop_serving)
        buttons = QHBoxLayout()
        buttons.addWidget(self.copy_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)

        self.chat_title = heading("Chat")
        self.chat = ChatPanel()
        self.load = ServeLoad(link)
        self.status = QLabel()
        self.status.setObjectName("servingStatus")
        self.status.setWordWrap(True)
        self.sig_message.connect(self.status.setText)

        head = QHBoxLayout()
        head.addWidget(heading("Serving"))
        head.addStretch(1)
        head.addWidget(self.count)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.addLayout(head)
        top_layout.addWidget(self.table, 1)
        top_layout.addWidget(self.empty, 1)  # in the table's place while there is none
        top_layout.addLayout(buttons)
        chat = QWidget()
        chat_layout = QVBoxLayout(chat)
        chat_layout.addWidget(self.chat_title)
        chat_layout.addWidget(self.chat, 1)
        load = QWidget()
        load_layout = QVBoxLayout(load)
        load_layout.addWidget(self.load)
        # Side by side, so that the chat keeps the lower half's height and its answers show their load as
        # they come.
        bottom = QSplitter(Qt.Orientation.Horizontal)
        bottom.setObjectName("chatLoadSplitter")
        bottom.addWidget(chat)
        bottom.addWidget(load)
        bottom.setStretchFactor(0, 1)
        bottom.setStretchFactor(1, 1)
        # The chat a little wider; kept when the Load area's charts give way to a line of text.
        bottom.setSizes([1100, 900])
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.setObjectName("servingSplitter")
        splitter.addWidget(top)
        splitter.addWidget(bottom)
        splitter.setCollapsible(0, False)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([200, 600])  # a few rows; the chat and the charts want the height
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(splitter, 1)
        layout.addWidget(self.status)

        self.timer = QTimer(self)
        self.timer.setInterval(UPTIME_MS)
        self.timer.timeout.connect(self._tick)
        self.served.sig_changed.connect(self.refresh)
        self.refresh()

    # -- the list -----------------------------------------------------------------------------
    def refresh(self) -> None:
        selected = self.selected()
        self.rows = sorted(self.served.rows(), key=lambda r: r.started or 0)
        self.table.setRowCount(len(self.rows))
        now = time.time()
        for i, row in enumerate(self.rows):
            texts = {NAME: row.name, URL: row.url or "", UPTIME: uptime(row, now), STATE: state_text(row)}
            for column, text in texts.items():
                item = QTableWidgetItem(text)
                item.setToolTip(f"{row.name} (job {row.id}): {row.model}" if column == NAME else text)
                self.table.setItem(i, column, item)
        self.count.setText(f"{sum(r.listening for r in self.rows)} served" if self.rows else "")
        self.table.setVisible(bool(self.rows))
        self.empty.setVisible(not self.rows)
        chosen = self._wanted or (selected.id if selected else None)
        index = next((i for i, r in enumerate(self.rows) if r.id == chosen), 0 if self.rows else -1)
        if self._wanted and index >= 0 and self.rows[index].id == self._wanted:
            self._wanted = None
        if index >= 0:
            self.table.selectRow(index)
        self._on_selection()
        if any(r.listening for r in self.rows):
            self.timer.start()
        else:
            self.timer.stop()

    def select_job(self, job_id: str) -> None:
        """Select `job_id`'s row, now or once the engine reports the job."""
        index = next((i for i, r in enumerate(self.rows) if r.id == job_id), None)
        if index is None:
            self._wanted = job_id
        else:
            self.table.selectRow(index)

    def selected(self) -> ServedJob | None:
        rows = self.table.selectionModel().selectedRows() if self.rows else []
        return self.rows[rows[0].row()] if rows and rows[0].row() < len(self.rows) else None

    def _tick(self) -> None:
        now = time.time()
        for i, row in enumerate(self.rows):
            item = self.table.item(i, UPTIME)
            if item is not None:
                item.setText(uptime(row, now))

    def _on_selection(self) -> None:
        row = self.selected()
        self.load.set_job(row)
        self.copy_button.setEnabled(row is not None and row.url is not None)
        self.stop_button.setEnabled(row is not None)
        if row is not None and row.listening:
            self.chat_title.setText(f"Chat with {row.name}")
            self.chat.set_server(row.url, row.chat_name, row.access())
        else:
            self.chat_title.setText("Chat")
            self.chat.set_server(None, None)

    # -- actions ------------------------------------------------------------------------------
    def copy_url(self) -> None:
        row = self.selected()
        if row is not None and row.url:
            QGuiApplication.clipboard().setText(row.url)
            self.sig_message.emit(f"Copied {row.url}")

    def stop_serving(self) -> None:
        row = self.selected()
        if row is None:
            return
        self.link.call(
            "cancel", job=row.id,
            on_done=lambda _r: self.sig_message.emit(f"Stopping {row.name} (job {row.id})…"),
            on_error=lambda e: self.sig_message.emit(f"Could not stop job {row.id}: {e}"),
        )  # fmt: skip
