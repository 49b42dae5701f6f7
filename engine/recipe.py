"""`Recipe`: how a training job spends its memory and time, beside how its ranks are laid out (engine.layout).

The field's everyday memory recipe (torchtune's names where they exist): bf16 master weights ("pure bf16"),
8-bit AdamW, the optimizer step in backward, chunked cross-entropy, activation offloading, the optimizer
state in host memory (torchtune's paged AdamW), torch.compile of each
block and FP8 matmuls. Each is declared once here; the job's settings (engine.jobspec.spec.TrainSettings, flat
in job.json's `train` object), the command line and the app's controls take these declarations; the planner's
workload, the re-check's overrides and the Planner page's request inherit `AskedRecipe`, their open form (None: not
given). A declaration's `searched` says whether the planner's search chooses a setting left open (the settings of
engine.planner.recipes.LADDER); the CLI's help and the app word "left open" from it (`open_words`). What
combinations the engine runs is `engine.capability.recipe_why_not`, the one answer.

Plain Python: the GUI, the CLI and the planner import it without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, get_type_hints

from rigpilot.engine.schema import MasterWeights, Optimizer, Precision, Range, Setting, declared, setting, shown_value

MAX_LOSS_CHUNKS = 1024
TORCHTUNE_LOSS_CHUNKS = 8  # torchtune's CEWithChunkedOutputLoss default


@dataclass(frozen=True)
class Recipe:
    """The recipe settings of one training job; the defaults are the engine's plain recipe (fp32 master weights
    under mixed precision, AdamW, eager, the whole logits at once, activations kept on the GPU)."""

    master_weights: str = setting(
        MasterWeights.FP32,
        searched=True,
        flags="--master-weights",
        choices=MasterWeights,
        requires={MasterWeights.BF16: {"precision": Precision.BF16}},
        label="Master weights",
        help="The dtype of the weights, gradients and optimizer state: bf16 halves their memory, as torchtune does.",
        choice_words={MasterWeights.FP32: "fp32 (mixed precision)", MasterWeights.BF16: "bf16 (pure bf16)"},
    )
    optimizer: str = setting(
        Optimizer.ADAMW,
        searched=True,
        flags="--optimizer",
        choices=Optimizer,
        label="Optimizer",
        help="AdamW, or 8-bit AdamW (torchao), whose two state tensors take a quarter of the memory.",
        choice_words={Optimizer.ADAMW: "AdamW", Optimizer.ADAMW8BIT: "8-bit AdamW"},
    )
    optimizer_in_backward: bool = setting(
        False,
        searched=True,
        flags="--optimizer-in-backward",
        label="Optimizer step in backward",
        help="Update each weight as soon as its gradient is ready, so the whole gradient never exists at once "
        "(no gradient accumulation or clipping).",
    )
    loss_chunks: int = setting(
        1,
        searched=True,
        flags="--loss-chunks",
        range=Range(1, MAX_LOSS_CHUNKS),
        metavar="N",
        label="Loss chunks",
        help=f"Compute the output logits and their loss this many pieces at a time, so the whole fp32 logits "
        f"never exist ({TORCHTUNE_LOSS_CHUNKS} is torchtune's; 1: all at once).",
    )
    activation_offload: bool = setting(
        False,
        searched=True,
        flags="--activation-offload",
        label="Activation offloading",
        help="Keep the activations saved for backward in host memory instead of on the GPU.",
    )
    optimizer_offload: bool = setting(
        False,
        searched=True,
        flags="--optimizer-offload",
        label="Optimizer state in host memory",
        help="Keep AdamW's state, the master weights and the gradients in host memory: the weights stay on the "
        "GPU, each gradient goes to the host as soon as it is ready and the optimizer step runs on the CPU "
        "(the memory effect of torchtune's paged AdamW).",
    )
    compile: bool = setting(
        False,
        flags="--compile",
        label="Compile",
        help="torch.compile each transformer block: faster steps after a warm-up of a minute or so.",
    )
    fp8: bool = setting(
        False,
        flags="--fp8",
        requires={"True": {"precision": Precision.BF16}},
        label="FP8 matmuls",
        help="Run the linear layers' matmuls in FP8 (torchao float8): needs a GPU of compute capability 8.9+.",
    )

    @classmethod
    def of(cls, values: Any) -> Recipe:
        """The recipe of `values`: any object with these attributes (a job's TrainSettings, a plan's workload)."""
        return cls(**{name: getattr(values, name) for name in RECIPE_SETTINGS if hasattr(values, name)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def changed(self) -> dict[str, Any]:
        """The settings that differ from the plain recipe, by name."""
        return {k: v for k, v in self.to_dict().items() if v != RECIPE_SETTINGS[k].default}

    @property
    def plain(self) -> bool:
        return not self.changed()


RECIPE_SETTINGS: dict[str, Setting] = declared(Recipe, "train")
# Today's recipe before issue 28 (fp32 master weights, plain AdamW, full logits, eager): the baseline plans are compared with.
PLAIN_RECIPE: dict[str, Any] = {name: decl.default for name, decl in RECIPE_SETTINGS.items()}


@dataclass(kw_only=True)
class AskedRecipe:
    """The recipe as a user asks for it: each setting a value, which pins it, or None, left open (the planner's
    search chooses a `searched` one and leaves the others at their defaults; a job keeps its own). The planner's
    workload, the re-check's overrides and the Planner page's request inherit these fields, so they travel flat
    by the declarations' names (plan JSON, the `plan` request) and are written out here alone, beside `Recipe`:
    a type checker needs them spelt out, and `check_open_form` refuses to import a copy that drifted."""

    master_weights: str | None = None
    optimizer: str | None = None
    optimizer_in_backward: bool | None = None
    loss_chunks: int | None = None
    activation_offload: bool | None = None
    optimizer_offload: bool | None = None
    compile: bool | None = None
    fp8: bool | None = None

    def pinned(self) -> dict[str, Any]:
        """The recipe settings given a value, by name: the search leaves these alone."""
        return {name: getattr(self, name) for name in RECIPE_SETTINGS if getattr(self, name) is not None}


def check_open_form(cls: type) -> None:
    """Refuse (TypeError) an open form of the recipe whose fields are not the declarations', each `| None`."""
    asked = get_type_hints(cls)
    wanted = {name: decl.type | None for name, decl in RECIPE_SETTINGS.items()}
    if asked != wanted:
        raise TypeError(f"{cls.__name__}'s fields {asked} are not Recipe's declarations, each open: {wanted}")


check_open_form(AskedRecipe)  # at import: a copy that drifted never runs


def open_words(name: str) -> tuple[str, str]:
    """What recipe setting `name` left open becomes, from its declaration's `searched`: ("auto", "the planner
    chooses"), or its default and that the planner keeps it ("off", "the planner never turns it on"). The CLI's
    help and the Planner page's first choice are both worded from it, so neither knows the rule on its own."""
    decl = RECIPE_SETTINGS[name]
    if decl.searched:
        return "auto", "the planner chooses"
    if decl.type is bool and decl.default is False:
        return "off", "the planner never turns it on"
    return shown_value(decl, decl.default), "the planner never changes it"


def recipe_field(name: str) -> Any:
    """A dataclass field declared by the recipe's declaration of `name`: how TrainSettings takes them (flat in
    job.json's `train` object) without a second declaration."""
    decl = RECIPE_SETTINGS[name]
    return dataclasses.field(default=decl.default, metadata={"setting": dataclasses.replace(decl, key="")})
