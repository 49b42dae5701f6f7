"""Visible text that does not fit its widget, found by measuring (no pixels compared).

`clipped_text(root)` walks every visible label, button, check box, group box title, and table/tree header
and cell under `root`, measures its text with the widget's own font (QFontMetrics) and returns one line per
text cut short, plus every visible widget that sticks out of its parent's rect. A label that elides on
purpose (app/widgets/elided_label.py) and a table cell passes only where the whole text is in its tooltip.
Lines read "ClassName#objectName 'text': needs N px, has M px", to name in a failure.
"""

from __future__ import annotations

import re

from PySide6.QtCore import QModelIndex, QRect, Qt
from PySide6.QtGui import QFontMetrics, QTextDocument
from PySide6.QtGui import Qt as QtGui
from PySide6.QtWidgets import (
    QAbstractButton,
    QAbstractItemView,
    QAbstractScrollArea,
    QCheckBox,
    QGroupBox,
    QHeaderView,
    QLabel,
    QPushButton,
    QRadioButton,
    QStyle,
    QTabBar,
    QTableView,
    QToolButton,
    QTreeView,
    QWidget,
)

from rigpilot.app.widgets.elided_label import ElidedLabel

SLACK_PX = 1  # rounding between measuring and drawing
MAX_ROWS = 60  # rows of a table checked: the ones on screen at 1280×800 and then some
_MNEMONIC = re.compile(r"&(?!&)")


def _name(w: QWidget, text: str) -> str:
    short = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(w).__name__}#{w.objectName() or '-'} {short!r}"


def _plain(label: QLabel) -> str:
    text = label.text()
    fmt = label.textFormat()
    if fmt == Qt.TextFormat.RichText or (fmt == Qt.TextFormat.AutoText and QtGui.mightBeRichText(text)):
        doc = QTextDocument()
        doc.setHtml(text)
        return doc.toPlainText()
    return text


def _shown(w: QWidget, root: QWidget) -> bool:
    """On screen within `root`: visible, and not scrolled out of a scroll area's viewport."""
    if not w.isVisibleTo(root) or w.width() <= 0 or w.height() <= 0:
        return False
    parent = w.parentWidget()
    while parent is not None and parent is not root:
        if isinstance(parent.parentWidget(), QAbstractScrollArea) and parent is parent.parentWidget().viewport():
            top_left = w.mapTo(parent, w.rect().topLeft())
            if not parent.rect().intersects(QRect(top_left, w.size())):
                return False
        parent = parent.parentWidget()
    return True


def _indent(label: QLabel, axis: Qt.AlignmentFlag) -> int:
    """The indent QLabel takes from its text's room along `axis`: only on the edge its alignment names (an
    indent of a left-aligned label costs width, never height)."""
    edges = {Qt.AlignmentFlag.AlignHorizontal_Mask: (Qt.AlignmentFlag.AlignLeft, Qt.AlignmentFlag.AlignRight),
             Qt.AlignmentFlag.AlignVertical_Mask: (Qt.AlignmentFlag.AlignTop, Qt.AlignmentFlag.AlignBottom)}[axis]
    align = QStyle.visualAlignment(label.layoutDirection(), label.alignment())
    return max(label.indent(), 0) if any(align & edge for edge in edges) else 0


def _label(label: QLabel) -> str | None:
    if isinstance(label, ElidedLabel):
        full = label.text()
        if label.shown_text() != full and label.toolTip() != full:
            return f"{_name(label, full)}: elided without the whole text in its tooltip"
        return None
    if label.pixmap() is not None and not label.pixmap().isNull():
        return None
    text = _plain(label)
    if label.buddy() is not None:  # "S&how" is drawn "Show", underlined
        text = _MNEMONIC.sub("", text).replace("&&", "&")
    if not text.strip():
        return None
    fm = QFontMetrics(label.font())
    rect = label.contentsRect()
    width = rect.width() - 2 * max(label.margin(), 0) - _indent(label, Qt.AlignmentFlag.AlignHorizontal_Mask)
    height = rect.height() - 2 * max(label.margin(), 0) - _indent(label, Qt.AlignmentFlag.AlignVertical_Mask)
    if label.wordWrap():
        needed = fm.boundingRect(QRect(0, 0, max(width, 1), 100_000), int(Qt.TextFlag.TextWordWrap), text).height()
        if needed > height + SLACK_PX:
            return f"{_name(label, text)}: needs {needed} px high, has {height} px"
        return None
    needed = max(fm.horizontalAdvance(line) for line in text.split("\n"))
    if needed > width + SLACK_PX:
        return f"{_name(label, text)}: needs {needed} px, has {width} px"
    return None


def _button(button: QAbstractButton) -> str | None:
    text = _MNEMONIC.sub("", button.text()).replace("&&", "&")
    if not text.strip() or isinstance(button, QTabBar):
        return None
    if isinstance(button, QToolButton) and button.toolButtonStyle() == Qt.ToolButtonStyle.ToolButtonIconOnly:
        return None
    style = button.style()
    needed = QFontMetrics(button.font()).horizontalAdvance(text)
    if not button.icon().isNull():
        needed += button.iconSize().width() + 4
    if isinstance(button, (QCheckBox, QRadioButton)):
        needed += style.pixelMetric(QStyle.PixelMetric.PM_IndicatorWidth, None, button)
        needed += style.pixelMetric(QStyle.PixelMetric.PM_CheckBoxLabelSpacing, None, button)
    elif isinstance(button, QPushButton):
        needed += 2 * style.pixelMetric(QStyle.PixelMetric.PM_ButtonMargin, None, button) // 2
        if button.menu() is not None:  # the arrow is drawn inside the button, beside the text
            needed += style.pixelMetric(QStyle.PixelMetric.PM_MenuButtonIndicator, None, button)
    width = button.contentsRect().width()
    if needed > width + SLACK_PX:
        return f"{_name(button, text)}: needs {needed} px, has {width} px"
    return None


