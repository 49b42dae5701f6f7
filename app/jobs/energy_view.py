"""The "Energy and cost" section of a job's Summary: what its GPUs drew, what that cost, tokens per kWh.

The figures are the engine's (`energy` and `energy_cost` of the job answer, engine/jobs/energy.py);
this only words them.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFormLayout, QLabel, QVBoxLayout, QWidget

from rigpilot.app.widgets.form_row import form_texts
from rigpilot.engine.jobs.energy import format_kwh, format_money

NO_PRICE = "Set your electricity price in Settings (Prices) to see what it cost."


def energy_rows(job: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows for the section; [] when the job has no energy figure at all."""
    e = job.get("energy") or {}
    if "kwh" not in e:
        return [("Energy", e["unavailable"])] if e.get("unavailable") else []
    money = job.get("energy_cost") or {}
    sim = " (simulated GPUs: a model of their power, not a meter)" if e.get("simulated") else ""
    rows = [("Energy", format_kwh(e["kwh"]) + sim)]
    gpus = e.get("gpus") or {}
    if e.get("average_w") is not None:
        rows.append(("Average power", f"{e['average_w']:.0f} W over {len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"))
    if len(gpus) > 1:
        rows.append(("Per GPU", ", ".join(f"GPU {g}: {format_kwh(v['joules'] / 3.6e6)}" for g, v in gpus.items())))
    runs = e.get("runs") or []
    if len(runs) > 1:
        rows.append(("Runs", " + ".join(format_kwh(r["joules"] / 3.6e6) for r in runs) + f" ({len(runs)} runs)"))
    if e.get("uncovered_s", 0) >= 1:
        rows.append(("Not covered", f"{e['uncovered_s']:.0f} s without power readings (not counted)"))
    if money.get("amount") is not None:
        cur = money["currency"]
        rows.append(("Cost", f"{format_money(money['amount'], cur)} at {money['price']['per_kwh']:g} {cur}/kWh"))
        if money.get("per_step") is not None:
            rows.append(("Cost per step", format_money(money["per_step"], cur)))
    else:
        rows.append(("Cost", NO_PRICE))
    if money.get("tokens_per_kwh") is not None:
        rows.append(("Tokens per kWh", f"{money['tokens_per_kwh']:,.0f}"))
    if money.get("tokens_per_currency") is not None:
        rows.append((f"Tokens per {money['currency']}", f"{money['tokens_per_currency']:,.0f}"))
    return rows


class EnergySection(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("energySection")
        title = QLabel("<b>Energy and cost</b>")
        self.form = QFormLayout()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 8, 0, 0)
        layout.addWidget(title)
        layout.addLayout(self.form)
        self.hide()

    def show_job(self, job: dict[str, Any]) -> None:
        while self.form.rowCount():
            self.form.removeRow(0)
        rows = energy_rows(job)
        for label, value in rows:
            field = QLabel(value)
            field.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            field.setWordWrap(True)
            self.form.addRow(label, field)
        why = (job.get("energy") or {}).get("attribution", "")
        self.setToolTip(f"Counted: {why}" if why else "")
        self.setVisible(bool(rows))

    def rows(self) -> dict[str, str]:
        return form_texts(self.form)


def live_line(job: dict[str, Any]) -> str:
    """One line under a job's progress, for every kind of job, running or not: its GPU energy so far and cost."""
    e = job.get("energy") or {}
    if "kwh" not in e:
        return ""
    money = job.get("energy_cost") or {}
    so_far = " so far" if job.get("state") in ("starting", "running") else ""
    text = f"GPU energy{so_far}: {format_kwh(e['kwh'])}"
    if e.get("average_w") is not None:
        text += f", {e['average_w']:.0f} W average"
    if money.get("amount") is not None:
        text += f", {format_money(money['amount'], money['currency'])}"
    return text + (" (simulated)" if e.get("simulated") else "")
