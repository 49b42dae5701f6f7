"""What the user changed in a recommended plan: the `plan` request's `recheck.overrides`, as a dataclass.

Pure data (no planner models), so the GUI builds it with the names the engine
checks; engine.planner.recheck applies it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rigpilot.engine.jobspec.spec import INFER_SETTINGS, TRAIN_SETTINGS
from rigpilot.engine.recipe import RECIPE_SETTINGS, AskedRecipe
from rigpilot.engine.schema import Setting

# The job setting each override is: a changed value is bounded as that setting is declared, in one place.
DECLARED: dict[str, Setting] = {
    "micro_batch": TRAIN_SETTINGS["micro_batch"],
    "grad_accum": TRAIN_SETTINGS["grad_accum"],
    "seq_len": TRAIN_SETTINGS["seq_len"],
    "lora_rank": TRAIN_SETTINGS["lora_rank"],
    "lora_alpha": TRAIN_SETTINGS["lora_alpha"],
    # The training recipe (engine.recipe), each as the job declares it.
    **{name: TRAIN_SETTINGS[name] for name in RECIPE_SETTINGS},
    "global_batch": INFER_SETTINGS["batch_size"],
    "new_tokens": INFER_SETTINGS["max_new_tokens"],
}


@dataclass
class Overrides(AskedRecipe):
    """What the user changed; None keeps the plan's value. The training recipe's settings (master_weights "fp32"
    or "bf16", the optimizer ...) are AskedRecipe's fields, by the declarations' names."""

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

    def check(self) -> None:
        """Refuse (UserError, reason out_of_range or not_a_choice) a changed value its setting does not allow;
        checkpointing and layouts are the re-check's own (engine.planner.recheck)."""
        for name, decl in DECLARED.items():
            decl.check(getattr(self, name))

    def to_dict(self) -> dict[str, Any]:
        """Only what was changed (the request's JSON)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
