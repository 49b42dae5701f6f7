""" "Compare with base model" in a finished training job's Summary: the user's prompts, one a line, answered by the
base model and by the tuned one side by side, with the job's held-out loss and perplexity.

It runs `rigpilot compare-models`'s own path (engine.cli.compare.compare_models: a serve job, the prompts sent
together, the server cancelled after) off the GUI thread, on an engine client of its own, so the app and the
command line compare the same way. Nothing here imports torch: the models run in the engine's serve job.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.jobs.outcome import settings_of
from rigpilot.engine.cli.comparison import compare_models, held_out_line
from rigpilot.engine.jobs.store import COMPLETED

MAX_TOKENS = 48  # enough to see a difference in tone; a CPU rank answers in seconds
COLUMNS = ("Prompt", "Base model", "Tuned model")


class CompareWithBase(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.link: Any = None
        self.job: dict[str, Any] = {}
        self.running = False
        self.max_tokens = MAX_TOKENS
        self.prompts = QPlainTextEdit()
        self.prompts.setObjectName("comparePrompts")
        self.prompts.setAccessibleName("Prompts to compare the base and tuned models on, one a line")
        self.prompts.setPlaceholderText("Your own prompts, one a line")
        self.prompts.setMaximumHeight(self.prompts.fontMetrics().lineSpacing() * 4 + 12)
        self.button = QPushButton("&Compare with base model")
        self.button.setObjectName("compareBase")
        self.button.setToolTip("Serve the base and the tuned model and answer each prompt with both (greedy)")
        self.button.clicked.connect(self.compare)
        self.status = QLabel()
        self.status.setObjectName("compareStatus")
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.PlainText)  # a model's text and the engine's words are not HTML
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("compareTable")
        self.table.setAccessibleName("Each prompt's completion by the base and by the tuned model")
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setTabKeyNavigation(False)
        self.table.setWordWrap(True)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.hide()
        row = QHBoxLayout()
        row.addWidget(self.status, 1)
        row.addWidget(self.button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 6, 0, 0)
        layout.addWidget(QLabel("<b>Did fine-tuning help?</b>"))
        layout.addWidget(self.prompts)
        layout.addLayout(row)
        layout.addWidget(self.table)

    def show_job(self, link: Any, job: dict[str, Any]) -> None:
        """Offered for a completed training job; another job's answers are not kept."""
        if job.get("id") != self.job.get("id"):
            self.table.setRowCount(0)
            self.table.hide()
            if not self.running:
                self.status.setText("")
        self.link, self.job = link, job
        # A model trained from scratch has no base to compare with (the command line takes --base MODEL).
        scratch = (settings_of(job).get("train") or {}).get("method") == "scratch"
        self.setVisible(job.get("kind") == "train" and job.get("state") == COMPLETED and not scratch)

    def compare(self) -> None:
        prompts = [line for line in self.prompts.toPlainText().splitlines() if line.strip()]
        if self.running or self.link is None or not self.job:
            return
        if not prompts:
            self.status.setText("Type at least one prompt, one a line.")
            return
        job_id = self.job["id"]
        self.running = True
        self.button.setEnabled(False)
        self.status.setText("Serving the base and the tuned model and asking both… (a serve job; it ends after)")
        self.link.with_client(
            lambda client: compare_models(client, job_id, prompts, max_tokens=self.max_tokens),
            lambda doc: self._done(job_id, doc),
            self._failed,
        )

    def _done(self, job_id: str, doc: dict[str, Any]) -> None:
        self.running = False
        self.button.setEnabled(True)
        if job_id != self.job.get("id"):
            return  # the user moved on to another job meanwhile
        held = held_out_line(doc.get("held_out"))
        self.status.setText(held[0].upper() + held[1:] + ".")
        self.table.setRowCount(len(doc["results"]))
        for r, result in enumerate(doc["results"]):
            for c, key in enumerate(("prompt", "base", "tuned")):
                item = QTableWidgetItem(result[key])
                item.setToolTip(result[key])
                self.table.setItem(r, c, item)
        self.table.resizeRowsToContents()
        self.table.show()

    def _failed(self, error: BaseException) -> None:
        self.running = False
        self.button.setEnabled(True)
        self.status.setText(f"Could not compare: {_said(error)}")

    def rows(self) -> list[list[str]]:
        return [[self.table.item(r, c).text() for c in range(self.table.columnCount())]  # type: ignore[union-attr]
                for r in range(self.table.rowCount())]  # fmt: skip


def _said(error: BaseException) -> str:
    """A refusal in the app's words where its code has some (the engine's sentence names command-line flags)."""
    reason = getattr(error, "reason", None)
    if reason == "compare_base_missing":
        return "the job names no base model to compare its model with."
    if reason == "compare_server_failed":
        return f"the server of the models did not start (job {getattr(error, 'fields', {}).get('job')}: its log says why)."
    return " ".join(str(error).split())