def _group(box: QGroupBox) -> str | None:
    text = _MNEMONIC.sub("", box.title())
    if not text.strip():
        return None
    needed = QFontMetrics(box.font()).horizontalAdvance(text) + 16  # Fusion's title inset on both sides
    if box.isCheckable():
        needed += box.style().pixelMetric(QStyle.PixelMetric.PM_IndicatorWidth, None, box) + 4
    if needed > box.width() + SLACK_PX:
        return f"{_name(box, text)}: title needs {needed} px, has {box.width()} px"
    return None


def _header(header: QHeaderView, view: QAbstractItemView) -> list[str]:
    model = header.model()
    if model is None or not header.isVisible() or header.orientation() != Qt.Orientation.Horizontal:
        return []
    fm = QFontMetrics(header.font())
    margin = 2 * header.style().pixelMetric(QStyle.PixelMetric.PM_HeaderMargin, None, header)
    out = []
    for col in range(model.columnCount()):
        if header.isSectionHidden(col) or header.sectionViewportPosition(col) >= header.viewport().width():
            continue
        text = str(model.headerData(col, Qt.Orientation.Horizontal, Qt.ItemDataRole.DisplayRole) or "")
        if not text:
            continue
        needed = max(fm.horizontalAdvance(line) for line in text.split("\n")) + margin
        if header.isSortIndicatorShown() and header.sortIndicatorSection() == col:
            needed += header.style().pixelMetric(QStyle.PixelMetric.PM_HeaderMarkSize, None, header)
        if needed > header.sectionSize(col) + SLACK_PX:
            out.append(f"{_name(view, text)}: header needs {needed} px, has {header.sectionSize(col)} px")
    return out


def _cells(view: QAbstractItemView) -> list[str]:
    model = view.model()
    if model is None:
        return []
    fm = QFontMetrics(view.font())
    out = []
    for row in range(min(model.rowCount(), MAX_ROWS)):
        for col in range(model.columnCount()):
            index = model.index(row, col, QModelIndex())
            rect = view.visualRect(index)
            if rect.isEmpty() or not view.viewport().rect().intersects(rect):
                continue
            text = str(index.data(Qt.ItemDataRole.DisplayRole) or "")
            if not text:
                continue
            if isinstance(view, QTableView) and view.wordWrap() and "\n" not in text:
                flags = int(Qt.TextFlag.TextWordWrap)
                needed_h = fm.boundingRect(QRect(0, 0, max(rect.width() - 6, 1), 100_000), flags, text).height()
                fits = needed_h <= rect.height() + SLACK_PX
                need = f"{needed_h} px high, has {rect.height()} px"
            else:
                needed = max(fm.horizontalAdvance(line) for line in text.split("\n")) + 6  # Fusion's cell margins
                icon = index.data(Qt.ItemDataRole.DecorationRole)
                if icon is not None:
                    needed += view.iconSize().width() if view.iconSize().width() > 0 else 16
                fits = needed <= rect.width() + SLACK_PX
                need = f"{needed} px, has {rect.width()} px"
            if not fits and str(index.data(Qt.ItemDataRole.ToolTipRole) or "") != text:
                out.append(f"{_name(view, text)}: cell ({row}, {col}) needs {need}")
    return out


def _outside(w: QWidget) -> str | None:
    """A widget its parent cuts: meant only for layouts; scroll-area contents and item views scroll on purpose."""
    parent = w.parentWidget()
    if parent is None or w.isWindow():
        return None
    grand = parent.parentWidget()
    if isinstance(grand, QAbstractScrollArea) and parent is grand.viewport():
        return None
    if isinstance(parent, (QAbstractScrollArea, QTabBar)) or isinstance(w, QHeaderView):
        return None  # scroll bars, corner widgets and tab scrollers are placed by their owner
    inner = parent.rect().adjusted(-SLACK_PX, -SLACK_PX, SLACK_PX, SLACK_PX)
    if not inner.contains(w.geometry()):
        g = w.geometry()
        return f"{_name(w, '')}: at {g.x()},{g.y()} {g.width()}×{g.height()}, outside its parent's {parent.width()}×{parent.height()}"
    return None


def _inside_graphics(w: QWidget) -> bool:
    """pyqtgraph's own widgets (axes in a GraphicsView) draw their text themselves: the charts' tests cover them."""
    parent = w.parentWidget()
    while parent is not None:
        if type(parent).__module__.startswith("pyqtgraph"):
            return True
        parent = parent.parentWidget()
    return type(w).__module__.startswith("pyqtgraph")


def clipped_text(root: QWidget) -> list[str]:
    """Every text under `root` that is on screen and cut short, and every widget its parent cuts off."""
    problems: list[str] = []
    for w in [root, *root.findChildren(QWidget)]:
        if not _shown(w, root) or _inside_graphics(w):
            continue
        found: list[str | None] = []
        if isinstance(w, QLabel):
            found.append(_label(w))
        elif isinstance(w, QAbstractButton):
            found.append(_button(w))
        elif isinstance(w, QGroupBox):
            found.append(_group(w))
        if isinstance(w, (QTableView, QTreeView)):
            header = w.horizontalHeader() if isinstance(w, QTableView) else w.header()
            problems.extend(_header(header, w))
            problems.extend(_cells(w))
        if w is not root:
            found.append(_outside(w))
        problems.extend(p for p in found if p)
    return problems
