"""`rigpilot plan`'s settings, each declared once (engine.schema), and the planner's sentences that name them.

The planner's advice and refusals name settings, never flags (`say`, `refusal`): the command line words them
by flag and the app by the label of the control that sets them (engine.schema.worded), both from the
declarations here. The settings `rigpilot run train` shares (sequence length, precision, method, LoRA rank)
are the job's own declarations (engine.jobspec.spec), with the planner's spellings where they differ; so is the GPUs one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rigpilot.engine.errors import GENERIC, UserError
from rigpilot.engine.jobspec.spec import JOB_SETTINGS, TRAIN_SETTINGS
from rigpilot.engine.recipe import RECIPE_SETTINGS
from rigpilot.engine.schema import Choice, Optimizer, Range, Ref, Setting, TrainMethod, Words, declared, setting, words

OFFLOAD_CHOICES = ("auto", "on", "off")  # SearchOptions.offload
EXPORTS = ("torchrun", "accelerate", "deepspeed", "slurm")  # what a plan exports to (engine.planner.export)
QUANT_BITS = {"none": 16, "int8": 8, "4bit": 4}  # `--quant` and the bits of the weights it loads
OPTIMIZERS = tuple(Optimizer)  # the engine runs each (engine.recipe)
MAX_BATCH = 2**20  # sequences per step
MAX_TOKEN_BUDGET = 10**16
MAX_NODES = 64
DEFAULT_LINK = "100gbe"


# The planner's own settings: the search's options and the workload's figures `rigpilot run` has no flag for.
@dataclass
class PlanSettings:
    batch: int | None = setting(
        None,
        flags="--batch",
        range=Range(1, MAX_BATCH),
        metavar="N",
        label="Batch",
        help="Training: sequences per optimizer step (default 16); inference: sequences at once (default 1).",
    )
    quant: str = setting(
        "none",
        flags="--quant",
        choices=tuple(QUANT_BITS),
        label="Weights",
        help="Inference: load weights in 8 bits or 4-bit NF4.",
        choice_words={"none": "16-bit (the dtype)", "int8": "8-bit (LLM.int8)", "4bit": "4-bit (NF4)"},
    )
    new_tokens: int | None = setting(
        None,
        flags="--new-tokens",
        range=Range(1, 2**21),
        metavar="N",
        label="New tokens",
        help="Inference: tokens generated per sequence.",
        default_words="256",
    )
    tokens: float | None = setting(
        None,
        flags="--tokens",
        range=Range(0, MAX_TOKEN_BUDGET, lo_open=True),
        metavar="N",
        label="Train on",
        help="Training: token budget, for a time to finish (e.g. 1e9).",
    )
    force_tp: bool = setting(
        False,
        flags="--force-tp",
        label="Allow tensor parallelism over slow links",
        help="Consider tensor parallelism over slow links too when training (inference weighs it by predicted speed).",
    )
    offload: str = setting(
        "auto",
        flags="--offload",
        choices=OFFLOAD_CHOICES,
        label="CPU offload",
        help="Training: CPU offload only where nothing else fits (auto), always (on) or never (off).",
        choice_words={"auto": "Auto: only where nothing else fits", "on": "On: always", "off": "Off: never"},
    )
    nodes: int = setting(
        1,
        flags="--nodes",
        range=Range(1, MAX_NODES),
        metavar="N",
        label="Nodes",
        help=f"Plan for up to N identical nodes like this machine (1 to {MAX_NODES}); TP stays inside a node.",
    )
    internode: str = setting(
        DEFAULT_LINK,
        flags="--internode",
        metavar="LINK",
        label="Link between nodes",
        help="The link between nodes: a named network or a measured bandwidth in GB/s.",
    )
    export: str | None = setting(
        None,
        flags="--export",
        choices=EXPORTS,
        label="Export",
        help="Print the best plan as a launcher config.",
        choice_words={"torchrun": "torchrun", "accelerate": "Accelerate", "deepspeed": "DeepSpeed", "slurm": "SLURM"},
    )


def _shared() -> dict[str, Setting]:
    """The job's declarations of the settings `plan` shares with `run train`."""
    method = TRAIN_SETTINGS["method"]
    return {
        "seq_len": TRAIN_SETTINGS["seq_len"],
        # `run train` spells it --precision; the planner's --dtype came first and is the one it shows.
        "precision": dataclasses.replace(TRAIN_SETTINGS["precision"], flags=("--dtype", "--precision")),
        # The training recipe (engine.recipe): left out, the search chooses it; given, it is pinned.
        **{name: TRAIN_SETTINGS[name] for name in RECIPE_SETTINGS},
        # The planner plans fine-tuning: every method but training from scratch.
        "method": dataclasses.replace(method, bound=Choice(tuple(m for m in method.choices or () if m != TrainMethod.SCRATCH))),
        "lora_rank": dataclasses.replace(TRAIN_SETTINGS["lora_rank"], flags=("--lora-rank",), metavar="R"),
        "gpus": JOB_SETTINGS["gpus"],
    }


# Every setting of `rigpilot plan` a sentence may name, by its option's dest (a suggestion's `setting`).
PLAN_SETTINGS: dict[str, Setting] = {**_shared(), **declared(PlanSettings, "plan")}


def say(template: str, /, **slots: Any) -> Words:
    """One of the planner's sentences: `template` names settings through slots filled with `Ref`s of
    PLAN_SETTINGS (see engine.schema.words); its str is the command line's wording."""
    return words(PLAN_SETTINGS, template, **slots)


def refusal(template: str, /, reason: str = GENERIC, fields: dict[str, Any] | None = None, **slots: Any) -> UserError:
    """A UserError whose sentence names settings: its `terms` field lets a client word them its own way."""
    said = say(template, **slots)
    return UserError(str(said), reason=reason, **(fields or {}), terms=said.terms())


def sentence_of(e: UserError) -> str:
    """A refusal's sentence, as the `Words` it was made from where it names settings (its `terms` field)."""
    terms = e.fields.get("terms")
    if not isinstance(terms, dict) or not isinstance(terms.get("refs"), dict):
        return str(e)
    refs = {slot: Ref(r["setting"], r.get("value")) for slot, r in terms["refs"].items()}
    return Words(str(e), str(terms.get("template", str(e))), refs)


def ref(setting_name: str, value: Any = None) -> Ref:
    """A PLAN_SETTINGS setting named in a sentence (checked here, so a misspelt name fails where it is written)."""
    if setting_name not in PLAN_SETTINGS:
        raise KeyError(f"{setting_name} is not a declared `rigpilot plan` setting")
    return Ref(setting_name, value)
