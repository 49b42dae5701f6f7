"""The machine the Planner page plans for: this one (the engine's), a simulated profile, or an imported one.

The list follows the imported machines the Topology page keeps; an imported
machine the planner cannot plan is listed, disabled, with the reason. Another
machine is planned by the engine too (the `plan` request's `machine`), without
this machine's calibration.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QSignalBlocker, Qt, Signal
from PySide6.QtGui import QStandardItemModel
from PySide6.QtWidgets import QComboBox, QLabel, QVBoxLayout, QWidget

from rigpilot.app.topology.imported import HERE, ImportedMachines, plan_block
from rigpilot.app.topology.model import machine_title
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.simulated import list_profiles, load_profile

PROFILE, IMPORTED = "profile:", "import:"  # prefixes of the list's keys (HERE is the engine's machine)
TARGET_WIDTH = 26  # characters the list shows before eliding; each item's tooltip has its whole name


class MachineChoice(QWidget):
    sig_changed = Signal()  # another machine is planned for (also when the one chosen went away)
    sig_picked = Signal()  # the user picked a machine from the list

    def __init__(self, machines: ImportedMachines, parent: QWidget | None = None):
        super().__init__(parent)
        self.machines = machines
        self.here: dict[str, Any] | None = None  # the engine's machine, once it said
        self._profiles: dict[str, dict[str, Any]] = {}  # simulated profiles loaded, by id
        self.target = QComboBox()
        self.target.setObjectName("planMachine")
        self.target.setAccessibleName("Machine to plan for")
        # A long imported file name elides here instead of widening the form (each item's tooltip has it whole).
        self.target.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.target.setMinimumContentsLength(TARGET_WIDTH)
        self.target.currentIndexChanged.connect(self._changed)
        self.target.activated.connect(lambda _: self.sig_picked.emit())
        self.target_note = QLabel("")
        self.target_note.setObjectName("planMachineNote")
        self.target_note.setWordWrap(True)
        self.target_note.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(QLabel("Plan for:"))
        layout.addWidget(self.target)
        layout.addWidget(self.target_note)
        machines.sig_changed.connect(self.refill)
        self.refill()

    def set_here(self, machine: dict[str, Any]) -> None:
        """The engine said which machine it runs on."""
        self.here = machine
        self.target.setItemText(0, f"This machine ({machine.get('label', '')})")
        self.target.setItemData(0, f"This machine ({machine.get('label', '')}): the one the engine runs jobs on",
                                Qt.ItemDataRole.ToolTipRole)  # fmt: skip

    def refill(self) -> None:
        """This machine, each simulated profile, each imported machine; the choice stays where it was."""
        key = self.key() or HERE
        with QSignalBlocker(self.target):
            self.target.clear()
            here = f"This machine ({self.here.get('label', '')})" if self.here else "This machine"
            self.target.addItem(here, HERE)
            self.target.setItemData(0, f"{here}: the one the engine runs jobs on", Qt.ItemDataRole.ToolTipRole)
            for p in list_profiles():
                self._add(f"Simulated: {p['title']}", PROFILE + p["id"], f"{p['label']} ({p['title']})")
            for entry in self.machines.items():
                self._add(entry.title, IMPORTED + entry.key, entry.title, plan_block(entry.machine))
            index = self.target.findData(key)
            self.target.setCurrentIndex(max(index, 0))
        if index < 0:
            self._changed()  # the machine chosen went away: back to this one

    def _add(self, text: str, key: str, tip: str, blocked: str = "") -> None:
        self.target.addItem(text, key)
        i = self.target.count() - 1
        self.target.setItemData(i, f"{tip}\n{blocked}" if blocked else tip, Qt.ItemDataRole.ToolTipRole)
        if blocked:
            model = self.target.model()
            if isinstance(model, QStandardItemModel):
                model.item(i).setEnabled(False)

    def use_machines(self, machines: ImportedMachines) -> None:
        """Share another page's list of imported machines."""
        self.machines.sig_changed.disconnect(self.refill)
        self.machines = machines
        machines.sig_changed.connect(self.refill)
        self.refill()

    def key(self) -> str:
        return str(self.target.currentData() or HERE)

    def is_here(self) -> bool:
        return self.key() == HERE

    def machine(self) -> dict[str, Any] | None:
        """Machine.to_dict() of the machine planned for (None until the engine says what this one is)."""
        key = self.key()
        if key.startswith(PROFILE):
            pid = key[len(PROFILE) :]
            if pid not in self._profiles:
                self._profiles[pid] = load_profile(pid).to_dict()
            return self._profiles[pid]
        if key.startswith(IMPORTED):
            entry = self.machines.get(key[len(IMPORTED) :])
            return entry.machine if entry else None
        return self.here

    def request_arg(self) -> str | dict[str, Any] | None:
        """The `plan` request's `machine`: None for this one, a profile's id, or an imported machine."""
        key = self.key()
        if key.startswith(PROFILE):
            return key[len(PROFILE) :]
        if key.startswith(IMPORTED):
            return self.machine()
        return None

    def select(self, key: str) -> bool:
        """Plan for HERE, a "profile:<id>" or an imported machine's key (as the Topology page names it)."""
        if key != HERE and not key.startswith(PROFILE) and not key.startswith(IMPORTED):
            key = IMPORTED + key
        index = self.target.findData(key)
        if index < 0:
            return False
        self.target.setCurrentIndex(index)
        return True

    def title(self) -> str:
        """The machine planned for, in a few words (an imported machine's file names are in the list's tooltip)."""
        d = self.machine()
        return machine_title(Machine.from_dict(d), origin=False) if d else "another machine"

    def here_label(self) -> str:
        return (self.here or {}).get("label", "the engine's machine")

    def _changed(self) -> None:
        self._show_note()
        self.sig_changed.emit()

    def _show_note(self) -> None:
        if self.is_here() or self.machine() is None:
            self.target_note.hide()
            self.target.setToolTip("The machine to plan for: this one, a simulated profile, or an imported one")
            return
        self.target_note.setText(
            f"Planning for {self.title()}: this machine's calibration does not apply, "
            f"and jobs launch only on this one ({self.here_label()}). Export the plans to run them there."
        )
        self.target_note.setToolTip(self.target.currentText())
        self.target_note.show()
        self.target.setToolTip(self.target.currentText())
