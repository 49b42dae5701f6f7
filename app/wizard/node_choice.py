"""The wizard's node choice: which other machines' engines (Settings → Nodes) a job also runs on.

Unticked by default: a job runs on this machine alone. Each ticked node runs the same GPUs as
this one, and this engine leads the job (engine.service.multinode); the list comes from the engine.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QListWidget, QListWidgetItem, QVBoxLayout, QWidget


class NodeChoice(QWidget):
    sig_changed = Signal(list)  # the ticked node names

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.label = QLabel("Also run on (the same GPUs on each; add machines in Settings → Nodes):")
        self.label.setWordWrap(True)
        self.list = QListWidget()
        self.list.setObjectName("nodeChoice")
        self.list.setAccessibleName("Other nodes")
        self.list.setMaximumHeight(80)
        self.list.itemChanged.connect(lambda _item: self.sig_changed.emit(self.chosen()))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.label)
        layout.addWidget(self.list)
        self.allowed = True  # False while the job goes to SLURM, which chooses its nodes itself
        self.hide()  # shown once the engine lists at least one node

    def load(self, link: Any, chosen: list[str]) -> None:
        if link is None or not hasattr(link, "call"):
            return
        link.call("nodes", on_done=lambda reply: self.show_nodes(reply.get("nodes") or [], chosen),
                  on_error=lambda _e: self.hide(), probe=False)  # fmt: skip

    def show_nodes(self, found: list[dict[str, Any]], chosen: list[str]) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for n in found:
            item = QListWidgetItem(f"{n['name']} ({n['address']})")
            item.setData(Qt.ItemDataRole.UserRole, n["name"])
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Checked if n["name"] in chosen else Qt.CheckState.Unchecked)
            self.list.addItem(item)
        self.list.blockSignals(False)
        self.setVisible(bool(found) and self.allowed)

    def set_allowed(self, on: bool) -> None:
        self.allowed = on
        self.setVisible(on and self.list.count() > 0)

    def chosen(self) -> list[str]:
        items = (self.list.item(i) for i in range(self.list.count()))
        return [it.data(Qt.ItemDataRole.UserRole) for it in items if it.checkState() == Qt.CheckState.Checked]
