"""The drawn topology: NUMA boxes with their CPU, host bridges, PCIe switches, GPUs and NVLink edges.

Clicking a GPU (or Space on the focused one; arrows move the focus) toggles
its selection; `sig_gpus_selected` carries the selected indices.
"""

from __future__ import annotations

import math
from typing import Any

from PySide6.QtCore import QEvent, QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QKeyEvent, QPainter, QPainterPath, QPalette, QPen, QResizeEvent
from PySide6.QtWidgets import (
    QGraphicsPathItem,
    QGraphicsRectItem,
    QGraphicsScene,
    QGraphicsSceneMouseEvent,
    QGraphicsSimpleTextItem,
    QGraphicsView,
    QWidget,
)

from rigpilot.app.doctor.model import LinkMark
from rigpilot.app.topology.model import Edge, Node, TopologyGraph, edge_throughput, pcie_throughput
from rigpilot.app.widgets.palette import ACCENT, BAD, GOOD, WARN, blend, status_text, tint
from rigpilot.engine.hardware.machine import Machine

COL = 134.0  # horizontal pitch of one GPU column
BOX_GAP = 36.0
GPU_W, GPU_H = 120.0, 46.0
NODE_W, NODE_H = 120.0, 30.0
ARC_ROOM = 56.0  # below the GPU row, for NVLink arcs between neighbours and their labels
MIN_SCALE = 0.7  # below this the labels are unreadable; scroll instead
ROW_Y = {"cpu": 40.0, "bridge": 110.0, "switch": 180.0}
PAD = 14.0
# The machine check's arcs drawn for every GPU pair up to this many pairs (4 GPUs); beyond, the broken ones only.
MAX_DRAWN_PAIRS = 6


class NodeItem(QGraphicsPathItem):
    """A rounded box with centred text; GPU nodes react to clicks."""

    def __init__(self, node: Node, rect: QRectF, view: TopologyGraphView):
        path = QPainterPath()
        path.addRoundedRect(rect, 6, 6)
        super().__init__(path)
        self.node = node
        self.view = view
        self.rect = rect
        self.setToolTip(node.tooltip)
        self.text = QGraphicsSimpleTextItem(node.label, self)
        if node.kind == "gpu":
            font = QFont(self.text.font())
            font.setBold(True)
            self.text.setFont(font)
            self.setCursor(Qt.CursorShape.PointingHandCursor)
            self.setAcceptedMouseButtons(Qt.MouseButton.LeftButton)
        else:
            self.setAcceptedMouseButtons(Qt.MouseButton.NoButton)
        self._centre_text()
        self.setZValue(2)

    def set_text(self, text: str) -> None:
        if self.text.text() != text:
            self.text.setText(text)
            self._centre_text()

    def _centre_text(self) -> None:
        b = self.text.boundingRect()
        self.text.setPos(self.rect.center().x() - b.width() / 2, self.rect.center().y() - b.height() / 2)

    def mousePressEvent(self, event: QGraphicsSceneMouseEvent) -> None:
        if self.node.gpu is not None:
            self.view.toggle_gpu(self.node.gpu)
            event.accept()
        else:
            super().mousePressEvent(event)


