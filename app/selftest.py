"""`rigpilot --self-test`: start the real window offscreen against a real engine and check it works.

Used by the package test after installing the .deb, and useful on a user's
machine when something looks wrong. It passes when the window connects to the
engine service (starting it if needed), shows the machine and receives live
telemetry; it exits 1 naming the first thing that did not happen.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

TIMEOUT_S = 90.0


def main(screenshot: Path | None = None) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from rigpilot.app.engine_link import CONNECTED
    from rigpilot.app.identity import APP_NAME, ORGANIZATION
    from rigpilot.app.main_window import MainWindow

    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName(f"{APP_NAME}-selftest")  # keep the user's window settings out of it
    app.setOrganizationName(ORGANIZATION)
    window = MainWindow()
    window.show()
    seen = {"connected": False, "machine": None, "telemetry": 0}
    window.link.sig_state.connect(lambda state, _: seen.update(connected=seen["connected"] or state == CONNECTED))
    window.link.sig_machine.connect(lambda m: seen.update(machine=m.get("label")))
    window.link.sig_telemetry.connect(lambda _: seen.update(telemetry=seen["telemetry"] + 1))
    start = time.monotonic()
    result = {"rc": 1, "why": ""}

    def check() -> None:
        done = seen["connected"] and seen["machine"] and seen["telemetry"] >= 2
        if done or time.monotonic() - start > TIMEOUT_S:
            if done:
                result["rc"] = 0
            else:
                missing = [k for k in ("connected", "machine", "telemetry") if not seen[k]]
                result["why"] = f"no {', no '.join(missing)} after {TIMEOUT_S:.0f} s"
            if screenshot is not None:
                window.grab().save(str(screenshot))
            window.link.stop()
            window.hide()
            app.quit()

    timer = QTimer(interval=200, timeout=check)
    timer.start()
    app.exec()
    if result["rc"] == 0:
        print(f"self-test passed: engine connected, {seen['machine']}, {seen['telemetry']} telemetry samples "
              f"in {time.monotonic() - start:.1f} s")
    else:
        print(f"self-test failed: {result['why']}", file=sys.stderr)
    return result["rc"]
