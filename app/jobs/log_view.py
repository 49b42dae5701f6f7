"""The tail of one rank's log, following it while the job runs.

Text comes from the job's handle (`logs` requests by byte offset, answered off
the GUI thread) in whole lines. The editor keeps at most MAX_LINES lines, so a
chatty job cannot grow the window's memory; the full log stays in the job folder.
"""

from __future__ import annotations

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QFontDatabase, QHideEvent, QShowEvent, QTextCursor
from PySide6.QtWidgets import QCheckBox, QComboBox, QHBoxLayout, QLabel, QPlainTextEdit, QVBoxLayout, QWidget

from rigpilot.app.jobs.handle import LAUNCHER_RANK, JobHandle

MAX_LINES = 5000
POLL_MS = 1000


class LogView(QWidget):
    sig_rank_changed = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.handle: JobHandle | None = None

        self.rank_box = QComboBox()
        self.rank_box.setObjectName("logRank")
        self.rank_box.setAccessibleName("Log of rank")
        self.rank_box.currentIndexChanged.connect(self._on_rank_chosen)
        self.follow = QCheckBox("Follow")
        self.follow.setObjectName("logFollow")
        self.follow.setToolTip("Keep reading new lines and stay at the end of the log")
        self.follow.setChecked(True)
        self.follow.toggled.connect(self._on_follow)
        self.text = QPlainTextEdit()
        self.text.setObjectName("logText")
        self.text.setAccessibleName("Log")
        self.text.setReadOnly(True)
        self.text.setMaximumBlockCount(MAX_LINES)
        self.text.setTabChangesFocus(True)
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))

        head = QHBoxLayout()
        label = QLabel("&Log of")
        label.setBuddy(self.rank_box)
        head.addWidget(label)
        head.addWidget(self.rank_box)
        head.addWidget(self.follow)
        head.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(head)
        layout.addWidget(self.text, 1)

        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self.poll)

    # -- which log ----------------------------------------------------------------------------
    def set_handle(self, handle: JobHandle | None) -> None:
        if handle is self.handle:
            return
        if self.handle is not None:
            self.handle.sig_log.disconnect(self._on_log)
            self.handle.sig_record.disconnect(self._on_record)
        self.handle = handle
        self.text.clear()
        if handle is None:
            self._set_ranks(0, None)
            return
        handle.sig_log.connect(self._on_log)
        handle.sig_record.connect(self._on_record)
        failed = handle.record.get("failed_rank")
        self._set_ranks(handle.record.get("ranks") or 1, failed if isinstance(failed, int) else 0)
        self._fetch()

    def _on_record(self, record: dict) -> None:
        self._set_ranks(record.get("ranks") or 1, None)
        self._update_timer()

    def _set_ranks(self, ranks: int, select: int | None) -> None:
        wanted = [*range(ranks), LAUNCHER_RANK] if ranks else []
        have = [self.rank_box.itemData(i) for i in range(self.rank_box.count())]
        current = self.rank if select is None else select
        if wanted != have:
            self.rank_box.blockSignals(True)
            self.rank_box.clear()
            for r in wanted:
                self.rank_box.addItem("torchrun (launcher)" if r == LAUNCHER_RANK else f"Rank {r}", r)
            self.rank_box.blockSignals(False)
        index = self.rank_box.findData(current)
        if index >= 0 and index != self.rank_box.currentIndex():
            self.rank_box.blockSignals(True)
            self.rank_box.setCurrentIndex(index)
            self.rank_box.blockSignals(False)

    @property
    def rank(self) -> int | None:
        data = self.rank_box.currentData()
        return data if isinstance(data, int) else None

    def select_rank(self, rank: int) -> None:
        index = self.rank_box.findData(rank)
        if index >= 0:
            self.rank_box.setCurrentIndex(index)  # fetches through currentIndexChanged

    def _on_rank_chosen(self, _index: int) -> None:
        self.text.clear()
        if self.rank is not None:
            self.sig_rank_changed.emit(self.rank)
        self._fetch()

    # -- following --------------------------------------------------------------------------------
    def poll(self) -> None:
        """Ask for new lines; the timer calls it while visible, following, and the job can still write."""
        self._fetch()

    def _fetch(self) -> None:
        if self.handle is not None and self.rank is not None:
            self.handle.fetch_log(self.rank)

    def _on_follow(self, on: bool) -> None:
        self._update_timer()
        if on:
            self._fetch()
            self._scroll_to_end()

    def _update_timer(self) -> None:
        running = self.handle is not None and self.handle.active
        if self.isVisible() and self.follow.isChecked() and running:
            self.timer.start()
        else:
            self.timer.stop()

    def _on_log(self, rank: int, text: str, replace: bool) -> None:
        if rank != self.rank:
            return
        if replace:
            self.text.clear()
        if text:
            bar = self.text.verticalScrollBar()
            at_end = bar.value() >= bar.maximum() - 2
            self.text.appendPlainText(text.removesuffix("\n"))
            if self.follow.isChecked() or at_end:
                self._scroll_to_end()

    def _scroll_to_end(self) -> None:
        self.text.moveCursor(QTextCursor.MoveOperation.End)
        self.text.ensureCursorVisible()

    def lines(self) -> list[str]:
        return self.text.toPlainText().splitlines()

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self._update_timer()
        self._fetch()

    def hideEvent(self, event: QHideEvent) -> None:
        super().hideEvent(event)
        self.timer.stop()
