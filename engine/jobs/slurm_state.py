"""How a SLURM job's queue state reads, for the Jobs page and `rigpilot jobs` alike (no SLURM calls here)."""

from __future__ import annotations

from typing import Any


def describe(slurm: dict[str, Any] | None) -> str:
    """How the Jobs page and `rigpilot jobs` name a SLURM job's queue state: 'SLURM: pending (Resources)'."""
    if not slurm:
        return ""
    state = str(slurm.get("state") or "submitted").lower().replace("_", " ")
    reason = slurm.get("reason")
    text = f"SLURM: {state}"
    if reason and reason not in ("None", "(null)"):
        text += f" ({reason})"
    return text
