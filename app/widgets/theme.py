"""Light and dark: the two palettes the app can force, and "follow the system" (the default).

Everything else reads colours from the QPalette at runtime (style.py, palette.py, the charts), so a theme
is only a palette: `apply_theme` sets one on the application under the Fusion style, which honours every
palette role on every desktop, and the widgets that colour themselves redraw on ApplicationPaletteChange.
"System" follows the desktop's light/dark preference (Qt's colour scheme) and changes with it while the
app runs; where the desktop does not say, the style's own palette is kept.

The colours are chosen for contrast (WCAG ratios, see `contrast_ratio`): text at least 4.5:1 on its
background, muted text at least 4.5:1 too (it carries notes a user must read), and the status colours of
palette.py, drawn as text through `status_text`, at least 3:1 on both themes.
"""

from __future__ import annotations

from typing import Literal

from PySide6.QtCore import QCoreApplication, Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QStyleFactory

Theme = Literal["system", "light", "dark"]
THEMES: tuple[Theme, ...] = ("system", "light", "dark")
THEME_LABELS: dict[Theme, str] = {"system": "System", "light": "Light", "dark": "Dark"}
DEFAULT_THEME: Theme = "system"

_R = QPalette.ColorRole
_G = QPalette.ColorGroup

# (role, active/inactive colour, disabled colour or None for the same)
_LIGHT: list[tuple[QPalette.ColorRole, str, str | None]] = [
    (_R.Window, "#f3f3f3", None),
    (_R.WindowText, "#1f1f1f", "#8a8a8a"),
    (_R.Base, "#ffffff", "#f3f3f3"),
    (_R.AlternateBase, "#f4f6f9", None),
    (_R.ToolTipBase, "#ffffe1", None),
    (_R.ToolTipText, "#1f1f1f", None),
    (_R.PlaceholderText, "#5f6368", "#9a9a9a"),
    (_R.Text, "#1f1f1f", "#8a8a8a"),
    (_R.Button, "#ececec", None),
    (_R.ButtonText, "#1f1f1f", "#8a8a8a"),
    (_R.BrightText, "#c62828", None),
    (_R.Light, "#ffffff", None),
    (_R.Midlight, "#e3e3e3", None),
    (_R.Mid, "#b9b9b9", None),
    (_R.Dark, "#9f9f9f", None),
    (_R.Shadow, "#767676", None),
    (_R.Highlight, "#2f6db0", "#c8c8c8"),
    (_R.HighlightedText, "#ffffff", "#8a8a8a"),
    (_R.Link, "#1a5fa8", None),
    (_R.LinkVisited, "#6a3d9a", None),
    (_R.Accent, "#2f6db0", "#c8c8c8"),
]  # fmt: skip

_DARK: list[tuple[QPalette.ColorRole, str, str | None]] = [
    (_R.Window, "#25282c", None),
    (_R.WindowText, "#e8eaed", "#7c8289"),
    (_R.Base, "#1c1e21", "#25282c"),
    (_R.AlternateBase, "#23262a", None),
    (_R.ToolTipBase, "#33373d", None),
    (_R.ToolTipText, "#e8eaed", None),
    (_R.PlaceholderText, "#a0a6ad", "#6b7178"),
    (_R.Text, "#e8eaed", "#7c8289"),
    (_R.Button, "#31353a", None),
    (_R.ButtonText, "#e8eaed", "#7c8289"),
    (_R.BrightText, "#ff6b6b", None),
    (_R.Light, "#4a4f56", None),
    (_R.Midlight, "#3a3e44", None),
    (_R.Mid, "#2c3035", None),
    (_R.Dark, "#17191c", None),
    (_R.Shadow, "#0c0d0f", None),
    (_R.Highlight, "#3b78c2", "#3a3e44"),
    (_R.HighlightedText, "#ffffff", "#7c8289"),
    (_R.Link, "#7ab4f5", None),
    (_R.LinkVisited, "#c29be8", None),
    (_R.Accent, "#3b78c2", "#3a3e44"),
]  # fmt: skip


def _build(rows: list[tuple[QPalette.ColorRole, str, str | None]]) -> QPalette:
    palette = QPalette()
    for role, normal, disabled in rows:
        for group in (_G.Active, _G.Inactive):
            palette.setColor(group, role, QColor(normal))
        palette.setColor(_G.Disabled, role, QColor(disabled or normal))
    return palette


def light_palette() -> QPalette:
    return _build(_LIGHT)


def dark_palette() -> QPalette:
    return _build(_DARK)


def parse_theme(value: object) -> Theme:
    """A stored value as a theme; anything unknown (an old or hand-edited settings file) follows the system."""
    text = str(value or "").strip().lower()
    for theme in THEMES:
        if text == theme:
            return theme
    return DEFAULT_THEME


def system_is_dark() -> bool | None:
    """The desktop's preference, or None where it does not say (Qt: colour scheme Unknown)."""
    scheme = QGuiApplication.styleHints().colorScheme()
    if scheme == Qt.ColorScheme.Dark:
        return True
    if scheme == Qt.ColorScheme.Light:
        return False
    return None


def palette_for(theme: Theme) -> QPalette | None:
    """The palette a theme means now; None: the style's own (system, and the desktop does not say)."""
    if theme == "light":
        return light_palette()
    if theme == "dark":
        return dark_palette()
    dark = system_is_dark()
    if dark is None:
        return None
    return dark_palette() if dark else light_palette()


class _Follower:
    """Re-applies "system" when the desktop switches between light and dark while the app runs."""

    theme: Theme = DEFAULT_THEME
    connected = False


def apply_theme(app: QCoreApplication | None, theme: Theme) -> None:
    """Fusion with the theme's palette, at once: widgets that colour themselves get ApplicationPaletteChange."""
    if not isinstance(app, QApplication):  # no widgets (a core application): nothing to colour
        return
    if app.style().name().lower() != "fusion":
        style = QStyleFactory.create("Fusion")
        if style is not None:
            app.setStyle(style)
    _Follower.theme = theme
    palette = palette_for(theme)
    app.setPalette(palette if palette is not None else app.style().standardPalette())
    if not _Follower.connected:
        _Follower.connected = True
        QGuiApplication.styleHints().colorSchemeChanged.connect(lambda _scheme: _follow_system(app))


def _follow_system(app: QApplication) -> None:
    if _Follower.theme == "system":
        apply_theme(app, "system")


def current_theme() -> Theme:
    """The theme last applied (what Settings shows)."""
    return _Follower.theme


def relative_luminance(color: QColor) -> float:
    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * channel(color.redF()) + 0.7152 * channel(color.greenF()) + 0.0722 * channel(color.blueF())


def contrast_ratio(a: QColor, b: QColor) -> float:
    """WCAG 2 contrast ratio, 1 (none) to 21 (black on white)."""
    la, lb = relative_luminance(a), relative_luminance(b)
    hi, lo = max(la, lb), min(la, lb)
    return (hi + 0.05) / (lo + 0.05)
