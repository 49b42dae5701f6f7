"""The app's look in one place: type, spacing and status colours, built from the palette of the moment.

Pages ask for a look by meaning, never by colour: `mark_primary(button)` for the one action a
page is for, `set_status(label, "bad")` for a status line, `set_banner(frame, "warn")` for a
box that warns, `heading(text)` for a section. This module alone turns those meanings into
colours, from the QPalette at runtime (the system's, or the light or dark one Settings forces)
and palette.py's status colours blended into it; nothing names a theme. `install` makes every
such widget follow a change of the application palette.

NOTE: no application-wide Qt stylesheet. One routes every widget of the app through
QStyleSheetStyle, which doubled the CPU time to build a page before any rule of ours (the
Planner 54 -> 110 ms, the dashboard and planner GUI tests 15 -> 23 s) and would cost the same
on every job page opened. So the look is set where it means something: palettes and fonts on the
few widgets that carry a meaning, and one small stylesheet on the navigation list, which alone
pays for it. The rest keeps the platform style (Fusion), already consistent across pages.
"""

from __future__ import annotations

import weakref
from typing import Literal

import shiboken6
from PySide6.QtCore import QEvent
from PySide6.QtGui import QColor, QFont, QPalette
from PySide6.QtWidgets import QApplication, QLabel, QListWidget, QWidget

from rigpilot.app.widgets.palette import ACCENT, BAD, GOOD, WARN, blend, status_text, tint

Status = Literal["good", "warn", "bad", "info"]
Role = Literal["title", "section", "muted"]
Surface = Literal["rail", "card"]
STATUS_COLORS: dict[str, QColor] = {"good": GOOD, "warn": WARN, "bad": BAD, "info": ACCENT}

# Spacing and size tokens (pixels), and type steps (times the application font's size).
GAP = 6  # inside a control: between its text and its edge
RADIUS = 5
NAV_ROW = 7  # vertical padding of a navigation row
BANNER_MARGIN = 6
TITLE_SCALE = 1.35
SECTION_SCALE = 1.08
BANNER_TINT = 0.30  # how much of the status colour a banner's background takes
PRIMARY_TINT = 0.32  # and a primary button's

# The dynamic properties that say what a widget is; `restyle` reads them back on a palette change.
_PROPERTIES = ("status", "primary", "banner", "surface", "navigation")


def navigation_sheet(palette: QPalette) -> str:
    """The navigation list's stylesheet: roomy rows, a rounded highlight for the page shown, a hover tint."""
    text = palette.color(QPalette.ColorRole.Text)
    return "\n".join([
        "QListWidget { background: transparent; border: none; outline: 0; }",
        f"QListWidget::item {{ padding: {NAV_ROW}px {GAP}px; border-radius: {RADIUS}px; margin: 1px 0; "
        f"color: {text.name()}; }}",
        f"QListWidget::item:hover {{ background: {tint(ACCENT, palette, 0.14).name()}; }}",
        f"QListWidget::item:selected {{ background: {palette.color(QPalette.ColorRole.Highlight).name()}; "
        f"color: {palette.color(QPalette.ColorRole.HighlightedText).name()}; }}",
    ])  # fmt: skip


def _colours(widget: QWidget, palette: QPalette) -> QPalette | None:
    """The roles `widget` sets itself for what it is, on top of those it inherits; None when it sets none."""
    role = QPalette.ColorRole
    own = QPalette()  # a role set here overrides the inherited one; every other role still follows the app
    status, banner, surface = widget.property("status"), widget.property("banner"), widget.property("surface")
    if status in STATUS_COLORS:
        ink = status_text(STATUS_COLORS[status], palette)
        own.setColor(role.WindowText, ink)
        own.setColor(role.Text, ink)
    elif banner in STATUS_COLORS:
        own.setColor(role.Window, tint(STATUS_COLORS[banner], palette, BANNER_TINT))
    elif surface == "rail":
        own.setColor(role.Window, blend(palette.color(role.Text), palette.color(role.Window), 0.04))
    elif surface == "card":
        own.setColor(role.Window, palette.color(role.Base))
    elif widget.property("primary"):
        own.setColor(role.Button, tint(ACCENT, palette, PRIMARY_TINT))
    else:
        return None
    return own