class TopologyGraphView(QGraphicsView):
    sig_gpus_selected = Signal(list)  # sorted GPU indices

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("topologyGraph")
        self.setAccessibleName("Topology graph: arrow keys move between GPUs, Space selects")
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.setRenderHint(QPainter.RenderHint.Antialiasing)
        self.setDragMode(QGraphicsView.DragMode.ScrollHandDrag)
        self.setScene(QGraphicsScene(self))
        self.machine: Machine | None = None
        self.graph: TopologyGraph | None = None
        self.gpu_items: dict[int, NodeItem] = {}
        self.edge_items: list[tuple[Edge, QGraphicsPathItem, QGraphicsSimpleTextItem | None]] = []
        self.selected: set[int] = set()
        self.busy: dict[int, list[str]] = {}  # GPU -> names of the jobs on it
        self.focused_gpu: int | None = None
        self._sample: dict[str, Any] | None = None
        self.link_marks: dict[tuple[int, int], LinkMark] = {}  # the machine check's, per GPU pair
        self.mark_items: dict[tuple[int, int], tuple[QGraphicsPathItem, QGraphicsSimpleTextItem]] = {}

    # -- content ----------------------------------------------------------------------------
    def show_graph(self, machine: Machine, graph: TopologyGraph) -> None:
        self.machine, self.graph = machine, graph
        valid = {n.gpu for n in graph.gpu_nodes if n.gpu is not None}
        self.selected &= valid
        if self.focused_gpu not in valid:
            self.focused_gpu = min(valid) if valid else None
        self._sample = None
        self._rebuild()

    def set_link_marks(self, marks: dict[tuple[int, int], LinkMark]) -> None:
        """Draw the machine check's figure on each GPU pair, its broken links in the fail colour."""
        if marks != self.link_marks:
            self.link_marks = dict(marks)
            self._rebuild()

    def set_busy(self, busy: dict[int, list[str]]) -> None:
        if busy != self.busy:
            self.busy = dict(busy)
            self._restyle_gpus()

    def set_selection(self, gpus: list[int], emit: bool = True) -> None:
        valid = set(self.gpu_items)
        chosen = set(gpus) & valid
        if chosen == self.selected:
            return
        self.selected = chosen
        self._restyle_gpus()
        if emit:
            self.sig_gpus_selected.emit(sorted(chosen))

    def toggle_gpu(self, index: int) -> None:
        self.focused_gpu = index
        self.set_selection(sorted(self.selected ^ {index}))
        self._restyle_gpus()

    # -- geometry -----------------------------------------------------------------------------
    def _x(self, node: Node) -> float:
        return PAD + node.column * COL + (node.box or 0) * BOX_GAP

    def _rows(self) -> tuple[float, float]:
        assert self.graph is not None
        has_switch = any(n.kind == "switch" for n in self.graph.nodes)
        has_bridge = any(n.kind == "bridge" for n in self.graph.nodes)
        gpu_y = ROW_Y["switch"] + (70 if has_switch else 0) - (0 if has_bridge else 70)
        return gpu_y, gpu_y + GPU_H + ARC_ROOM + 110

    def _rect(self, node: Node) -> QRectF:
        gpu_y, nvswitch_y = self._rows()
        if node.kind == "gpu":
            return QRectF(self._x(node), gpu_y, GPU_W, GPU_H)
        y = nvswitch_y if node.kind == "nvswitch" else ROW_Y[node.kind]
        return QRectF(self._x(node), y, NODE_W, NODE_H)

    # -- drawing -------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        scene = self.scene()
        scene.clear()
        self.gpu_items, self.edge_items, self.mark_items = {}, [], {}
        if self.graph is None:
            return
        pal = self.palette()
        scene.setBackgroundBrush(pal.color(QPalette.ColorRole.Base))
        ink = pal.color(QPalette.ColorRole.Text)
        gpu_y, _ = self._rows()
        rects = {n.id: self._rect(n) for n in self.graph.nodes}
        has_nvlink_pairs = any(len(e.gpus) == 2 for e in self.graph.nvlink_edges)
        gpu_rects = {n.gpu: rects[n.id] for n in self.graph.gpu_nodes if n.gpu is not None}
        marks = {p: m for p, m in self.link_marks.items() if p[0] in gpu_rects and p[1] in gpu_rects}
        if len(marks) > MAX_DRAWN_PAIRS:  # a web of arcs hides the machine: the matrix has every pair's figure
            marks = {p: m for p, m in marks.items() if m.broken}
        below = self._marks_room(marks, gpu_rects, has_nvlink_pairs)
        for b, box in enumerate(self.graph.boxes):
            members = [rects[n.id] for n in self.graph.nodes if n.box == b]
            if not members:
                continue
            left = min(r.left() for r in members) - PAD
            right = max(r.right() for r in members) + PAD
            bottom = gpu_y + GPU_H + PAD + max(ARC_ROOM if has_nvlink_pairs else 0, below)
            frame = QGraphicsRectItem(QRectF(left, 0, right - left, bottom))
            frame.setPen(QPen(blend(ink, pal.color(QPalette.ColorRole.Base), 0.35), 1, Qt.PenStyle.DashLine))
            frame.setBrush(QBrush(pal.color(QPalette.ColorRole.AlternateBase)))
            frame.setToolTip(box.label)
            frame.setZValue(0)
            scene.addItem(frame)
            title = QGraphicsSimpleTextItem(box.label, frame)
            title.setBrush(QBrush(ink))
            title.setPos(left + 6, 4)
        for edge in self.graph.edges:
            self._add_edge(edge, rects[edge.a], rects[edge.b], ink)
        for pair, mark in sorted(marks.items()):
            self._add_mark(pair, mark, gpu_rects[pair[0]], gpu_rects[pair[1]], ink, has_nvlink_pairs)
        for node in self.graph.nodes:
            item = NodeItem(node, rects[node.id], self)
            item.text.setBrush(QBrush(ink))
            if node.gpu is not None:
                self.gpu_items[node.gpu] = item
            else:
                fill = {"nvswitch": GOOD, "cpu": ACCENT}.get(node.kind)
                item.setBrush(QBrush(tint(fill, pal, 0.3) if fill else pal.color(QPalette.ColorRole.Button)))
                item.setPen(QPen(blend(ink, pal.color(QPalette.ColorRole.Base), 0.5), 1))
            scene.addItem(item)
        self._restyle_gpus()
        if self._sample is not None:
            self.show_throughput(self._sample)
        scene.setSceneRect(scene.itemsBoundingRect().adjusted(-PAD, -PAD, PAD, PAD))
        self._fit()

    def _add_edge(self, edge: Edge, ra: QRectF, rb: QRectF, ink: QColor) -> None:
        pal = self.palette()
        path = QPainterPath()
        label_at: QPointF | None = None
        if edge.kind == "nvlink" and len(edge.gpus) == 2:
            # GPU pairs: an arc below the GPU row, deeper the farther apart, so arcs do not hide PCIe lines.
            a, b = QPointF(ra.center().x(), ra.bottom()), QPointF(rb.center().x(), rb.bottom())
            depth = 28 + 0.18 * abs(b.x() - a.x())
            control = QPointF((a.x() + b.x()) / 2, max(a.y(), b.y()) + depth)
            path.moveTo(a)
            path.quadTo(control, b)
            label_at = QPointF(control.x(), (a.y() + control.y()) / 2)
            pen = QPen(GOOD, 2 + math.log2(max(edge.links, 1)) / 2)
        elif edge.kind == "nvlink":
            a, b = QPointF(ra.center().x(), ra.bottom()), QPointF(rb.center().x(), rb.top())
            path.moveTo(a)
            path.lineTo(b)
            label_at = QPointF(a.x() + (b.x() - a.x()) * 0.3, a.y() + (b.y() - a.y()) * 0.3)
            pen = QPen(GOOD, 2)
        elif edge.kind == "smp":
            a, b = QPointF(ra.right(), ra.center().y()), QPointF(rb.left(), rb.center().y())
            path.moveTo(a)
            path.lineTo(b)
            label_at = QPointF((a.x() + b.x()) / 2, a.y() - 16)
            pen = QPen(BAD, 2, Qt.PenStyle.DashLine)
        else:
            # PCIe: from the top of the lower node straight up, then across to its parent.
            a, b = QPointF(ra.center().x(), ra.top()), QPointF(rb.center().x(), rb.bottom())
            path.moveTo(a)
            mid = (a.y() + b.y()) / 2
            path.lineTo(a.x(), mid)
            path.lineTo(b.x(), mid)
            path.lineTo(b)
            pen = QPen(blend(ink, pal.color(QPalette.ColorRole.Base), 0.6), 1.5)
            if edge.gpus:  # a GPU's own link: its live traffic goes beside the rising line
                label_at = QPointF(a.x(), (a.y() + mid) / 2)
        pen.setCosmetic(True)
        item = QGraphicsPathItem(path)
        item.setPen(pen)
        item.setData(0, QColor(pen.color()))  # the resting colour, back when the traffic calms down
        item.setToolTip(edge.tooltip or edge.label)
        item.setZValue(1)
        self.scene().addItem(item)
        text = None
        if (edge.label or edge.kind == "pcie") and label_at is not None:
            text = QGraphicsSimpleTextItem(edge.label)
            font = QFont(text.font())
            font.setPointSizeF(max(font.pointSizeF() * 0.85, 7))
            text.setFont(font)
            text.setBrush(QBrush(ink))
            text.setToolTip(edge.tooltip)
            backing = QGraphicsRectItem()
            backing.setBrush(QBrush(pal.color(QPalette.ColorRole.Base)))
            backing.setPen(QPen(Qt.PenStyle.NoPen))
            backing.setZValue(3)
            text.setParentItem(backing)
            self.scene().addItem(backing)
            self._place_label(text, label_at, beside=edge.kind == "pcie")
            backing.setVisible(bool(edge.label))
        self.edge_items.append((edge, item, text))

    @staticmethod
    def _mark_depth(ra: QRectF, rb: QRectF, under_nvlink: bool) -> float:
        """How far below the GPU row a measured pair's arc reaches: deeper the farther apart (so labels of
        pairs at one distance sit side by side, and other distances below them), under any NVLink arcs."""
        return (ARC_ROOM if under_nvlink else 0) + 36 + 0.3 * abs(rb.center().x() - ra.center().x())

    def _marks_room(self, marks: dict[tuple[int, int], LinkMark], rects: dict[int, QRectF], nvlink: bool) -> float:
        if not marks:
            return 0.0
        return max(self._mark_depth(rects[a], rects[b], nvlink) / 2 for a, b in marks) + 22

    def _add_mark(
        self, pair: tuple[int, int], mark: LinkMark, ra: QRectF, rb: QRectF, ink: QColor, under_nvlink: bool
    ) -> None:
        """The machine check's result for a GPU pair: a dotted arc below the GPUs, labelled with the measured
        all-reduce; a broken link (wrong data, a hang) solid in the fail colour with the finding's words."""
        pal = self.palette()
        a, b = QPointF(ra.center().x() + 8, ra.bottom()), QPointF(rb.center().x() - 8, rb.bottom())
        depth = self._mark_depth(ra, rb, under_nvlink)
        control = QPointF((a.x() + b.x()) / 2, a.y() + depth)
        path = QPainterPath()
        path.moveTo(a)
        path.quadTo(control, b)
        color = BAD if mark.broken else blend(ink, pal.color(QPalette.ColorRole.Base), 0.55)
        pen = QPen(color, 2.5 if mark.broken else 1.2, Qt.PenStyle.SolidLine if mark.broken else Qt.PenStyle.DotLine)
        pen.setCosmetic(True)
        item = QGraphicsPathItem(path)
        item.setPen(pen)
        item.setToolTip(mark.tooltip)
        item.setZValue(2)
        self.scene().addItem(item)
        text = QGraphicsSimpleTextItem(("✗ " if mark.broken else "") + mark.text)
        font = QFont(text.font())
        font.setPointSizeF(max(font.pointSizeF() * 0.85, 7))
        font.setBold(mark.broken)
        text.setFont(font)
        text.setBrush(QBrush(status_text(BAD, pal) if mark.broken else ink))
        text.setToolTip(mark.tooltip)
        backing = QGraphicsRectItem()
        backing.setBrush(QBrush(pal.color(QPalette.ColorRole.Base)))
        backing.setPen(QPen(Qt.PenStyle.NoPen))
        backing.setZValue(4)
        backing.setToolTip(mark.tooltip)
        text.setParentItem(backing)
        self.scene().addItem(backing)
        self._place_label(text, QPointF(control.x(), a.y() + depth / 2))  # the arc's lowest point
        self.mark_items[pair] = (item, text)

    @staticmethod
    def _place_label(text: QGraphicsSimpleTextItem, at: QPointF, beside: bool = False) -> None:
        """Centre the label on `at`, or with `beside` start it just right of `at` (next to a vertical line)."""
        b = text.boundingRect()
        backing = text.parentItem()
        assert isinstance(backing, QGraphicsRectItem)
        backing.setRect(QRectF(0, 0, b.width() + 4, b.height()))
        left = at.x() + 4 if beside else at.x() - b.width() / 2 - 2
        backing.setPos(left, at.y() - b.height() / 2)
        text.setPos(2, 0)

    def _restyle_gpus(self) -> None:
        pal = self.palette()
        ink = pal.color(QPalette.ColorRole.Text)
        highlight = pal.color(QPalette.ColorRole.Highlight)
        for index, item in self.gpu_items.items():
            busy = index in self.busy
            item.setBrush(QBrush(tint(WARN if busy else ACCENT, pal, 0.45 if busy else 0.22)))
            selected = index in self.selected
            pen = QPen(
                highlight if selected else blend(ink, pal.color(QPalette.ColorRole.Base), 0.5), 3.5 if selected else 1.2
            )
            if index == self.focused_gpu and self.hasFocus():
                pen.setStyle(Qt.PenStyle.DashLine)
                pen.setWidthF(max(pen.widthF(), 2.5))
            item.setPen(pen)
            tip = item.node.tooltip
            if busy:
                tip += "\nIn use by: " + ", ".join(self.busy[index])
            item.setToolTip(tip + ("\nSelected" if selected else ""))
            item.set_text(item.node.label + (" ●" if busy else ""))

    def show_throughput(self, sample: dict[str, Any]) -> None:
        """Live NVLink traffic on the edges, and each GPU's PCIe traffic, from a TelemetrySample dict."""
        self._sample = sample
        if self.machine is None:
            return
        for edge, item, text in self.edge_items:
            if edge.kind == "pcie" and text is not None:
                self._show_pcie(edge, item, text, pcie_throughput(edge, sample))
                continue
            if edge.kind != "nvlink" or text is None:
                continue
            flow = edge_throughput(self.machine, edge, sample)
            if flow is None:
                label = edge.label
            else:
                there, back = flow
                approx = "≈" if len(edge.gpus) == 2 else ""
                label = f"{edge.label}\n{approx}{there / 1e9:.1f} ⇄ {back / 1e9:.1f} GB/s"
                if edge.gbs:
                    busy = max(there, back) / (edge.gbs * 1e9)
                    pen = item.pen()
                    pen.setColor(blend(BAD, GOOD, min(busy, 1.0)) if busy > 0.5 else GOOD)
                    item.setPen(pen)
            if text.text() != label:
                center = text.parentItem().sceneBoundingRect().center()
                text.setText(label)
                self._place_label(text, center)

    def _show_pcie(
        self, edge: Edge, item: QGraphicsPathItem, text: QGraphicsSimpleTextItem, flow: tuple[float, float] | None
    ) -> None:
        backing = text.parentItem()
        if flow is None:
            backing.setVisible(False)
            return
        rx, tx = flow
        label = f"↓{rx / 1e9:.1f} ↑{tx / 1e9:.1f} GB/s"
        if text.text() != label:
            anchor = backing.pos() + QPointF(-4, backing.rect().height() / 2)
            text.setText(label)
            self._place_label(text, anchor, beside=True)
        backing.setVisible(True)
        backing.setToolTip(f"GPU {edge.gpus[0]} PCIe: {rx / 1e9:.2f} GB/s in, {tx / 1e9:.2f} GB/s out"
                           + (f" of {edge.gbs:.0f} GB/s each way" if edge.gbs else ""))  # fmt: skip
        if edge.gbs:
            busy = max(rx, tx) / (edge.gbs * 1e9)
            pen = item.pen()
            # A link past half its bandwidth turns towards red; below, its resting colour.
            pen.setColor(blend(BAD, GOOD, min(busy, 1.0)) if busy > 0.5 else item.data(0))
            item.setPen(pen)

    # -- view behaviour -------------------------------------------------------------------------
    def _fit(self) -> None:
        rect = self.scene().sceneRect()
        if rect.isEmpty() or self.viewport().width() < 10:
            return
        # Shrink to fit, but never blow small machines up past their natural size.
        scale = min(1.0, self.viewport().width() / rect.width(), self.viewport().height() / rect.height())
        scale = max(scale, MIN_SCALE)
        self.resetTransform()
        self.scale(scale, scale)
        self.centerOn(rect.center())

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._fit()

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._rebuild()

    def focusInEvent(self, event: Any) -> None:
        super().focusInEvent(event)
        self._restyle_gpus()

    def focusOutEvent(self, event: Any) -> None:
        super().focusOutEvent(event)
        self._restyle_gpus()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        order = sorted(self.gpu_items, key=lambda i: (self.gpu_items[i].rect.x(), i))
        key = event.key()
        if order and key in (Qt.Key.Key_Left, Qt.Key.Key_Right, Qt.Key.Key_Up, Qt.Key.Key_Down):
            pos = order.index(self.focused_gpu) if self.focused_gpu in order else 0
            step = -1 if key in (Qt.Key.Key_Left, Qt.Key.Key_Up) else 1
            self.focused_gpu = order[(pos + step) % len(order)]
            self._restyle_gpus()
            self.ensureVisible(self.gpu_items[self.focused_gpu])
        elif key == Qt.Key.Key_Space and self.focused_gpu is not None:
            self.toggle_gpu(self.focused_gpu)  # as a check box ticks; Return is the dialog's (the wizard's Next)
        elif key in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            event.ignore()
        elif key == Qt.Key.Key_Escape and self.selected:
            self.set_selection([])
        elif key == Qt.Key.Key_A and event.modifiers() & Qt.KeyboardModifier.ControlModifier:
            self.set_selection(order)
        else:
            super().keyPressEvent(event)
