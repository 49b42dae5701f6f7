"""Settings → Nodes: other machines' engines a job may span (`rigpilot nodes`, `rigpilot run … --nodes`).

The list and every change go through the engine (requests `nodes`, `node_add`,
`node_remove`): it keeps the registry, with the tokens, in a 0600 file of its
own, and it is the engine that reaches the nodes, so whether one answers is
asked of it. A node is checked by engine.service.nodes.check_node here first,
the same check the engine and the CLI make, so a typo is shown beside the field
without a round trip. Each node's pinned TLS certificate is listed, so it can be
compared with what `rigpilot engine --fingerprint` prints on that machine.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
)

from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import set_status
from rigpilot.engine.errors import UserError
from rigpilot.engine.service.nodes import REMOTE_HINT, check_node


def node_status(n: dict[str, Any]) -> str:
    if not n.get("reachable"):
        return f"not reachable: {n.get('error') or '?'}"
    kind = "simulated" if n.get("simulated") else "real GPUs"
    return f"{n.get('label') or '?'} ({n.get('gpus')} GPUs, {kind}), Rigpilot {n.get('version')}"


def node_certificate(n: dict[str, Any]) -> str:
    return n.get("fingerprint") or "not pinned yet (on its first login)"


class NodesBox(QGroupBox):
    sig_nodes = Signal(list)  # the nodes as the engine last listed them
    sig_error = Signal(str)

    def __init__(self, link: Any = None, parent: Any = None):
        super().__init__("Nodes (other machines' engines a job can span)", parent)
        self.link = link
        self.nodes: list[dict[str, Any]] = []
        self.table = QTableWidget(0, 4)
        self.table.setObjectName("nodesTable")
        self.table.setAccessibleName("Nodes")
        self.table.setHorizontalHeaderLabels(["Name", "Address", "Status", "Certificate (pinned)"])
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        # A fingerprint is read whole or not at all: its column takes what it needs, the status the rest.
        header.setSectionResizeMode(3, QHeaderView.ResizeMode.ResizeToContents)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setMaximumHeight(140)
        self.table.verticalHeader().hide()
        self.name = QLineEdit()
        self.name.setObjectName("nodeName")
        self.name.setAccessibleName("Node name")
        self.name.setPlaceholderText("e.g. box2")
        self.address = QLineEdit()
        self.address.setObjectName("nodeAddress")
        self.address.setAccessibleName("Node address")
        self.address.setPlaceholderText("host:port of its engine")
        self.token = QLineEdit()
        self.token.setObjectName("nodeToken")
        self.token.setAccessibleName("Node token")
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.fingerprint = QLineEdit()
        self.fingerprint.setObjectName("nodeFingerprint")
        self.fingerprint.setAccessibleName("Node certificate fingerprint")
        self.fingerprint.setPlaceholderText("optional: SHA256:… from 'rigpilot engine --fingerprint' there")
        self.add_button = QPushButton("Add node")
        set_icon(self.add_button, "add")
        self.add_button.setObjectName("addNode")
        self.add_button.clicked.connect(self.add)
        self.remove_button = QPushButton("Remove")
        set_icon(self.remove_button, "remove")
        self.remove_button.setObjectName("removeNode")
        self.remove_button.clicked.connect(self.remove_selected)
        self.refresh_button = QPushButton("Check again")
        set_icon(self.refresh_button, "refresh")
        self.refresh_button.setObjectName("refreshNodes")
        self.refresh_button.clicked.connect(self.refresh)
        self.error = QLabel()
        self.error.setObjectName("error-node")
        self.error.setWordWrap(True)
        set_status(self.error, "bad")
        self.error.hide()
        self.status = QLabel()
        self.status.setObjectName("nodesStatus")
        self.status.setWordWrap(True)

        row = QHBoxLayout()
        row.addWidget(self.refresh_button)
        row.addWidget(self.remove_button)
        row.addStretch(1)
        form = QFormLayout(self)
        form.addRow(self.table)
        form.addRow(row)
        form.addRow("Name", self.name)
        form.addRow("Address", self.address)
        form.addRow("Token", self.token)
        form.addRow("Certificate", self.fingerprint)
        form.addRow("", self.add_button)
        form.addRow("", self.error)
        hint = QLabel(
            f"A job runs on several machines with `rigpilot run … --nodes local,NAME` or the wizard. For each, {REMOTE_HINT}. "
            "Tokens are kept by the engine in a file only you can read, and never sent: engines talk over TLS and "
            "prove the token instead. Each node's certificate is pinned (the one given, else the first it presents) "
            "and a changed one is refused. Nothing listens beyond this computer unless you start an engine with --tcp."
        )
        hint.setWordWrap(True)
        form.addRow(hint)
        form.addRow(self.status)
        self.refresh()

    # -- the list ---------------------------------------------------------------------------------------
    def refresh(self) -> None:
        if self.link is None:
            return
        self.status.setText("Asking the engine…")
        self.link.call("nodes", on_done=self._on_listed, on_error=self._on_failed)

    def _on_listed(self, reply: dict[str, Any]) -> None:
        self.show_nodes(list(reply.get("nodes") or []))
        self.status.setText(f"{len(self.nodes)} node(s)." if self.nodes else "No nodes yet.")

    def show_nodes(self, found: list[dict[str, Any]]) -> None:
        self.nodes = found
        self.table.setRowCount(len(found))
        for i, n in enumerate(found):
            for j, text in enumerate((n.get("name", ""), n.get("address", ""), node_status(n), node_certificate(n))):
                self.table.setItem(i, j, QTableWidgetItem(str(text)))
        self.sig_nodes.emit(found)

    def _on_failed(self, error: BaseException) -> None:
        self.status.setText(f"The engine could not list the nodes: {error}")
        self.sig_error.emit(str(error))

    # -- changes ----------------------------------------------------------------------------------------
    def add(self) -> None:
        try:
            node = check_node(
                self.name.text().strip(), self.address.text().strip(), self.token.text(), self.fingerprint.text()
            )
        except UserError as e:
            self._show_error(str(e))
            return
        self._show_error("")
        self.add_button.setEnabled(False)
        self.status.setText(f"Adding {node.name} and checking that it answers…")
        pinned = {"fingerprint": node.fingerprint} if node.fingerprint else {}
        self.link.call(
            "node_add", name=node.name, address=node.address, token=node.token, **pinned,
            on_done=self._on_added, on_error=self._on_add_failed,
        )  # fmt: skip

    def _on_added(self, reply: dict[str, Any]) -> None:
        self.add_button.setEnabled(True)
        node = reply.get("node") or {}
        self.token.clear()
        self.name.clear()
        self.address.clear()
        self.fingerprint.clear()
        pinned = f"; certificate {node['fingerprint']} pinned" if node.get("fingerprint") else ""
        self.status.setText(f"Added {node.get('name')}: {node_status(node)}{pinned}")
        self.link.call("nodes", on_done=self._on_listed, on_error=self._on_failed)

    def _on_add_failed(self, error: BaseException) -> None:
        self.add_button.setEnabled(True)
        self._show_error(str(error))

    def remove_selected(self) -> None:
        row = self.table.currentRow()
        if not 0 <= row < len(self.nodes):
            self._show_error("Choose a node in the list to remove.")
            return
        name = self.nodes[row]["name"]
        self.link.call("node_remove", name=name, on_done=lambda _r: self.refresh(), on_error=self._on_add_failed)

    def _show_error(self, text: str) -> None:
        self.error.setText(text)
        self.error.setVisible(bool(text))
