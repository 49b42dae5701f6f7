"""The wizard's SLURM choice: submit the job to a SLURM cluster with sbatch instead of running it here.

Unticked by default. The options are SLURM's own (partition, account, time limit) and the login node
sbatch runs on through ssh; empty means the cluster's default. The engine checks them (one schema,
engine.planner.export.check_slurm_options) and the Review page's check puts the job to SLURM itself
(sbatch --test-only), so nothing is validated twice here.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QCheckBox, QFormLayout, QLineEdit, QVBoxLayout, QWidget

from rigpilot.app.widgets.form_row import form_row

# (key in the submit request's `slurm`, label, placeholder, explanation)
FIELDS = (
    ("partition", "Partition", "the cluster's default", "The SLURM partition (queue) to submit to."),
    ("account", "Account", "your default account", "The SLURM account the job is charged to."),
    ("time", "Time limit", "e.g. 240 or 4:00:00", "MINUTES, HH:MM:SS or DAYS-HH:MM:SS; SLURM stops the job after it."),
    ("login", "Login node", "run sbatch on this machine", "Submit through ssh on this host (a key, no password)."),
)


class SlurmChoice(QWidget):
    sig_changed = Signal(object)  # the options dict, or None when the job runs here

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.enabled = QCheckBox("Submit to a SLURM cluster (sbatch) instead of running here")
        self.enabled.setObjectName("slurmEnabled")
        self.enabled.setToolTip(
            "The job folder must be on a filesystem the cluster's nodes share; each GPU chosen is one SLURM task."
        )
        self.options = QWidget()
        form = QFormLayout(self.options)
        form.setContentsMargins(24, 0, 0, 0)
        self.edits: dict[str, QLineEdit] = {}
        for key, label, placeholder, tip in FIELDS:
            edit = QLineEdit()
            edit.setObjectName(f"slurm_{key}")
            edit.setPlaceholderText(placeholder)
            edit.setAccessibleName(f"SLURM {label.lower()}")
            edit.textEdited.connect(lambda _text: self.sig_changed.emit(self.chosen()))
            form_row(form, label, edit, tip, compact=True)
            self.edits[key] = edit
        self.enabled.toggled.connect(self._toggled)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.enabled)
        layout.addWidget(self.options)
        self.options.hide()

    def load(self, options: dict[str, str] | None) -> None:
        self.enabled.blockSignals(True)
        self.enabled.setChecked(options is not None)
        self.enabled.blockSignals(False)
        for key, edit in self.edits.items():
            edit.setText((options or {}).get(key) or "")
        self.options.setVisible(options is not None)

    def chosen(self) -> dict[str, str] | None:
        if not self.enabled.isChecked():
            return None
        return {key: edit.text().strip() for key, edit in self.edits.items() if edit.text().strip()}

    def _toggled(self, on: bool) -> None:
        self.options.setVisible(on)
        self.sig_changed.emit(self.chosen())
