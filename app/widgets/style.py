"""The app's one stylesheet: spacing, type and status colours, built from the palette of the moment.

Every colour comes from the QPalette at runtime (the system's, or the light or dark one
Settings forces) or from palette.py's status colours blended into it; nothing here names a
theme. `install` applies the sheet once at start-up and again whenever the application
palette changes, so a theme switch restyles every page without a restart.

Pages ask for a look by meaning, never by colour: `mark_primary(button)` for the one action a
page is for, `set_status(label, "bad")` for a status line, `set_role(label, "section")` for a
heading. The selectors below are the only place those meanings become colours and sizes.
"""

from __future__ import annotations

from typing import Literal

from PySide6.QtCore import QEvent, QObject
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication, QLabel, QWidget

from rigpilot.app.widgets.palette import ACCENT, BAD, GOOD, WARN, blend, status_text, tint

Status = Literal["good", "warn", "bad", "info"]
Role = Literal["title", "section", "muted"]
STATUS_COLORS: dict[str, QColor] = {"good": GOOD, "warn": WARN, "bad": BAD, "info": ACCENT}

# Spacing and size tokens (pixels), and type steps (times the application font's size).
GAP = 6  # inside a control: between its text and its border
PAD = 10  # around a group of controls
RADIUS = 5
CARD_RADIUS = 7
NAV_ROW = 7  # vertical padding of a navigation row
TITLE_SCALE = 1.35
SECTION_SCALE = 1.08


def _hex(color: QColor) -> str:
    return color.name()


def stylesheet(palette: QPalette, point_size: float) -> str:
    """The QSS for `palette`, with type sized from the application font's `point_size`."""
    role = QPalette.ColorRole
    window = palette.color(role.Window)
    base = palette.color(role.Base)
    text = palette.color(role.Text)
    disabled = palette.color(QPalette.ColorGroup.Disabled, role.Text)
    highlight = palette.color(role.Highlight)
    on_highlight = palette.color(role.HighlightedText)
    border = blend(text, window, 0.22)
    faint_border = blend(text, window, 0.12)
    rail = blend(text, window, 0.04)
    header = blend(text, base, 0.06)
    hover = tint(ACCENT, palette, 0.14)
    pressed = tint(ACCENT, palette, 0.28)
    primary = tint(ACCENT, palette, 0.30)
    primary_hover = tint(ACCENT, palette, 0.42)
    title_pt = point_size * TITLE_SCALE
    section_pt = point_size * SECTION_SCALE
    banners = {
        "simulatedBanner": WARN,
        "engineGoneBanner": BAD,
        "noticeBar": ACCENT,
    }
    rules = [
        # -- navigation rail ----------------------------------------------------------------------------------
        f"#navigationRail {{ background: {_hex(rail)}; border-right: 1px solid {_hex(faint_border)}; }}",
        "QListWidget#navigation { background: transparent; border: none; outline: 0; }",
        f"QListWidget#navigation::item {{ padding: {NAV_ROW}px {GAP}px; border-radius: {RADIUS}px; margin: 1px 0; "
        f"color: {_hex(text)}; }}",
        f"QListWidget#navigation::item:hover {{ background: {_hex(hover)}; }}",
        f"QListWidget#navigation::item:selected {{ background: {_hex(highlight)}; color: {_hex(on_highlight)}; }}",
        # -- buttons ------------------------------------------------------------------------------------------
        f"QPushButton {{ padding: 4px {PAD}px; border: 1px solid {_hex(border)}; border-radius: {RADIUS}px; "
        f"background: {_hex(palette.color(role.Button))}; color: {_hex(palette.color(role.ButtonText))}; }}",
        f"QPushButton:hover {{ background: {_hex(hover)}; }}",
        f"QPushButton:pressed, QPushButton:checked {{ background: {_hex(pressed)}; }}",
        f"QPushButton:focus {{ border-color: {_hex(ACCENT)}; }}",
        f"QPushButton:disabled {{ color: {_hex(disabled)}; border-color: {_hex(faint_border)}; "
        f"background: {_hex(window)}; }}",
        "QPushButton::menu-indicator { subcontrol-position: right center; subcontrol-origin: padding; right: 4px; }",
        # The one action a page is for: an accent fill that keeps the palette's ink, so its icon matches.
        # A dialog's default button (the wizard's Next, Finish) is its primary action too.
        f'QPushButton[primary="true"], QToolButton[primary="true"], QPushButton:default {{ '
        f"background: {_hex(primary)}; border: 1px solid {_hex(ACCENT)}; font-weight: 600; }}",
        f'QPushButton[primary="true"]:hover, QToolButton[primary="true"]:hover, QPushButton:default:hover {{ '
        f"background: {_hex(primary_hover)}; }}",
        f'QPushButton[primary="true"]:disabled, QPushButton:default:disabled {{ background: {_hex(window)}; '
        f"border-color: {_hex(faint_border)}; }}",
        f'QToolButton[primary="true"] {{ padding: 5px {GAP}px; border-radius: {RADIUS}px; margin: 0 0 2px 0; }}',
        # -- sections, cards, tabs ----------------------------------------------------------------------------
        f"QGroupBox {{ border: 1px solid {_hex(faint_border)}; border-radius: {CARD_RADIUS}px; margin-top: 1.3em; "
        f"padding-top: 4px; }}",
        f"QGroupBox::title {{ subcontrol-origin: margin; subcontrol-position: top left; left: {PAD}px; "
        f"padding: 0 4px; font-weight: 600; font-size: {section_pt:.1f}pt; }}",
        f"GpuCard, HostPanel {{ border: 1px solid {_hex(faint_border)}; border-radius: {CARD_RADIUS}px; "
        f"background: {_hex(base)}; }}",
        f"QTabWidget::pane {{ border: 1px solid {_hex(faint_border)}; border-radius: {RADIUS}px; top: -1px; }}",
        f"QTabBar::tab {{ padding: 5px {PAD + 2}px; border: none; border-bottom: 2px solid transparent; "
        f"background: transparent; color: {_hex(text)}; }}",
        f"QTabBar::tab:hover {{ background: {_hex(hover)}; }}",
        f"QTabBar::tab:selected {{ border-bottom: 2px solid {_hex(ACCENT)}; }}",
        f"QTabBar::tab:disabled {{ color: {_hex(disabled)}; }}",
        # -- tables -------------------------------------------------------------------------------------------
        f"QTableView, QTreeView {{ gridline-color: {_hex(faint_border)}; border: 1px solid {_hex(faint_border)}; "
        f"border-radius: {RADIUS}px; }}",
        f"QHeaderView::section {{ background: {_hex(header)}; padding: 3px {GAP}px; border: none; "
        f"border-right: 1px solid {_hex(faint_border)}; border-bottom: 1px solid {_hex(border)}; font-weight: 600; }}",
        # -- type ---------------------------------------------------------------------------------------------
        f'QLabel[role="title"] {{ font-size: {title_pt:.1f}pt; font-weight: 600; }}',
        f'QLabel[role="section"] {{ font-size: {section_pt:.1f}pt; font-weight: 600; }}',
        f'QLabel[role="muted"] {{ color: {_hex(palette.color(role.PlaceholderText))}; }}',
        # -- status -------------------------------------------------------------------------------------------
        *(
            f'QLabel[status="{name}"], QCheckBox[status="{name}"] {{ color: {_hex(status_text(c, palette))}; }}'
            for name, c in STATUS_COLORS.items()
        ),
        'QLabel[status="bad"] { font-weight: 600; }',
        # Window-wide banners: the status colour faded into the window, read in the palette's ink.
        *(
            f"#{name} {{ background: {_hex(tint(c, palette, 0.30))}; color: {_hex(text)}; "
            f"border-bottom: 1px solid {_hex(tint(c, palette, 0.6))}; }}"
            for name, c in banners.items()
        ),
        f"#simulatedBanner, #engineGoneBanner {{ padding: {GAP}px {PAD}px; font-weight: 600; }}",
        "#engineNotice { background: transparent; }",
        # A warning inside a page (the evaluation loss rising): a box in the warning colour, not coloured text.
        f"#evalWarning {{ background: {_hex(tint(WARN, palette, 0.30))}; color: {_hex(text)}; "
        f"border: 1px solid {_hex(tint(WARN, palette, 0.6))}; border-radius: {RADIUS}px; padding: 4px 8px; }}",
        f"#failurePanel {{ background: {_hex(tint(BAD, palette, 0.18))}; border: 1px solid "
        f"{_hex(tint(BAD, palette, 0.5))}; border-radius: {CARD_RADIUS}px; }}",
    ]
    return "\n".join(rules) + "\n"


