"""`form_row`: the one way a settings form gets a row, its control explained in a line under it.

    row = form_row(form, "Micro-batch", spin, "Sequences each GPU processes at once.")
    form.setRowVisible(row, training)   # the returned widget is the row's field: hide the row by it

The explanation is also the control's tooltip, so it reads the same on hover
and for screen readers; rows that do not apply are hidden, never disabled.
`compact=True` keeps the explanation to the tooltip, for tight forms.
"""

from __future__ import annotations

from PySide6.QtGui import QFont, QPalette
from PySide6.QtWidgets import QFormLayout, QLabel, QVBoxLayout, QWidget


def form_row(form: QFormLayout, label: str, control: QWidget, tip: str, *, compact: bool = False) -> QWidget:
    """Add `label: control` with `tip` in small grey type under the control; returns the row's field widget.

    `compact`: the tip is the tooltip only (tight forms beside a chart).
    """
    control.setToolTip(tip)
    if compact:
        form.addRow(label, control)
        return control
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 2)
    layout.setSpacing(0)
    layout.addWidget(control)
    note = QLabel(tip)
    note.setObjectName("explanation")
    note.setWordWrap(True)
    note.setForegroundRole(QPalette.ColorRole.PlaceholderText)
    font = QFont(note.font())
    font.setPointSizeF(font.pointSizeF() * 0.9)
    note.setFont(font)
    layout.addWidget(note)
    form.addRow(label, box)
    return box


def form_texts(form: QFormLayout) -> dict[str, str]:
    """What a read-only form shows, label → text: for tests and copying, read off the widgets themselves."""
    out = {}
    for r in range(form.rowCount()):
        label = form.itemAt(r, QFormLayout.ItemRole.LabelRole)
        field = form.itemAt(r, QFormLayout.ItemRole.FieldRole)
        name = label.widget() if label else None
        value = field.widget() if field else None
        if isinstance(name, QLabel) and isinstance(value, QLabel):  # a read-only form's rows are labels both sides
            out[name.text()] = value.text()
    return out
