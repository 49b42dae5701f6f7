"""The app's icons, by what they mean: Lucide line icons (ISC; resources/ui-icons/LICENSE) drawn in the palette's ink.

Lucide's SVGs stroke with `currentColor`. Each icon is drawn when it is painted, with
`currentColor` set from the application palette of that moment: Text for a normal
icon, the disabled Text for a disabled one and HighlightedText for a selected one (a
navigation row). So an icon is right in a light and a dark theme and follows a palette
change without any widget setting its icons again.

Names mean an action or a place ("launch", "jobs"), not a picture: which picture
stands for which meaning is decided once, in ICONS, so one action looks the same on
every page. tests/gui/test_look.py checks that every name used in app/ is here and
that every file is shipped. To add one: copy its SVG from the lucide-static npm package's icons/ folder (the
version in the SVG's first line) into resources/ui-icons, and name it here; one Lucide took from Feather (its
LICENSE lists them) is listed in the .deb's copyright file by itself (packaging/debcopyright.py).
"""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QRect, QSize, Qt
from PySide6.QtGui import QColor, QIcon, QIconEngine, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer
from PySide6.QtWidgets import QAbstractButton, QApplication

from rigpilot.resources import path as resource_path

FOLDER = "ui-icons"

# meaning -> Lucide icon (file name without .svg)
ICONS: dict[str, str] = {
    # navigation
    "dashboard": "gauge",
    "topology": "network",
    "planner": "calculator",
    "jobs": "list-checks",
    "serving": "server",
    "settings": "settings",
    "new-job": "plus",
    # actions
    "plan": "calculator",
    "launch": "rocket",
    "serve": "server",
    "cancel": "circle-stop",
    "resume": "play",
    "run": "play",
    "pause": "pause",
    "delete": "trash-2",
    "open-folder": "folder-open",
    "copy": "copy",
    "clone": "copy-plus",
    "rename": "pencil",
    "import": "import",
    "export": "download",
    "image": "image",
    "refresh": "refresh-cw",
    "save": "save",
    "revert": "undo-2",
    "add": "plus",
    "remove": "minus",
    "search": "search",
    "scale": "chart-line",
    "restart": "rotate-ccw",
    "repair": "wrench",
    "dismiss": "x",
    "back": "arrow-left",
    "log": "file-text",
    "check-machine": "gauge",  # measuring the GPUs and their links
}

_svgs: dict[str, bytes] = {}
_pixmaps: dict[tuple[str, int, int, int], QPixmap] = {}
_PIXMAP_CACHE_LIMIT = 512  # sizes x modes x palettes seen; a theme switch or two stays well under it


def svg(name: str) -> bytes:
    """The SVG text of the icon for `name`; KeyError for a name not in ICONS."""
    data = _svgs.get(name)
    if data is None:
        data = _svgs[name] = resource_path(FOLDER, f"{ICONS[name]}.svg").read_bytes()
    return data


def ink(mode: QIcon.Mode, palette: QPalette | None = None) -> QColor:
    """The colour an icon in `mode` is drawn in: the palette's text colour for that state."""
    pal = palette or QApplication.palette()
    if mode == QIcon.Mode.Disabled:
        return pal.color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text)
    if mode == QIcon.Mode.Selected:
        return pal.color(QPalette.ColorGroup.Active, QPalette.ColorRole.HighlightedText)
    return pal.color(QPalette.ColorGroup.Active, QPalette.ColorRole.Text)


def render(name: str, size: QSize, color: QColor) -> QPixmap:
    """The icon for `name` at `size` (device pixels), stroked in `color`."""
    key = (name, size.width(), size.height(), color.rgba())
    pixmap = _pixmaps.get(key)
    if pixmap is None:
        if len(_pixmaps) >= _PIXMAP_CACHE_LIMIT:
            _pixmaps.clear()
        pixmap = QPixmap(size)
        pixmap.fill(Qt.GlobalColor.transparent)
        renderer = QSvgRenderer(QByteArray(svg(name).replace(b"currentColor", color.name().encode())))
        painter = QPainter(pixmap)
        renderer.render(painter)
        painter.end()
        _pixmaps[key] = pixmap
    return pixmap


class _PaletteIconEngine(QIconEngine):
    """Draws one named icon in the ink of the palette current when it is painted."""

    def __init__(self, name: str):
        super().__init__()
        self._name = name

    def pixmap(self, size: QSize, mode: QIcon.Mode, state: QIcon.State) -> QPixmap:
        return render(self._name, size, ink(mode))

    def scaledPixmap(self, size: QSize, mode: QIcon.Mode, state: QIcon.State, scale: float) -> QPixmap:
        pixmap = render(self._name, size * scale, ink(mode))
        pixmap.setDevicePixelRatio(scale)
        return pixmap

    def paint(self, painter: QPainter, rect: QRect, mode: QIcon.Mode, state: QIcon.State) -> None:
        scale = painter.device().devicePixelRatioF() if painter.device() is not None else 1.0
        painter.drawPixmap(rect, self.scaledPixmap(rect.size(), mode, state, scale))

    def clone(self) -> QIconEngine:
        return _PaletteIconEngine(self._name)

    def key(self) -> str:
        return "rigpilot-palette-svg"

    def iconName(self) -> str:
        return self._name

    def isNull(self) -> bool:
        return False


def icon(name: str) -> QIcon:
    """The icon for `name` (a key of ICONS), in the palette's ink whenever it is drawn."""
    if name not in ICONS:
        raise KeyError(f"no icon named {name!r} (app/widgets/icons.py ICONS)")
    return QIcon(_PaletteIconEngine(name))


def prerender(button: QAbstractButton) -> None:
    """Render the pixmaps `button`'s paints take, enabled and disabled, into the cache now.

    An icon is rendered from its SVG the first time it is painted at a size and in a colour (half a
    millisecond to a few each): a page with a row of buttons paid for all of them in its first paint
    (benchmarks/gui_job_open.py). Called at idle, one button a turn, the first paint finds them ready.
    """
    ic = button.icon()
    if ic.isNull():
        return
    for mode in (QIcon.Mode.Normal, QIcon.Mode.Disabled):
        ic.pixmap(button.iconSize(), button.devicePixelRatioF(), mode)


def set_icon(button: QAbstractButton, name: str) -> None:
    """Give `button` the icon for `name`."""
    button.setIcon(icon(name))
