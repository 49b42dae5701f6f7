"""A job's automatic restarts on its page: a strip of its runs with a mark where each restart came, and a
line per restart naming the cause, the checkpoint it resumed from and the GPUs left out.

The engine records each restart in the job (`restarts`: {time, run, cause, from_step, left_out_gpus,
notes}, and `max_restarts`, engine.jobs.recovery); `timeline_of` turns that into what is drawn, with
no Qt, and `RestartTimeline` draws it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QPainter, QPalette, QPen
from PySide6.QtWidgets import QFrame, QLabel, QSizePolicy, QVBoxLayout, QWidget

from rigpilot.app.jobs.model import gpus_text
from rigpilot.app.widgets.palette import ACCENT, BAD, WARN, status_text, tint


@dataclass
class RestartRow:
    when: str
    text: str  # "run 1 → 2 from step 50: rank 1 was killed by SIGKILL"
    left_out: str | None = None  # "left out GPU 2"
    notes: list[str] = field(default_factory=list)


@dataclass
class Timeline:
    heading: str | None  # None: nothing to show for this job
    rows: list[RestartRow] = field(default_factory=list)
    runs: list[tuple[int, float, float]] = field(default_factory=list)  # (run, from, to) as fractions of the strip


def timeline_of(job: dict[str, Any], now: float | None = None) -> Timeline:
    restarts = [r for r in job.get("restarts") or [] if isinstance(r, dict)]
    limit = int(job.get("max_restarts") or 0)
    if not restarts:
        if not limit:
            return Timeline(None)
        return Timeline(
            f"Restarts itself from its newest checkpoint if a rank fails, up to {limit} time{'s' * (limit != 1)} in a row."
        )
    heading = f"Restarted {len(restarts)}×" + (f" (up to {limit} in a row)" if limit else "")
    rows = []
    for r in restarts:
        raw_run = r.get("run")
        run = raw_run if isinstance(raw_run, int) else 0
        where = f"from step {r['from_step']}" if isinstance(r.get("from_step"), int) else "from the start"
        left = [g for g in r.get("left_out_gpus") or [] if isinstance(g, int)]
        rows.append(
            RestartRow(
                when=time.strftime("%H:%M:%S", time.localtime(float(r.get("time") or 0))),
                text=f"run {run} → {run + 1} {where}: {r.get('cause') or 'a rank failed'}",
                left_out=f"left out GPU {gpus_text(left)}" if left else None,
                notes=[str(n) for n in r.get("notes") or []],
            )
        )
    start = float(job.get("created") or restarts[0].get("time") or 0.0)
    end = float(job.get("ended") or now or time.time())
    times = [float(r.get("time") or start) for r in restarts]
    span = max(end - start, 1e-9)
    edges = [start, *times, max(end, times[-1])]
    raw_first = restarts[0].get("run")
    first_run = raw_first if isinstance(raw_first, int) else 1
    runs = [
        (first_run + i, (a - start) / span, min((b - start) / span, 1.0))
        for i, (a, b) in enumerate(itertools.pairwise(edges))
    ]
    return Timeline(heading, rows, runs)


class _Strip(QWidget):
    """The runs side by side over the job's life; a red mark where a run ended in a restart."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("restartStrip")
        self.runs: list[tuple[int, float, float]] = []
        self.setMinimumHeight(26)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(300, 26)

    def paintEvent(self, event: Any) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        w, h = self.width() - 2, self.height() - 2
        palette = self.palette()
        for i, (run, a, b) in enumerate(self.runs):
            rect = QRectF(1 + a * w, 1, max((b - a) * w, 2.0), h)
            p.fillRect(rect, QBrush(tint(ACCENT, palette, 0.25 if i % 2 else 0.45)))
            p.setPen(QPen(palette.color(QPalette.ColorRole.Text)))
            if rect.width() > 40:
                p.drawText(rect, Qt.AlignmentFlag.AlignCenter, f"run {run}")
        p.setPen(QPen(BAD, 3))
        for _, a, _b in self.runs[1:]:
            x = 1 + a * w
            p.drawLine(int(x), 1, int(x), int(h))
        p.end()


class RestartTimeline(QFrame):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("restartTimeline")
        self.heading = QLabel()
        self.heading.setObjectName("restartHeading")
        self.heading.setWordWrap(True)
        self.strip = _Strip()
        self.rows = QLabel()
        self.rows.setObjectName("restartRows")
        self.rows.setWordWrap(True)
        self.rows.setTextFormat(Qt.TextFormat.RichText)
        self.rows.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.heading)
        layout.addWidget(self.strip)
        layout.addWidget(self.rows)
        self.timeline = Timeline(None)
        self.hide()

    def show_job(self, job: dict[str, Any]) -> None:
        t = timeline_of(job)
        self.timeline = t
        if t.heading is None:
            self.hide()
            return
        self.heading.setText(f"<b>{_escape(t.heading)}</b>" if t.rows else _escape(t.heading))
        self.strip.runs = t.runs
        self.strip.setVisible(bool(t.rows))
        self.strip.update()
        warn = status_text(WARN, self.palette()).name()
        lines = []
        for r in t.rows:
            line = f"{r.when}  {_escape(r.text)}"
            if r.left_out:
                line += f" — <span style='color:{warn}'>{_escape(r.left_out)}</span>"
            lines.append(line + "".join(f"<br>&nbsp;&nbsp;&nbsp;• {_escape(n)}" for n in r.notes))
        self.rows.setText("<br>".join(lines))
        self.rows.setVisible(bool(lines))
        self.show()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
