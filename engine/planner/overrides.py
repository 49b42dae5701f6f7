"""What the user changed in a recommended plan: the `plan` request's `recheck.overrides`, as a dataclass.

Pure data (no planner models), so the GUI builds it with the names the engine
checks; engine.planner.recheck applies it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Overrides:
    """What the user changed; None keeps the plan's value."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None  # None: as many as fill the plan's global batch
    checkpointing: str | None = None
    seq_len: int | None = None
    global_batch: int | None = None  # inference: sequences at once (training derives it from the degrees)
    new_tokens: int | None = None  # inference: tokens generated per sequence
    lora_rank: int | None = None
    lora_alpha: int | None = None
    lora_targets: list[str] | None = None
    pp_schedule: str | None = None  # "1f1b" | "gpipe", as the planner writes it
    sequence_parallel: bool | None = None
    cpu_offload: bool | None = None  # FSDP2 with parameters, gradients and optimizer state in host RAM

    def to_dict(self) -> dict[str, Any]:
        """Only what was changed (the request's JSON)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
