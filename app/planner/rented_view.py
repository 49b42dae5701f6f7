"""The Planner's "Rented machines" tab: the planned job here against the rented machines in Settings, as
time and cost to finish the token budget. The comparison is engine/planner/rented.py's, as
`rigpilot plan --tokens N --compare-rented` prints it; this only runs it off the GUI thread and shows it.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.tasks import run_in_background
from rigpilot.engine.settings import RENTED_EXAMPLE

HEADERS = ["Machine", "Tokens/s", "Time", "Cost", "How"]
NO_BUDGET = "Set “Train on” (a token budget) and plan to compare this machine with rented ones."
NO_MACHINES = f"No rented machines yet: add them in Settings (Prices), or: {RENTED_EXAMPLE}"


def compare_locally(request: Any, best: dict[str, Any] | None, machine: dict[str, Any]) -> dict[str, Any] | None:
    """The comparison for the request's token budget, or None when there is no budget or no rented machine
    (file I/O and planning: a work function for a background task)."""
    from rigpilot.engine.hardware.machine import Machine
    from rigpilot.engine.models import describe_model
    from rigpilot.engine.planner.plan import Plan
    from rigpilot.engine.planner.rented import compare, searcher
    from rigpilot.engine.planner.search import SearchOptions
    from rigpilot.engine.settings import Settings

    settings = Settings.load()
    if not request.token_budget or not settings.rented_machines:
        return None
    spec = describe_model(request.model.strip())
    # Each rented machine is one box: the search there may use its GPUs, not this machine's nodes.
    options = SearchOptions(**{k: v for k, v in request.options_args().items() if k not in ("nodes", "internode")})
    here = Machine.from_dict(machine)
    return compare(
        (here.label, Plan.from_dict(best) if best else None, here), settings.rented_machines, request.token_budget,
        settings.price(), searcher(spec, request.workload(), options),
    )  # fmt: skip


def cells(r: dict[str, Any]) -> list[str]:
    from rigpilot.engine.planner.explain import duration_text

    if not r["fits"]:
        return [r["name"], "-", "-", "-", r["why"] or "nothing fits"]
    return [
        r["name"],
        f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
        duration_text(r["time_s"]) if r["time_s"] else "-",
        f"{r['cost']:,.2f} {r['currency']}" if r["cost"] is not None else "-",
        r.get("machine") or r.get("cost_basis") or "",
    ]


class RentedTable(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.note = QLabel(NO_BUDGET)
        self.note.setWordWrap(True)
        self.table = QTableWidget(0, len(HEADERS))
        self.table.setObjectName("rentedComparison")
        self.table.setAccessibleName("This machine against rented machines")
        self.table.setHorizontalHeaderLabels(HEADERS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setTabKeyNavigation(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.note)
        layout.addWidget(self.table, 1)
        self.comparison: dict[str, Any] | None = None
        self._serial = 0

    def show_for(self, request: Any, result: dict[str, Any] | None, machine: dict[str, Any] | None) -> None:
        self._serial += 1
        serial = self._serial
        if not request.token_budget or machine is None:
            self._show(None, NO_BUDGET)
            return
        best = (result or {}).get("best")
        self.note.setText("Planning the rented machines…")

        # A newer request's answer may be on its way: an older one is dropped.
        def done(comparison: Any) -> None:
            if serial == self._serial:
                self._show(comparison, NO_MACHINES)

        def failed(e: BaseException) -> None:
            if serial == self._serial:
                self._show(None, f"Cannot compare: {e}")

        run_in_background(lambda: compare_locally(request, best, machine), done, failed)

    def _show(self, comparison: dict[str, Any] | None, empty: str) -> None:
        self.comparison = comparison
        rows = (comparison or {}).get("rows") or []
        self.table.setRowCount(len(rows))
        for i, r in enumerate(rows):
            for c, text in enumerate(cells(r)):
                item = QTableWidgetItem(text)
                item.setToolTip(r.get("cost_basis") or text)
                self.table.setItem(i, c, item)
        if comparison:
            self.note.setText(f"To process {comparison['token_budget']:,} tokens (predicted by the planner):")
        else:
            self.note.setText(empty)
