"""The `nvidia-smi topo -m` matrix as a colour-coded table, its legend, and the measured-bandwidth heat map."""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QBrush, QColor, QPalette, QPixmap
from PySide6.QtWidgets import (
    QAbstractItemView,
    QAbstractScrollArea,
    QGridLayout,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QWidget,
)

from rigpilot.app.doctor.model import LinkMark
from rigpilot.app.topology.model import Matrix, code_category
from rigpilot.app.widgets.palette import ACCENT, BAD, GOOD, WARN, blend, tint
from rigpilot.engine.hardware.machine import PCIE_LEGEND

# From the fastest path to the slowest: NVLink, a PCIe switch, one host bridge (PHB), host bridges of one NUMA
# node (NODE, a step slower than PHB: own colour, between PHB's and SYS's), across CPU sockets (SYS).
CATEGORY_COLOR = {"nvlink": GOOD, "switch": ACCENT, "bridge": WARN, "node": blend(WARN, BAD, 0.5), "sys": BAD}


BROKEN_TINT = 0.75  # a link the machine check found broken: the fail colour, stronger than a slow link's
CODE_ROLE = Qt.ItemDataRole.UserRole + 1  # a cell's `topo -m` code, whatever else its text shows


def _gpu_of(name: str) -> int | None:
    """The GPU index of a matrix row or column ("GPU3"), or None for a NIC or an affinity column."""
    return int(name[3:]) if name.startswith("GPU") and name[3:].isdigit() else None


def _read_only(table: QTableWidget) -> None:
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setTabKeyNavigation(False)  # Tab leaves the table, as everywhere else on the page
    table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    table.setSizeAdjustPolicy(QAbstractScrollArea.SizeAdjustPolicy.AdjustToContents)


class TopoMatrixTable(QTableWidget):
    """Cells hold exactly the `topo -m` codes; colours follow the link class and the palette."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("topoMatrix")
        self.setAccessibleName("Topology matrix in nvidia-smi topo -m notation")
        _read_only(self)
        self._matrix: Matrix | None = None
        self._marks: dict[tuple[int, int], LinkMark] = {}

    def show_matrix(self, matrix: Matrix) -> None:
        self._matrix = matrix
        self._fill()

    def set_link_marks(self, marks: dict[tuple[int, int], LinkMark]) -> None:
        """The machine check's figure on each GPU pair's cell, and its broken links in the fail colour."""
        self._marks = dict(marks)
        self._fill()

    def _pair(self, row: int, column: int) -> tuple[int, int] | None:
        assert self._matrix is not None
        a, b = (_gpu_of(name) for name in (self._matrix.rows[row], self._matrix.headers[column]))
        return None if a is None or b is None or a == b else (min(a, b), max(a, b))

    def _fill(self) -> None:
        matrix = self._matrix
        if matrix is None:
            return
        self.clear()
        self.setRowCount(len(matrix.rows))
        self.setColumnCount(len(matrix.headers))
        self.setHorizontalHeaderLabels(matrix.headers)
        self.setVerticalHeaderLabels(matrix.rows)
        for r, row in enumerate(matrix.cells):
            for c, code in enumerate(row):
                pair = self._pair(r, c)
                mark = self._marks.get(pair) if pair else None
                item = QTableWidgetItem(f"{code}\n{mark.text}" if mark else code)
                item.setData(CODE_ROLE, code)
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                self.setItem(r, c, item)
        self._colour()

    def _colour(self) -> None:
        if self._matrix is None:
            return
        pal = self.palette()
        for r in range(self.rowCount()):
            for c in range(self.columnCount()):
                item = self.item(r, c)
                if item is None:
                    continue
                code = self.code(r, c)
                pair = self._pair(r, c)
                mark = self._marks.get(pair) if pair else None
                broken = mark is not None and mark.broken
                # Stronger than SYS's own red tint: a broken link must stand out among slow ones.
                color = BAD if broken else CATEGORY_COLOR.get(code_category(code))
                item.setBackground(QBrush(tint(color, pal, BROKEN_TINT if broken else 0.35)) if color else QBrush())
                font = item.font()
                font.setBold(broken)
                item.setFont(font)
                legend = PCIE_LEGEND["NV#"].replace("#", code[2:]) if code.startswith("NV") else PCIE_LEGEND.get(code, "")
                item.setToolTip("\n".join(t for t in (mark.tooltip if mark else "", legend) if t))

    def code(self, row: int, column: int) -> str:
        """The `topo -m` code of a cell (without the machine check's figure under it)."""
        item = self.item(row, column)
        return str(item.data(CODE_ROLE) or "") if item else ""

    def mark(self, row: int, column: int) -> LinkMark | None:
        pair = self._pair(row, column) if self._matrix is not None else None
        return self._marks.get(pair) if pair else None

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._colour()


class TopoLegend(QWidget):
    """What each code means, with the colour it has in the matrix."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("topoLegend")
        self._grid = QGridLayout(self)
        self._grid.setContentsMargins(0, 0, 0, 0)
        self._grid.setColumnStretch(2, 1)
        self._swatches: list[tuple[QLabel, str]] = []
        for row, (code, text) in enumerate(PCIE_LEGEND.items()):
            swatch = QLabel()
            self._swatches.append((swatch, code_category(code)))  # "NV#" reads as NVLink
            self._grid.addWidget(swatch, row, 0)
            self._grid.addWidget(QLabel(f"<b>{code}</b>"), row, 1)
            label = QLabel(text)
            label.setWordWrap(True)
            self._grid.addWidget(label, row, 2)
        self._colour()

    def _colour(self) -> None:
        pal = self.palette()
        for swatch, category in self._swatches:
            pixmap = QPixmap(14, 14)
            color = CATEGORY_COLOR.get(category)
            pixmap.fill(tint(color, pal) if color else pal.color(QPalette.ColorRole.Base))
            swatch.setPixmap(pixmap)

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._colour()


class BandwidthHeatMap(QTableWidget):
    """Measured GPU-to-GPU bandwidth (GB/s): faint for slow pairs, strong for fast ones."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("bandwidthHeatMap")
        self.setAccessibleName("Measured bandwidth between GPUs")
        _read_only(self)
        self._values: dict[tuple[int, int], float] = {}
        self._gpus: list[int] = []

    def show_values(self, gpus: list[int], values: dict[tuple[int, int], float]) -> None:
        self._gpus, self._values = list(gpus), dict(values)
        self.clear()
        self.setRowCount(len(gpus))
        self.setColumnCount(len(gpus))
        labels = [f"GPU{i}" for i in gpus]
        self.setHorizontalHeaderLabels(labels)
        self.setVerticalHeaderLabels(labels)
        for r, a in enumerate(gpus):
            for c, b in enumerate(gpus):
                v = values.get((min(a, b), max(a, b)))
                text = "X" if a == b else ("" if v is None else f"{v:.1f}")
                item = QTableWidgetItem(text)
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                item.setToolTip("" if v is None else f"GPU {a} ↔ GPU {b}: {v:.1f} GB/s measured")
                self.setItem(r, c, item)
        self._colour()

    def _colour(self) -> None:
        if not self._values:
            return
        pal = self.palette()
        top = max(self._values.values())
        for r, a in enumerate(self._gpus):
            for c, b in enumerate(self._gpus):
                v = self._values.get((min(a, b), max(a, b)))
                item = self.item(r, c)
                if item is not None and v is not None:
                    share = v / top
                    hue = blend(GOOD, BAD, share) if share < 1 else QColor(GOOD)
                    item.setBackground(QBrush(tint(hue, pal, 0.2 + 0.6 * share)))

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._colour()
