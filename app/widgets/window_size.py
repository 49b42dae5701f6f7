"""How large a new top-level window opens: its design size where the screen has room, else as much as the
screen's free area holds with the window manager's frame (title bar, borders) around it, so that the whole
window, title bar included, is on screen (a 1280×800 laptop with a panel, say).

Qt knows the frame only once the window manager has put it around the mapped window, so the first size
allows for a frame as large as common desktops draw, and `keep_on_screen` corrects it once the real frame
is known, if that is larger.
"""

from __future__ import annotations

from PySide6.QtCore import QMargins, QPoint, QRect, QSize
from PySide6.QtGui import QGuiApplication, QScreen
from PySide6.QtWidgets import QWidget

# The main window's pages are laid out for this client area (two rows of four job charts, for one).
FIRST_SIZE = QSize(1280, 800)
# Title bars are 20 (openbox) to 37 px (GNOME) high; borders 0 to 4 px.
FRAME_GUESS = QMargins(4, 40, 4, 4)
# The smallest screen the first window is made for: screenshots (app/screenshots.py) are taken at the
# size the window opens at there.
SMALL_SCREEN = QSize(1280, 800)
# Platforms that draw into memory: their "screen" (800×600 offscreen) is a stand-in, not a size to fit.
NO_DISPLAY_PLATFORMS = ("offscreen", "minimal")


def fitted(wanted: QSize, available: QRect, frame: QMargins = FRAME_GUESS) -> QSize:
    """`wanted` (a client size), shrunk so that it and `frame` around it fit in `available`."""
    return QSize(
        min(wanted.width(), available.width() - frame.left() - frame.right()),
        min(wanted.height(), available.height() - frame.top() - frame.bottom()),
    )


def first_size(screen: QScreen | None, wanted: QSize = FIRST_SIZE) -> QSize:
    """The client size a window that never had one opens at on `screen`."""
    if screen is None or QGuiApplication.platformName() in NO_DISPLAY_PLATFORMS:
        return QSize(wanted)
    return fitted(wanted, screen.availableGeometry(), FRAME_GUESS)


def small_screen_size(wanted: QSize = FIRST_SIZE) -> QSize:
    """The client size the window opens at on a SMALL_SCREEN without panels."""
    return fitted(wanted, QRect(0, 0, SMALL_SCREEN.width(), SMALL_SCREEN.height()))


def kept_on_screen(frame: QRect, client: QRect, available: QRect, minimum: QSize) -> tuple[QSize, QPoint] | None:
    """The client size and frame position that put a window (`frame` around `client`) within `available`,
    never below `minimum`; None when it is within already."""
    margins = QMargins(client.left() - frame.left(), client.top() - frame.top(),
                       frame.right() - client.right(), frame.bottom() - client.bottom())  # fmt: skip
    if available.contains(frame):
        return None
    size = fitted(client.size(), available, margins).expandedTo(minimum)
    outer = size.grownBy(margins)
    x = max(available.left(), min(frame.left(), available.left() + available.width() - outer.width()))
    y = max(available.top(), min(frame.top(), available.top() + available.height() - outer.height()))
    return size, QPoint(x, y)


def keep_on_screen(window: QWidget) -> None:
    """Shrink and move `window` so that its frame lies within its screen's free area.

    Only where the window manager's frame is known (a window without one is left alone, as is every window
    of a platform that draws into memory), and not for a maximised or full-screen window, which the window
    manager places.
    """
    screen = window.screen()
    if screen is None or QGuiApplication.platformName() in NO_DISPLAY_PLATFORMS:
        return
    if window.isMaximized() or window.isFullScreen() or window.frameGeometry() == window.geometry():
        return
    fix = kept_on_screen(window.frameGeometry(), window.geometry(), screen.availableGeometry(), window.minimumSize())
    if fix is not None:
        size, position = fix
        if size != window.size():
            window.resize(size)
        window.move(position)  # a top-level window's position is its frame's
