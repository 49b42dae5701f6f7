"""The desktop app exactly as `rigpilot` starts it, with a probe that tells a test what is on the screen.

    python tests/support/x11_app.py PROBE.json

The app runs through `rigpilot.app.launcher.main()` (the console script's code) on the real X display. Every
0.4 s the probe writes, atomically, what a person looking at the screen could read: each top-level window's
title, and for every visible widget that has an object name its text, whether it is enabled, where it is on
the screen, a combo box's items, a tab bar's tabs and a view's row count. The test reads that file to know
where to click and what changed, and it still types and clicks through the X server (XTEST), so the window
gets real input. Nothing here changes what the app does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

PERIOD_MS = 400


def _rect(w: Any) -> list[int]:
    from PySide6.QtCore import QPoint

    top_left = w.mapToGlobal(QPoint(0, 0))
    return [top_left.x(), top_left.y(), w.width(), w.height()]


def describe(w: Any) -> dict[str, Any]:
    from PySide6.QtCore import QPoint
    from PySide6.QtWidgets import (
        QAbstractButton,
        QAbstractItemView,
        QComboBox,
        QLabel,
        QLineEdit,
        QPlainTextEdit,
        QTabBar,
    )

    d: dict[str, Any] = {"enabled": w.isEnabled(), "rect": _rect(w), "class": type(w).__name__}
    if isinstance(w, (QLabel, QAbstractButton, QLineEdit)):
        d["text"] = w.text()
    elif isinstance(w, QPlainTextEdit):
        d["text"] = w.toPlainText()
    if isinstance(w, QComboBox):
        d["items"] = [w.itemText(i) for i in range(w.count())]
        d["current"] = w.currentIndex()
    if isinstance(w, QAbstractItemView) and w.model() is not None:
        d["rows"] = w.model().rowCount()
    if hasattr(w, "getPlotItem"):  # a pyqtgraph chart: its axes' ranges and each named curve's points
        item = w.getPlotItem()
        d["view_range"] = item.viewRange()
        d["curves"] = {
            c.name(): [list(map(float, xs)) if xs is not None else [] for xs in c.getData()]
            for c in item.listDataItems() if c.name()
        }  # fmt: skip
    for bar in [w] if isinstance(w, QTabBar) else w.findChildren(QTabBar, options=_direct()):
        tabs = []
        for i in range(bar.count()):
            if bar.isTabVisible(i):
                r = bar.tabRect(i)
                p = bar.mapToGlobal(QPoint(r.x(), r.y()))
                tabs.append({"text": bar.tabText(i), "rect": [p.x(), p.y(), r.width(), r.height()]})
        d["tabs"] = tabs
        d["current_tab"] = bar.tabText(bar.currentIndex()) if bar.currentIndex() >= 0 else ""
    return d


def _direct() -> Any:
    from PySide6.QtCore import Qt

    return Qt.FindChildOption.FindDirectChildrenOnly


def snapshot() -> dict[str, Any]:
    from PySide6.QtWidgets import QApplication

    windows = [
        {"title": w.windowTitle(), "class": type(w).__name__, "rect": _rect(w)}
        for w in QApplication.topLevelWidgets()
        if w.isVisible()
    ]
    widgets: dict[str, dict[str, Any]] = {}
    for w in QApplication.allWidgets():
        name = w.objectName()
        if not name or name.startswith("qt_") or not w.isVisible():
            continue
        if name in widgets:
            widgets[name]["count"] += 1
            continue
        widgets[name] = {**describe(w), "count": 1}
    return {"windows": windows, "widgets": widgets}


def start_probe(path: Path) -> None:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    def write() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snapshot()))
        os.replace(tmp, path)

    timer = QTimer(QApplication.instance(), interval=PERIOD_MS)
    timer.timeout.connect(write)
    timer.start()


def main() -> int:
    from PySide6.QtWidgets import QApplication

    from rigpilot.app.identity import COMMAND
    from rigpilot.app.launcher import main as rigpilot

    QApplication([COMMAND])  # the app's own start-up takes this instance (QApplication.instance() or …)
    start_probe(Path(sys.argv[1]))
    return rigpilot([])


if __name__ == "__main__":
    sys.exit(main())
