"""The look: every icon the app names is shipped and draws in the palette's ink, and the one stylesheet parses and
follows the palette, light and dark. Offscreen and cheap: no engine, no jobs."""

from __future__ import annotations

import ast
from collections.abc import Iterator

import pytest
import shiboken6
from PySide6.QtCore import QSize
from PySide6.QtGui import QColor, QFont, QIcon, QPalette
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QListWidget,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.main_window import PAGES, MainWindow
from rigpilot.app.widgets import icons, style
from rigpilot.app.widgets.palette import ACCENT, BAD, GOOD, WARN, status_text, tint
from rigpilot.resources import path as resource_path

from support.gui_fakes import FakeLink, QtMessages
from support.paths import REPO

LIGHT = {"Window": "#efefef", "Base": "#ffffff", "Text": "#1a1a1a", "WindowText": "#1a1a1a", "Button": "#f2f2f2",
         "ButtonText": "#1a1a1a", "Highlight": "#2f7bc4", "HighlightedText": "#ffffff"}  # fmt: skip
DARK = {"Window": "#2b2b2b", "Base": "#1e1e1e", "Text": "#e6e6e6", "WindowText": "#e6e6e6", "Button": "#353535",
        "ButtonText": "#e6e6e6", "Highlight": "#3d6fa8", "HighlightedText": "#ffffff"}  # fmt: skip


def _palette(colors: dict[str, str]) -> QPalette:
    palette = QPalette()
    for role, value in colors.items():
        palette.setColor(getattr(QPalette.ColorRole, role), QColor(value))
    return palette


@pytest.fixture(params=["light", "dark"])
def theme(request, qapp) -> Iterator[dict[str, str]]:
    """The application palette forced light or dark for one test, the original put back after it."""
    before = QPalette(qapp.palette())
    colors = LIGHT if request.param == "light" else DARK
    qapp.setPalette(_palette(colors))
    try:
        yield colors
    finally:
        qapp.setPalette(before)


def _names_used_in_app() -> set[str]:
    """Every literal icon name in app/: icon("x"), set_icon(w, "x"), and the navigation's page keys."""
    names = {key for key, _, _ in PAGES}
    for source in (REPO / "app").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            index = {"icon": 0, "set_icon": 1}.get(func)
            if index is not None and len(node.args) > index:
                arg = node.args[index]
                if isinstance(arg, ast.Constant):
                    names.add(arg.value)
                else:  # besides icons.py itself, only the navigation names icons by a variable: the page keys
                    assert source.name in ("icons.py", "main_window.py"), f"{source}:{node.lineno}: not a literal"
    return names


def test_every_icon_named_in_the_app_is_shipped_and_every_shipped_icon_is_named():
    used = _names_used_in_app()
    assert used - icons.ICONS.keys() == set(), "icon names used in app/ but missing from icons.ICONS"
    folder = resource_path(icons.FOLDER)
    shipped = {p.stem for p in folder.glob("*.svg")}
    assert set(icons.ICONS.values()) == shipped  # no missing file, and no file shipped for nothing
    assert (folder / "LICENSE").is_file()
    for stem in shipped:
        assert b"currentColor" in (folder / f"{stem}.svg").read_bytes(), stem  # recolourable
    with pytest.raises(KeyError, match="no icon named"):
        icons.icon("no-such-icon")


def _ink(icon: QIcon, mode: QIcon.Mode = QIcon.Mode.Normal) -> set[str]:
    image = icon.pixmap(QSize(24, 24), mode).toImage()
    return {
        image.pixelColor(x, y).name()
        for x in range(image.width())
        for y in range(image.height())
        if image.pixelColor(x, y).alpha() == 255
    }


def test_every_icon_draws_in_the_palette_ink(theme):
    for name in icons.ICONS:
        icon = icons.icon(name)
        assert not icon.isNull() and not icon.pixmap(QSize(16, 16)).isNull(), name
        assert _ink(icon) == {theme["Text"]}, name
    # A navigation row that is selected draws on the highlight, so its icon takes the highlighted text's colour.
    assert _ink(icons.icon("jobs"), QIcon.Mode.Selected) == {theme["HighlightedText"]}


def test_an_icon_follows_a_palette_change_without_being_set_again(qapp):
    button = QPushButton("Launch")
    icons.set_icon(button, "launch")
    before = QPalette(qapp.palette())
    try:
        qapp.setPalette(_palette(LIGHT))
        assert _ink(button.icon()) == {LIGHT["Text"]}
        qapp.setPalette(_palette(DARK))
        assert _ink(button.icon()) == {DARK["Text"]}
    finally:
        qapp.setPalette(before)