class _Restyler(QObject):
    """Builds the sheet again when the application palette changes (a theme switch)."""

    def __init__(self, app: QApplication):
        super().__init__(app)
        self._app = app
        self._applying = False

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self._app and event.type() == QEvent.Type.ApplicationPaletteChange and not self._applying:
            self.apply()
        return False

    def apply(self) -> None:
        self._applying = True  # setting a sheet can itself post palette events
        try:
            self._app.setStyleSheet(stylesheet(self._app.palette(), self._app.font().pointSizeF()))
        finally:
            self._applying = False


def install(app: QApplication) -> None:
    """Style `app` now and after every palette change; call once, before the first window is built."""
    if app.property("rigpilotStyled"):
        return
    app.setProperty("rigpilotStyled", True)
    restyler = _Restyler(app)
    app.installEventFilter(restyler)
    restyler.apply()


def _repolish(widget: QWidget) -> None:
    # A dynamic property takes effect in the sheet only once the widget is polished again.
    style = widget.style()
    style.unpolish(widget)
    style.polish(widget)
    widget.update()


def set_status(widget: QWidget, status: Status | None) -> None:
    """Colour `widget`'s text as a status ("good", "warn", "bad", "info"), or back to plain text with None."""
    if widget.property("status") == status:
        return
    widget.setProperty("status", status)
    _repolish(widget)


def set_role(widget: QWidget, role: Role) -> None:
    """Type `widget` as a page title, a section heading or a muted note."""
    widget.setProperty("role", role)
    _repolish(widget)


def mark_primary(button: QWidget) -> None:
    """Style `button` as the main action of its page."""
    button.setProperty("primary", True)
    _repolish(button)


def heading(text: str, role: Role = "section") -> QLabel:
    """A label that heads a part of a page (a section, or the page's title)."""
    label = QLabel(text)
    set_role(label, role)
    return label
