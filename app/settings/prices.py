"""The Settings page's Prices box: the electricity price (for each job's energy cost) and the rented machines
the planner compares a job with, at the prices the user pays (Rigpilot knows no market prices).

Values are checked by the same functions as `rigpilot settings` (engine/settings.py), and saved apart from
the page's other fields: only these keys of the settings file change.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtGui import QPalette
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
    QVBoxLayout,
    QWidget,
)

from rigpilot.app.tasks import run_in_background
from rigpilot.app.widgets.icons import set_icon
from rigpilot.app.widgets.style import set_status
from rigpilot.engine.settings import RENTED_EXAMPLE, Settings, check_currency, check_price, check_rented_machine

COLUMNS = [("name", "Name"), ("gpu", "GPU model"), ("gpus", "GPUs"), ("price_per_gpu_hour", "Price per GPU-hour"),
           ("currency", "Currency")]  # fmt: skip


def check_prices(price: str, currency: str, rows: list[dict[str, str]]) -> tuple[dict[str, Any], dict[str, str]]:
    """(what to store, field -> message): the price and currency (both empty: no price) and each table row."""
    errors: dict[str, str] = {}
    out: dict[str, Any] = {"electricity_price": None, "electricity_currency": None, "rented_machines": []}
    if price.strip() or currency.strip():
        try:
            out["electricity_price"] = check_price(price.strip(), "The price per kWh")
            out["electricity_currency"] = check_currency(currency)
        except ValueError as e:
            errors["electricity"] = str(e)[:1].upper() + str(e)[1:]
    names = set()
    for i, row in enumerate(rows, start=1):
        if not any(v.strip() for v in row.values()):
            continue  # a row left empty is no machine
        try:
            m = check_rented_machine(row)
        except ValueError as e:
            errors.setdefault("rented", f"Row {i}: {e}")
            continue
        if m["name"] in names:
            errors.setdefault("rented", f"Row {i}: another row is named {m['name']!r} already")
        names.add(m["name"])
        out["rented_machines"].append(m)
    return out, errors


def save_prices(values: dict[str, Any]) -> str:
    """Write these keys, keeping every other setting (file I/O: off the GUI thread)."""
    settings = Settings.load()
    for k, v in values.items():
        setattr(settings, k, v)
    settings.save()
    return str(Settings.path())


class PricesBox(QGroupBox):
    sig_saved = Signal(dict)

    def __init__(self, parent: QWidget | None = None):
        super().__init__("Prices (the cost of jobs, and rented machines to compare with)", parent)
        self.setObjectName("pricesBox")
        self.price = QLineEdit()
        self.price.setObjectName("electricityPrice")
        self.price.setPlaceholderText("e.g. 0.30 (empty: not set)")
        self.currency = QLineEdit()
        self.currency.setObjectName("electricityCurrency")
        self.currency.setPlaceholderText("EUR")
        self.currency.setMaxLength(3)
        line = QHBoxLayout()
        line.addWidget(self.price, 1)
        line.addWidget(QLabel("per kWh, in"))
        line.addWidget(self.currency)
        self.electricity_error = _error()
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("rentedMachines")
        self.table.setAccessibleName("Rented machines")
        self.table.setHorizontalHeaderLabels([title for _, title in COLUMNS])
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setMaximumHeight(160)
        self.table.setTabKeyNavigation(False)  # Tab leaves the table, as on the rest of the page
        add, remove = QPushButton("Add machine"), QPushButton("Remove machine")
        set_icon(add, "add")
        set_icon(remove, "remove")
        add.clicked.connect(lambda: self.add_row({}))
        remove.clicked.connect(self._remove_selected)
        self.rented_error = _error()
        self.save_button = QPushButton("Save prices")
        set_icon(self.save_button, "save")
        self.save_button.setObjectName("savePrices")
        self.save_button.clicked.connect(self.save)
        self.status = QLabel()
        self.status.setWordWrap(True)
        note = QLabel(
            "Enter what you pay. GPU model: a key of the GPU table (h100-sxm5, a100-sxm4-80gb, rtx-4090, …); "
            f"the command line does the same: {RENTED_EXAMPLE}"
        )
        note.setWordWrap(True)
        note.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        buttons = QHBoxLayout()
        buttons.addWidget(add)
        buttons.addWidget(remove)
        buttons.addStretch(1)
        buttons.addWidget(self.status, 2)
        buttons.addWidget(self.save_button)
        form = QFormLayout()
        form.addRow("Electricity", line)
        form.addRow("", self.electricity_error)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(QLabel("Rented machines"))
        layout.addWidget(self.table)
        layout.addWidget(self.rented_error)
        layout.addWidget(note)
        layout.addLayout(buttons)
        self.save_button.setEnabled(False)  # until load(): the page calls it once its own read is done

    def load(self) -> None:
        self.save_button.setEnabled(False)
        run_in_background(Settings.load, self._on_loaded, self._on_failed)

    def _on_loaded(self, settings: Settings) -> None:
        self.price.setText(f"{settings.electricity_price:g}" if settings.electricity_price is not None else "")
        self.currency.setText(settings.electricity_currency or "")
        self.table.setRowCount(0)
        for m in settings.rented_machines:
            self.add_row(m)
        self.save_button.setEnabled(True)

    def add_row(self, machine: dict[str, Any]) -> None:
        r = self.table.rowCount()
        self.table.insertRow(r)
        for c, (key, _) in enumerate(COLUMNS):
            v = machine.get(key)
            self.table.setItem(r, c, QTableWidgetItem("" if v is None else f"{v:g}" if isinstance(v, float) else str(v)))

    def _remove_selected(self) -> None:
        for r in sorted({i.row() for i in self.table.selectedIndexes()}, reverse=True):
            self.table.removeRow(r)

    def rows(self) -> list[dict[str, str]]:
        out = []
        for r in range(self.table.rowCount()):
            out.append({key: item.text() if (item := self.table.item(r, c)) else "" for c, (key, _) in enumerate(COLUMNS)})
        return out

    def save(self) -> bool:
        values, errors = check_prices(self.price.text(), self.currency.text(), self.rows())
        for name, label in (("electricity", self.electricity_error), ("rented", self.rented_error)):
            label.setText(errors.get(name, ""))
            label.setVisible(name in errors)
        if errors:
            self.status.setText("Nothing saved: fix the fields marked in red.")
            return False
        self.save_button.setEnabled(False)
        run_in_background(lambda: save_prices(values), lambda path: self._on_saved(values, path), self._on_failed)
        return True

    def _on_saved(self, values: dict[str, Any], path: str) -> None:
        self.save_button.setEnabled(True)
        self.status.setText(f"Saved in {path}")
        self.sig_saved.emit(values)

    def _on_failed(self, error: BaseException) -> None:
        self.save_button.setEnabled(True)
        self.status.setText(f"Cannot read or write the settings: {error}")


def _error() -> QLabel:
    label = QLabel()
    label.setWordWrap(True)
    set_status(label, "bad")
    label.hide()
    return label
