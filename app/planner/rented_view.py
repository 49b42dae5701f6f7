"""The Planner's "Rented machines" tab: the planned job here against the rented machines in Settings, as
time and cost to finish the token budget. The comparison is engine/planner/rented.py's, as
`rigpilot plan --tokens N --compare-rented` prints it; each rented machine is planned by the engine (the
`plan` request's `machine`, uncalibrated as any other machine), and this tab only gathers the answers.
"""

from __future__ import annotations

from collections.abc import Callable
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

from rigpilot.app.planner.model import error_text
from rigpilot.app.tasks import run_in_background
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.planner.plan import Plan
from rigpilot.engine.planner.rented import compare, rented_machine
from rigpilot.engine.settings import RENTED_EXAMPLE, Settings

HEADERS = ["Machine", "Tokens/s", "Time", "Cost", "How"]
NO_BUDGET = "Set “Train on” (a token budget) and plan to compare this machine with rented ones."
NO_MACHINES = f"No rented machines yet: add them in Settings (Prices), or: {RENTED_EXAMPLE}"
# Each rented machine is one box: its search may use its GPUs, not this machine's nodes; one best plan is enough.
_NOT_FOR_RENTED = ("nodes", "internode")
_BEST_ONLY = {"runners_up": 0, "suggest": False}


class RentedPlans:
    """The rented machines of Settings, each planned by the engine; `done(comparison or None)` once all answered
    (None: no rented machine), `failed(error)` when the settings cannot be read."""

    def __init__(self, link: Any, request: Any, best: dict[str, Any] | None, machine: dict[str, Any]):
        self.link, self.request, self.best, self.machine = link, request, best, machine
        self.settings: Settings | None = None
        self.answers: list[tuple[dict[str, Any] | None, str]] = []

    def start(self, done: Callable[[Any], None], failed: Callable[[BaseException], None]) -> None:
        def loaded(settings: Settings) -> None:
            self.settings = settings
            if not settings.rented_machines:
                done(None)
                return
            self._ask(0, done)

        run_in_background(Settings.load, loaded, failed)

    def _ask(self, i: int, done: Callable[[Any], None]) -> None:
        assert self.settings is not None
        entries = self.settings.rented_machines
        if i == len(entries):
            done(self._compare())
            return

        def answered(reply: dict[str, Any]) -> None:
            best = reply.get("result", reply).get("best")
            self.answers.append((best, "" if best else "nothing fits"))
            self._ask(i + 1, done)

        def refused(error: BaseException) -> None:  # a GPU without the workload's dtype, say: the reason is the row's
            self.answers.append((None, error_text(error)))
            self._ask(i + 1, done)

        options = {k: v for k, v in self.request.options_args().items() if k not in _NOT_FOR_RENTED}
        self.link.call(
            "plan", on_done=answered, on_error=refused, model=self.request.model.strip(),
            workload=self.request.workload_args(), options={**options, **_BEST_ONLY},
            machine=rented_machine(entries[i]).to_dict(),
        )  # fmt: skip

    def _compare(self) -> dict[str, Any]:
        assert self.settings is not None
        answers = iter(self.answers)  # compare asks for the rented machines in the settings' order, as they were asked

        def plan_for(_machine: Machine) -> tuple[Plan | None, str]:
            best, why = next(answers)
            return (Plan.from_dict(best) if best else None), why

        here = Machine.from_dict(self.machine)
        return compare(
            (here.label, Plan.from_dict(self.best) if self.best else None, here), self.settings.rented_machines,
            self.request.token_budget, self.settings.price(), plan_for,
        )  # fmt: skip


def cells(r: dict[str, Any]) -> list[str]:
    from rigpilot.engine.planner.durations import duration_text

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
        layout.setContentsMargins(0, 0, 0, 0)  # as the other details tabs: their text starts at the tab's edge
        layout.addWidget(self.note)
        layout.addWidget(self.table, 1)
        self.comparison: dict[str, Any] | None = None
        self._serial = 0

    def show_for(self, link: Any, request: Any, result: dict[str, Any] | None, machine: dict[str, Any] | None) -> None:
        """Compare the plan here (`result`'s best, on `machine`) with the rented machines, each planned by the
        engine behind `link`."""
        self._serial += 1
        serial = self._serial
        if not request.token_budget or machine is None:
            self._show(None, NO_BUDGET)
            return
        self.note.setText("Planning the rented machines…")

        # A newer request's answer may be on its way: an older one is dropped.
        def done(comparison: Any) -> None:
            if serial == self._serial:
                self._show(comparison, NO_MACHINES)

        def failed(e: BaseException) -> None:
            if serial == self._serial:
                self._show(None, f"Cannot compare: {error_text(e)}")

        RentedPlans(link, request, (result or {}).get("best"), machine).start(done, failed)

    def clear(self) -> None:
        """Nothing compared; an answer still on its way for the plan before is dropped."""
        self._serial += 1
        self._show(None, NO_BUDGET)

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
