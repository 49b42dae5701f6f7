"""The recipes the search tries, leanest last: each rung adds one memory technique to the one before.

Order of preference, cheapest in speed and numerics first (torchtune's names): mixed precision as asked, chunked
cross-entropy, pure bf16, 8-bit AdamW, the optimizer step in backward, activation offloading, the optimizer state in
host memory (torchtune's paged AdamW: one GPU, CPU AdamW instead of the two before it); CPU parameter offload stays
the search's last resort (its layouts). A setting the user pinned is never changed, so its rung is skipped.
torch.compile and FP8 change no memory the planner counts, and compiling takes a warm-up and FP8 changes the
numerics: the search uses them only where asked (their declarations are not `searched`).

Chunked cross-entropy changes neither the numerics nor what a step does, so it is `free`: the search takes it
wherever it lets a faster micro-batch fit. The later rungs change the numerics (pure bf16, 8-bit AdamW) or what a
step can do (no accumulation or clipping in backward), so the search uses them only where no plan fits without.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rigpilot.engine.capability import RecipeContext, recipe_why_not
from rigpilot.engine.layout import Layout
from rigpilot.engine.planner.plan import Workload, recipe_of
from rigpilot.engine.recipe import RECIPE_SETTINGS, TORCHTUNE_LOSS_CHUNKS
from rigpilot.engine.schema import MasterWeights, Optimizer

# (setting, the value that saves memory), in the order the search reaches for them. Its settings are those declared
# `searched` (engine.recipe), which is how the CLI's help and the app word a setting left open; a test holds them equal.
LADDER: tuple[tuple[str, Any], ...] = (
    ("loss_chunks", TORCHTUNE_LOSS_CHUNKS),
    ("master_weights", MasterWeights.BF16.value),
    ("optimizer", Optimizer.ADAMW8BIT.value),
    ("optimizer_in_backward", True),
    ("activation_offload", True),
    ("optimizer_offload", True),
)
FREE = frozenset({"loss_chunks"})
# A rung that takes the optimizer state to host memory steps there with CPU AdamW, each weight after the whole
# gradient is in: it replaces the 8-bit AdamW and the step in backward the rungs before it added (the engine
# refuses them together, engine.capability), unless the user pinned them.
SUPERSEDES: dict[str, tuple[str, ...]] = {"optimizer_offload": ("optimizer", "optimizer_in_backward")}


@dataclass(frozen=True)
class Rung:
    workload: Workload  # every recipe setting given (none left open)
    added: tuple[str, ...]  # the techniques the search added beyond what was asked, in LADDER's order

    @property
    def plain(self) -> bool:
        return not self.added

    @property
    def free(self) -> bool:
        """Only techniques that change neither the numerics nor what a step does."""
        return all(name in FREE for name in self.added)

    @property
    def level(self) -> int:
        """How far down the ladder it reaches: 0 as asked, else 1 + the last technique's place in LADDER."""
        return 1 + max((NAMES.index(n) for n in self.added), default=-1)


NAMES = tuple(name for name, _ in LADDER)


def techniques(w: Workload, decoder: bool = True) -> list[tuple[str, Any]]:
    """The ladder's techniques the search may add to `w`: not pinned, not already there, and not refused by the
    capability contract whatever the layout (bf16 master weights need bf16 compute; loss chunks split a `decoder`'s
    output head, which an encoder has none of). Refusals that depend on the layout are the search's, plan by plan."""
    if not w.training:
        return []
    base = recipe_of(w)
    pinned = w.pinned()
    ctx = RecipeContext(method=w.method, precision=w.precision, decoder=decoder)
    as_asked = recipe_why_not(base, Layout(), ctx)
    out = []
    for name, value in LADDER:
        if name in pinned or getattr(base, name) == value:
            continue
        why = recipe_why_not(dataclasses.replace(base, **{name: value}), Layout(), ctx)
        if why is not None and why != as_asked:
            continue
        out.append((name, value))
    return out


def rung(w: Workload, added: tuple[str, ...] = ()) -> Rung:
    """`w` with every recipe setting given (open ones at their defaults) and the techniques `added` applied."""
    if not w.training:
        return Rung(w, ())
    base = recipe_of(w)
    values = {name: getattr(base, name) for name in RECIPE_SETTINGS}
    dropped = {gone for name in added for gone in SUPERSEDES.get(name, ())}
    added = tuple(name for name in added if name not in dropped)
    values.update((name, value) for name, value in LADDER if name in added)
    return Rung(dataclasses.replace(w, **values), added)

