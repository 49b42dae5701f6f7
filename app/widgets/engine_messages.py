"""Reading what the engine link sends, in the shapes it may arrive in."""

from __future__ import annotations

from typing import Any

from rigpilot.engine.hardware.machine import Machine


def machine_dict(message: dict[str, Any] | None) -> dict[str, Any] | None:
    """A Machine.to_dict() from either that dict or the `machine` request's reply ({"machine": ..., "notes": ...})."""
    if not message:
        return None
    if "gpus" not in message and isinstance(message.get("machine"), dict):
        return message["machine"]
    return message


def machine_from_message(message: dict[str, Any] | None) -> Machine | None:
    d = machine_dict(message)
    return Machine.from_dict(d) if d else None
