"""What the nvidia-smi readers share: their one error and how a field no file gave is marked."""

from __future__ import annotations

import dataclasses
from typing import Any


class MachineImportError(ValueError):
    """A file could not be read as nvidia-smi output; the message says which file, line and why."""


def mark_unavailable(obj: Any, reason: str) -> None:
    """Give every still-empty field of a Gpu or Host `reason`, keeping reasons already recorded."""
    for f in dataclasses.fields(obj):
        if f.name != "unavailable" and getattr(obj, f.name) is None:
            obj.unavailable.setdefault(f.name, reason)