# The widgets given a look here, by id: a palette change restyles these alone. Not QApplication.allWidgets(),
# whose wrappers of widgets Qt made itself can outlive them (a scroll bar, a popup, deleted in C++ unseen by
# shiboken), so touching them after a page changed crashed the app (a segfault in a theme switch).
# Weak: a widget nothing else keeps is still let go.
_styled: dict[int, weakref.ref[QWidget]] = {}


def _keep(widget: QWidget) -> None:
    key = id(widget)
    known = _styled.get(key)
    if known is None or known() is not widget:  # an id is reused once its object is gone
        ref = _styled[key] = weakref.ref(widget)
        widget.destroyed.connect(lambda *_: _styled.get(key) is ref and _styled.pop(key))


def restyle(widget: QWidget, palette: QPalette | None = None) -> None:
    """Give `widget` the colours of what it is (its properties), from `palette` or the application's."""
    _keep(widget)
    pal = palette or QApplication.palette()
    if widget.property("navigation"):
        widget.setStyleSheet(navigation_sheet(pal))
        return
    own = _colours(widget, pal)
    if own is not None:
        widget.setPalette(own)


class _Restyler(QWidget):
    """Never shown: told of every application palette change (a theme switch), like every widget, it gives the
    styled widgets their colours again. Not an event filter on the application, which would see every event of the
    app go through Python."""

    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            palette = QApplication.palette()
            for ref in list(_styled.values()):
                widget = ref()
                if widget is not None and shiboken6.isValid(widget) and any(widget.property(n) for n in _PROPERTIES):
                    restyle(widget, palette)
        super().changeEvent(event)


_restyler: list[_Restyler] = []  # the one per application, kept alive here


def install(app: QApplication) -> None:
    """Make the styled widgets follow palette changes; once per application (later calls do nothing)."""
    if app.property("rigpilotStyled"):
        return
    app.setProperty("rigpilotStyled", True)
    _restyler.append(_Restyler())


def set_status(widget: QWidget, status: Status | None) -> None:
    """Colour `widget`'s text as a status ("good", "warn", "bad", "info"), or back to plain text with None; a
    problem ("bad") is also bold."""
    if widget.property("status") == status:
        return
    widget.setProperty("status", status)
    _keep(widget)
    font = QFont(widget.font())
    font.setBold(status == "bad")
    widget.setFont(font)
    own = _colours(widget, QApplication.palette())
    widget.setPalette(own if own is not None else QPalette())


def set_banner(widget: QWidget, status: Status) -> None:
    """Make `widget` a box in the status colour, faded into the window, read in the palette's ink."""
    widget.setProperty("banner", status)
    widget.setAutoFillBackground(True)
    if isinstance(widget, QLabel):
        widget.setMargin(BANNER_MARGIN)
    restyle(widget)


def set_surface(widget: QWidget, surface: Surface) -> None:
    """Give `widget` a background of its own: the navigation rail, or a card (the Base colour, as a sheet of paper)."""
    widget.setProperty("surface", surface)
    widget.setAutoFillBackground(True)
    restyle(widget)


def style_navigation(nav: QListWidget) -> None:
    """The look of the navigation list (see navigation_sheet)."""
    nav.setProperty("navigation", True)
    restyle(nav)


def set_role(widget: QWidget, role: Role) -> None:
    """Type `widget` as a page title, a section heading or a muted note."""
    widget.setProperty("role", role)
    font = QFont(widget.font())
    if role in ("title", "section"):
        base = QApplication.font().pointSizeF()
        font.setPointSizeF(base * (TITLE_SCALE if role == "title" else SECTION_SCALE))
        font.setWeight(QFont.Weight.DemiBold)
        widget.setFont(font)
    else:
        widget.setForegroundRole(QPalette.ColorRole.PlaceholderText)


def heading(text: str, role: Role = "section") -> QLabel:
    """A label that heads a part of a page (a section, or the page's title)."""
    label = QLabel(text)
    set_role(label, role)
    return label


def mark_primary(button: QWidget) -> None:
    """Style `button` as the main action of its page: an accent fill that keeps the palette's ink (so its icon
    matches), and bold words."""
    button.setProperty("primary", True)
    font = QFont(button.font())
    font.setBold(True)
    button.setFont(font)
    restyle(button)
