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


def machine_identity(d: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """What makes two machine messages the same machine to plan for: its label, GPUs and how they are wired (not
    its notes or calibration). Two simulated profiles can share a label and differ in their links."""
    if not d:
        return None
    gpus = tuple((g.get("index"), g.get("name"), g.get("memory_total"), g.get("uuid")) for g in d.get("gpus") or [])
    pairs = tuple((p.get("a"), p.get("b"), p.get("topo")) for p in d.get("pairs") or [])
    return (d.get("label"), d.get("profile"), gpus, pairs)
