"""The machines imported from `nvidia-smi` output: one list the Topology and Planner pages share.

Each entry keeps the machine itself (Machine.to_dict), so it stays usable
after the files it came from are moved or deleted. The list is kept in
QSettings as JSON, newest first, and re-importing the same files replaces
their entry instead of adding a second one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QSettings, Signal

from rigpilot.app.topology.model import machine_title
from rigpilot.engine.hardware.importers import unknown_model_gpus
from rigpilot.engine.hardware.machine import Machine

SETTINGS_KEY = "machines/imported"
MAX_IMPORTED = 20  # older imports drop off the end
HERE = "here"  # the engine's machine, where a key names a machine (the Topology page's, the Planner's list)


def plan_block(d: dict[str, Any]) -> str:
    """Why a machine cannot be planned for ('' when it can): a GPU whose memory no source gave."""
    unknown = unknown_model_gpus(Machine.from_dict(d))  # the engine's rule: `rigpilot plan` refuses the same
    if not unknown:
        return ""
    return (
        f"The memory of GPU {', '.join(map(str, unknown))} is unknown (topo -m lists no GPU models): "
        "choose its GPU model on the Topology page, or import its `nvidia-smi -q` output together with its topo -m"
    )


@dataclass(frozen=True)
class ImportedMachine:
    key: str  # stable id: from the source files' names
    title: str  # what lists show: the machine's label (it names the files)
    machine: dict[str, Any]  # Machine.to_dict()


def import_key(machine: dict[str, Any]) -> str:
    origin = str(machine.get("origin") or machine.get("label") or "")
    return hashlib.sha1(origin.encode()).hexdigest()[:12]


class ImportedMachines(QObject):
    sig_changed = Signal()  # the list changed (an import added or replaced, one forgotten)

    def __init__(self, settings: QSettings | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.settings = settings if settings is not None else QSettings()
        self._items: list[ImportedMachine] = self._load()

    def items(self) -> list[ImportedMachine]:
        return list(self._items)

    def get(self, key: str) -> ImportedMachine | None:
        return next((m for m in self._items if m.key == key), None)

    def add(self, machine: dict[str, Any]) -> ImportedMachine:
        """Keep an imported machine (first in the list); returns its entry."""
        entry = ImportedMachine(import_key(machine), machine_title(Machine.from_dict(machine)), machine)
        self._items = [entry, *(m for m in self._items if m.key != entry.key)][:MAX_IMPORTED]
        self._save()
        self.sig_changed.emit()
        return entry

    def forget(self, key: str) -> None:
        before = len(self._items)
        self._items = [m for m in self._items if m.key != key]
        if len(self._items) != before:
            self._save()
            self.sig_changed.emit()

    def _save(self) -> None:
        self.settings.setValue(SETTINGS_KEY, json.dumps([m.machine for m in self._items]))
        self.settings.sync()

    def _load(self) -> list[ImportedMachine]:
        try:
            stored = json.loads(str(self.settings.value(SETTINGS_KEY, "[]")))
        except ValueError:
            return []  # a damaged entry: start over rather than fail to open the page
        out: list[ImportedMachine] = []
        for d in stored if isinstance(stored, list) else []:
            try:
                out.append(ImportedMachine(import_key(d), machine_title(Machine.from_dict(d)), d))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue  # written by another version, or edited by hand: skip it
        return out
