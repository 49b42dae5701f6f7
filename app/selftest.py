"""`rigpilot --self-test [DIR]`: start the real window offscreen against the real engine and check it works.

Used by the package test after installing the .deb, and useful on a user's
machine when something looks wrong. What it checks, in order (the help text,
engine/cli/entry.py SELF_TEST_HELP, and so the man page say the same):

1. the window starts on Qt's offscreen platform (Qt and its plugins load);
2. it connects to the user's engine service, starting it if it is not running,
   and receives the machine and two telemetry samples;
3. every page of the window (PAGES) is built and drawn;
4. the Dashboard's chart is exported as CSV, with at least one sample.

Each page's picture (PAGE.png) and the CSV (telemetry.csv) are written into DIR
when one is given, else into a temporary folder that is deleted. It prints
`self-test passed` and exits 0, or names the first check that failed and exits
1; 90 s at most. It needs no display and no PyTorch. The user's window settings
are left alone (the window keeps its own under another application name).
"""

from __future__ import annotations

import csv
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

TIMEOUT_S = 90.0
CSV_NAME = "telemetry.csv"


class SelfTestFailed(Exception):
    """One check did not pass; the message says which."""


def _past(deadline: float) -> bool:
    return time.monotonic() > deadline


def main(out: Path | None = None) -> int:
    if out is not None and out.exists() and not out.is_dir():
        print(f"rigpilot: error: --self-test {out}: not a folder (the pictures and the CSV go into a folder)",
              file=sys.stderr)  # fmt: skip
        return 2
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from rigpilot.app.screenshots import quiet_offscreen_messages

    quiet_offscreen_messages()
    keep = out is not None
    folder = out if out is not None else Path(tempfile.mkdtemp(prefix="rigpilot-selftest-"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"rigpilot: error: --self-test {folder}: {e.strerror}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        summary = _run(folder, start)
    except SelfTestFailed as e:
        print(f"self-test failed: {e}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"self-test passed: {summary} in {time.monotonic() - start:.1f} s"
        + (f"; pictures and CSV in {out}" if keep else "")
    )
    return 0


def _run(folder: Path, start: float) -> str:
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    from rigpilot.app.engine_link import CONNECTED
    from rigpilot.app.identity import APP_NAME, ORGANIZATION
    from rigpilot.app.main_window import PAGES, MainWindow

    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName(f"{APP_NAME}-selftest")  # keep the user's window settings out of it
    app.setOrganizationName(ORGANIZATION)
    errors: list[str] = []
    previous_hook = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        # An exception in a Qt slot does not unwind to here: it reaches the hook, and fails the test.
        errors.append(f"{kind.__name__}: {value}")
        previous_hook(kind, value, tb)

    def wait(predicate: Callable[[], Any], what: str) -> Any:
        while True:
            if errors:
                raise SelfTestFailed(f"the app raised {errors[0]} while waiting for {what}")
            value = predicate()
            if value:
                return value
            if time.monotonic() - start > TIMEOUT_S:
                raise SelfTestFailed(f"no {what} after {TIMEOUT_S:.0f} s")
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            time.sleep(0.01)

    sys.excepthook = hook
    window = MainWindow()
    try:
        window.show()
        seen: dict[str, Any] = {"machine": None, "telemetry": 0}
        window.link.sig_machine.connect(lambda m: seen.update(machine=m.get("label")))
        window.link.sig_telemetry.connect(lambda _: seen.update(telemetry=seen["telemetry"] + 1))
        wait(lambda: window.link.state == CONNECTED, "connection to the engine service")
        wait(lambda: seen["machine"], "machine from the engine")
        wait(lambda: seen["telemetry"] >= 2, "telemetry from the engine")

        for key, title, _ in PAGES:
            try:
                page = window.show_page(key)
            except Exception as e:  # a page that cannot be built (a missing module) fails here
                raise SelfTestFailed(f"the {title} page could not be built: {type(e).__name__}: {e}") from None
            if hasattr(page, "loaded"):
                wait(functools.partial(getattr, page, "loaded"), f"{title} page loading")
            wait(functools.partial(_past, time.monotonic() + 0.3), f"{title} page drawing")
            picture = window.grab()
            if picture.isNull() or not picture.save(str(folder / f"{key}.png"), "PNG"):
                raise SelfTestFailed(f"the {title} page could not be drawn and saved as {folder / key}.png")

        dashboard = window.show_page("dashboard")
        wait(lambda: len(dashboard.chart.data()[0]) >= 1, "sample on the Dashboard's chart")
        exported: list[str] = []
        dashboard.chart.sig_exported.connect(lambda path: exported.append(""))
        dashboard.chart.sig_export_failed.connect(exported.append)
        dashboard.export_csv(folder / CSV_NAME)
        wait(lambda: exported, "CSV export of the Dashboard's chart")
        if exported[0]:
            raise SelfTestFailed(f"the Dashboard's chart was not exported: {exported[0]}")
        rows = _csv_rows(folder / CSV_NAME)
        if errors:
            raise SelfTestFailed(f"the app raised {errors[0]}")
        return (f"engine connected, {seen['machine']}, {seen['telemetry']} telemetry samples, {len(PAGES)} pages "
                f"drawn, {rows} CSV rows")  # fmt: skip
    finally:
        window.link.stop()
        window.hide()
        window.deleteLater()
        app.processEvents()
        sys.excepthook = previous_hook


def _csv_rows(path: Path) -> int:
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or rows[0][:2] != ["time", "unix_time"]:
        raise SelfTestFailed(f"{path} holds no samples")
    return len(rows) - 1
