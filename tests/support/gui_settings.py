"""The Settings page, loaded."""

from __future__ import annotations

from rigpilot.app.settings.page import SettingsPage

from support.gui_fakes import FakeLink


def open_page(qtbot) -> SettingsPage:
    page = SettingsPage(FakeLink("1x-rtx4090"))
    qtbot.addWidget(page)
    page.resize(900, 800)
    with qtbot.waitSignal(page.sig_loaded, timeout=10000):
        page.show()
    return page