def _sample_page() -> QWidget:
    """One of each look the style module gives: a title, a heading, each status, a primary button, a banner, a card
    and the navigation list."""
    page = QWidget()
    layout = QVBoxLayout(page)
    title, section = QLabel("Title"), style.heading("Section")
    style.set_role(title, "title")
    statuses = []
    for status in ("good", "warn", "bad", "info"):
        label = QLabel(status)
        style.set_status(label, status)
        statuses.append(label)
    primary = QPushButton("Plan")
    style.mark_primary(primary)
    banner = QLabel("Simulated machine")
    style.set_banner(banner, "warn")
    card = QWidget()
    style.set_surface(card, "card")
    nav = QListWidget()
    nav.addItem("Dashboard")
    style.style_navigation(nav)
    for w in (title, section, *statuses, primary, banner, card, nav):
        layout.addWidget(w)
    return page


def test_every_look_takes_its_colours_from_the_palette_and_the_navigation_sheet_parses(qtbot, qapp, theme):
    messages = QtMessages()
    messages.install()
    try:
        style.install(qapp)
        page = _sample_page()
        qtbot.addWidget(page)
        page.show()
        page.grab()
    finally:
        messages.uninstall()
    assert not [m for m in messages.messages if "parse" in m.lower() or "stylesheet" in m.lower()], messages.messages
    labels = page.findChildren(QLabel)
    title, section, good, warn, bad, info, banner = labels[:7]
    assert good.palette().color(QPalette.ColorRole.WindowText) == status_text(GOOD, qapp.palette())
    assert info.palette().color(QPalette.ColorRole.WindowText) == status_text(ACCENT, qapp.palette())
    for heading in (title, section):  # headings are larger and heavier than body text
        assert heading.font().pointSizeF() > qapp.font().pointSizeF() and heading.font().weight() >= QFont.Weight.DemiBold
    assert title.font().pointSizeF() > section.font().pointSizeF()
    palette = qapp.palette()
    assert bad.palette().color(QPalette.ColorRole.WindowText) == status_text(BAD, palette) and bad.font().bold()
    assert warn.palette().color(QPalette.ColorRole.WindowText) == status_text(WARN, palette)
    assert banner.palette().color(QPalette.ColorRole.Window) == tint(WARN, palette, style.BANNER_TINT)
    assert banner.palette().color(QPalette.ColorRole.WindowText) == QColor(theme["WindowText"])  # read in the ink
    primary = page.findChild(QPushButton)
    assert primary.palette().color(QPalette.ColorRole.Button) == tint(ACCENT, palette, style.PRIMARY_TINT)
    assert primary.palette().color(QPalette.ColorRole.ButtonText) == QColor(theme["ButtonText"])
    nav = page.findChild(QListWidget)
    assert QColor(theme["Highlight"]).name() in nav.styleSheet()
    style.set_status(bad, None)  # back to plain text
    assert bad.palette().color(QPalette.ColorRole.WindowText) == QColor(theme["WindowText"]) and not bad.font().bold()


def test_a_theme_switch_recolours_what_was_styled_before_it(qtbot, qapp):
    """...and never reaches for a styled widget deleted since (it walked every widget of the app, and crashed on
    one Qt had deleted behind its wrapper)."""
    before = QPalette(qapp.palette())
    style.install(qapp)
    try:
        qapp.setPalette(_palette(LIGHT))
        page = _sample_page()
        qtbot.addWidget(page)
        page.show()
        gone = QLabel("a status on a page that was closed")
        style.set_status(gone, "bad")
        gone.deleteLater()
        qtbot.waitUntil(lambda: not shiboken6.isValid(gone))
        qapp.setPalette(_palette(DARK))
        qapp.processEvents()
        dark = qapp.palette()
        bad = page.findChildren(QLabel)[4]
        assert bad.palette().color(QPalette.ColorRole.WindowText) == status_text(BAD, dark)
        assert page.findChildren(QLabel)[6].palette().color(QPalette.ColorRole.Window) == tint(
            WARN, dark, style.BANNER_TINT
        )
        # A role the style does not set follows the new theme.
        assert bad.palette().color(QPalette.ColorRole.Window) == QColor(DARK["Window"])
        assert DARK["Highlight"] in page.findChild(QListWidget).styleSheet()
    finally:
        qapp.setPalette(before)


def test_a_status_reads_on_both_themes():
    # Yellow on white is unreadable: a status as text is drawn towards the ink, darker on light and lighter on dark.
    for colors, darker in ((LIGHT, True), (DARK, False)):
        palette = _palette(colors)
        text, base = status_text(BAD, palette), palette.color(QPalette.ColorRole.Base)
        assert (text.lightness() < BAD.lightness()) == darker
        assert abs(text.lightness() - base.lightness()) > 100


def test_the_navigation_rows_and_the_new_job_button_have_icons(qtbot):
    window = MainWindow(FakeLink("1x-rtx4090"))
    qtbot.addWidget(window)
    for row in range(window.nav.count()):
        assert not window.nav.item(row).icon().isNull(), window.nav.item(row).text()
    assert not window.new_job_action.icon().isNull()
    assert window.new_job_button.property("primary") is True
    # No application-wide stylesheet: it would route every widget through Qt's slow stylesheet style.
    assert QApplication.instance().styleSheet() == ""
    window.close()
