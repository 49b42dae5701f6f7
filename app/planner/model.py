"""The Planner page's view-model: what the form asks for, and a search result turned into rows and bars.

Plain Python over the engine's plan JSON (docs/cli-json.md): no Qt, so it is
tested without widgets and shared with the job wizard. The plans themselves come
from the engine's `plan` request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rigpilot.app.widgets import units
from rigpilot.engine.errors import UserError
from rigpilot.engine.planner.amounts import TIGHT_FILL
from rigpilot.engine.planner.cluster import DEFAULT_LINK, MAX_NODES, NODE_LINKS
from rigpilot.engine.planner.durations import duration_text
from rigpilot.engine.planner.plan import LoraSettings, Plan
from rigpilot.engine.planner.settings import OFFLOAD_CHOICES, PLAN_SETTINGS, QUANT_BITS
from rigpilot.engine.recipe import RECIPE_SETTINGS, AskedRecipe, open_words
from rigpilot.engine.schema import Precision, Style, TrainMethod, worded

GIB = 1024**3

# The parts of one GPU's memory, bottom of the stack first, as the plan JSON names them.
MEMORY_PARTS: list[tuple[str, str]] = [
    ("weights", "Weights"),
    ("gradients", "Gradients"),
    ("optimizer", "Optimizer state"),
    ("activations", "Activations"),
    ("kv_cache", "KV cache"),
    ("buffers", "Buffers"),
    ("overhead", "Overhead"),
]

TASKS = [("train", "Training"), ("infer", "Inference")]
# The values and their words are the settings' declarations (engine.planner.settings), so the planner's
# advice names these controls as they read; the order (most used first) is the Planner page's.
_P = PLAN_SETTINGS
METHODS = [(m.value, _P["method"].choice_word(m)) for m in (TrainMethod.FULL, TrainMethod.LORA, TrainMethod.QLORA)]
PRECISIONS = [(p.value, p.value) for p in (Precision.BF16, Precision.FP16, Precision.FP32)]
QUANTIZATION = [(bits, _P["quant"].choice_word(q)) for q, bits in QUANT_BITS.items()]
OFFLOAD = [(o, _P["offload"].choice_word(o)) for o in OFFLOAD_CHOICES]
FORCE_TP_TEXT = _P["force_tp"].label
# The links between nodes the planner knows (engine.planner.cluster.NODE_LINKS), fastest last.
NODE_LINK_CHOICES = [(key, link.label) for key, link in NODE_LINKS.items()]
NODES_MAX = MAX_NODES
# A recipe setting left open, as the Planner page's drop-downs hold it (the request's None: the `plan` request
# leaves it out, and the planner chooses it or keeps its default, as its declaration's `searched` says).
AUTO = "auto"
LOSS_CHUNK_CHOICES = (1, 2, 4, 8, 16, 32)


def recipe_values(name: str) -> list[tuple[Any, str]]:
    """The values a control offers for recipe setting `name`, in the app's words, from its declaration."""
    decl = RECIPE_SETTINGS[name]
    if decl.choices:
        return [(c, decl.choice_word(c)) for c in decl.choices]
    if decl.type is bool:
        return [(True, "On"), (False, "Off")]
    lo, hi = int(decl.lo), int(decl.hi)
    return [(n, f"{n}" + (" (all at once)" if n == decl.default else "")) for n in LOSS_CHUNK_CHOICES if lo <= n <= hi]


def open_text(name: str) -> str:
    """The Planner page's words for recipe setting `name` left open: "Auto: the planner chooses" where the search
    chooses it, else its default and that the planner keeps it ("Off: the planner never turns it on")."""
    value, meaning = open_words(name)
    return f"{value[:1].upper()}{value[1:]}: {meaning}"


def recipe_choices(name: str) -> list[tuple[Any, str]]:
    """The Planner page's choices for recipe setting `name`, from its declaration: open (AUTO) first, then its
    values; a setting the planner never chooses is its default when open, so that value is not offered twice."""
    decl = RECIPE_SETTINGS[name]
    values = recipe_values(name)
    if not decl.searched:
        values = [(v, text) for v, text in values if v != decl.default]
    return [(AUTO, open_text(name)), *values]


def recipe_choice(name: str, value: Any) -> Any:
    """The drop-down's data for `value` of recipe setting `name` (None: open); a setting the planner never
    chooses reads its default as open, the one choice that means it."""
    decl = RECIPE_SETTINGS[name]
    if value is None or value == AUTO or (not decl.searched and value == decl.default):
        return AUTO
    return value


@dataclass
class PlanRequest(AskedRecipe):
    """What the form asks the planner; `workload_args` is the `plan` request's `workload`. The training recipe
    is AskedRecipe's fields (engine.recipe): None leaves a setting open; a value pins it."""

    model: str
    task: str = "train"
    method: str = "full"
    precision: str = "bf16"
    seq_len: int = 2048
    batch: int = 16  # training: sequences per optimizer step; inference: sequences at once
    gpus: list[int] = field(default_factory=list)
    lora_rank: int = 16
    weight_bits: int = 16  # inference only
    new_tokens: int = 256  # inference only
    token_budget: int | None = None  # training: tokens to train on, for a predicted time to finish
    force_tp: bool = False  # SearchOptions.force_tp
    offload: str = "auto"  # SearchOptions.offload (training)
    nodes: int = 1  # SearchOptions.nodes: identical nodes like the machine planned for (training)
    internode: str = DEFAULT_LINK  # SearchOptions.internode: the link between them

    def problem(self) -> str | None:
        """What is wrong with the request before anything is asked, in the user's words."""
        if not self.model.strip():
            return "Choose a model: a preset, a local folder or a Hugging Face id."
        if not self.gpus:
            return "Select at least one GPU."
        if self.task == "infer" and self.new_tokens >= self.seq_len:
            return f"{self.new_tokens} new tokens leave no room for a prompt in {self.seq_len} tokens of context."
        return None

    def workload_args(self) -> dict[str, Any]:
        training = self.task == "train"
        method = self.method if training else "full"
        lora = None
        if training and method != "full":
            lora = dataclasses.asdict(LoraSettings(rank=self.lora_rank, alpha=2 * self.lora_rank))
        args = {
            "task": self.task,
            "method": method,
            "precision": self.precision,
            "seq_len": self.seq_len,
            "global_batch": self.batch,
            "lora": lora,
            "weight_bits": 16 if training else self.weight_bits,
            "new_tokens": 0 if training else self.new_tokens,
            "token_budget": self.token_budget if training and self.token_budget else None,
        }
        if training:
            args.update(self.pinned())  # only what is pinned: an older engine plans without them
        return args

    def options_args(self) -> dict[str, Any]:
        """The `plan` request's `options` (SearchOptions fields): only what differs from the defaults."""
        out: dict[str, Any] = {}
        if self.force_tp:
            out["force_tp"] = True
        if self.task == "train" and self.offload != "auto":
            out["offload"] = self.offload
        if self.task == "train" and self.nodes > 1:
            out["nodes"] = self.nodes
            out["internode"] = self.internode
        return out


# -- the planner's words, with the Planner page's controls for the settings it names ---------------------------


def planner_text(text: str, terms: Any) -> str:
    """A sentence of the planner's (a line of the explanation, a rejection's reason, a suggestion's change, a
    refusal) naming each setting by the control that sets it, from its `terms` (engine.schema.Words' JSON form);
    `text`, the command line's wording, where an older engine sent none."""
    return worded(str(text), terms, PLAN_SETTINGS, Style.APP)


def explanation_lines(result: dict[str, Any]) -> list[str]:
    lines = [str(line) for line in result.get("explanation") or []]
    terms = result.get("explanation_terms")
    if not isinstance(terms, list) or len(terms) != len(lines):
        terms = [None] * len(lines)
    return [planner_text(line, t) for line, t in zip(lines, terms, strict=True)]


def rejection_reason(rejection: dict[str, Any]) -> str:
    return planner_text(rejection.get("reason", ""), rejection.get("reason_terms"))


def change_text(suggestion: dict[str, Any]) -> str:
    return planner_text(suggestion.get("change", ""), suggestion.get("change_terms"))


SEQ_TOO_LONG = "seq_too_long"  # the refusal of a sequence longer than the model's context (its `limit`)


def context_to_fit(error: BaseException | None) -> int | None:
    """The model's context where `error` refused a sequence longer than it (the planner's, the engine's or the
    plan checker's `seq_too_long`, read from its fields), so "use the model's context" can be offered; else None."""
    if getattr(error, "reason", None) != SEQ_TOO_LONG:
        return None
    limit = (getattr(error, "fields", None) or {}).get("limit")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def gpu_label(m: dict[str, Any], memory: list[dict[str, Any]], *, short: bool = False) -> str:
    """'GPU 3', or on a multi-node plan 'node 2, GPU 3' ('n2:3' under a bar, where 16 of them share the width)."""
    if not any(x.get("node") for x in memory):
        return f"GPU {m['gpu']}"
    node = int(m.get("node") or 0) + 1
    return f"n{node}:{m['gpu']}" if short else f"node {node}, GPU {m['gpu']}"


# -- reading a search result -----------------------------------------------------------------------------------


@dataclass
class PlanRow:
    """One line of the ranked-plans table."""

    rank: str  # "best", "2", "3", ...
    family: str
    layout: str  # Parallelism.describe()
    gpus: str
    tokens_per_s: str
    step: str
    peak: str  # the fullest GPU: "21.4 / 24.0 GiB"
    to_budget: str
    fits: bool
    runs_here: str  # "yes", or why the engine cannot run it
    tight: bool = False  # fits, but fills more than TIGHT_FILL of its fullest GPU (ranked after roomier plans)


def plans_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The best plan and the runners-up, fastest first (empty when nothing fits)."""
    best = result.get("best")
    return ([best] if best else []) + list(result.get("runners_up") or [])


def plan_row(plan: dict[str, Any], rank: str) -> PlanRow:
    par = Plan.from_dict(plan).parallelism
    timing = plan.get("timing") or {}
    memory = plan.get("memory") or []
    peak = max(memory, key=lambda m: shown_total(m) / max(m["capacity"], 1), default=None)
    runs, why = plan_runs_here(plan)
    return PlanRow(
        rank=rank,
        family=par.family,
        layout=par.describe(),
        gpus=gpu_runs(par.gpu_indices) + (f" on each of {par.nodes} nodes" if par.nodes > 1 else ""),
        tokens_per_s=units.si(timing.get("tokens_per_s") or None),  # the table's header names the unit
        step=seconds(timing.get("step_s")),
        peak=f"{shown_total(peak) / GIB:.1f} / {peak['capacity'] / GIB:.1f} GiB" if peak else "n/a",
        to_budget=seconds(timing.get("time_to_budget_s")) if timing.get("time_to_budget_s") else "—",
        fits=all(m["headroom"] >= 0 for m in memory),
        runs_here="yes" if runs else (why or "no"),
        tight=peak is not None and peak["headroom"] >= 0 and shown_total(peak) / max(peak["capacity"], 1) > TIGHT_FILL,
    )


def gpu_runs(indices: list[int]) -> str:
    """GPU indices as runs: [0, 1, 2, 3] "0–3", [0, 2] "0, 2", [0, 1, 2, 5, 6, 7] "0–2, 5–7"."""
    runs: list[list[int]] = []
    for g in indices:
        if runs and g == runs[-1][-1] + 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def plan_runs_here(plan: dict[str, Any]) -> tuple[bool, str]:
    """(runs, why not) as the plan says: whether a job can run it on this engine. A plan from a planner
    that does not say is taken to run (the engine still checks it before launching)."""
    return bool(plan.get("runs_here", True)), str(plan.get("runs_here_reason") or "")


def plan_rows(result: dict[str, Any]) -> list[PlanRow]:
    return [plan_row(p, "best" if i == 0 else str(i + 1)) for i, p in enumerate(plans_of(result))]


def memory_stack(memory: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per part, GiB on each GPU in the plan's order: the heights of the stacked bars."""
    return {key: [m[key] / GIB for m in memory] for key, _ in MEMORY_PARTS}


def summary_lines(plan: dict[str, Any]) -> list[str]:
    """Prediction headlines of one plan: speed, step time, time to finish, the fullest GPU."""
    timing = plan.get("timing") or {}
    work = plan.get("workload") or {}
    training = work.get("task", "train") == "train"
    lines = [Plan.from_dict(plan).parallelism.describe()]
    speed = f"Predicted {tokens_per_s(timing.get('tokens_per_s'), training)}"
    if training:
        speed += f", {seconds(timing.get('step_s'))} per optimizer step"
    else:
        speed += f", first token after {seconds(timing.get('prefill_s'))}"
    if timing.get("mfu"):
        speed += f", {100 * timing['mfu']:.0f}% of peak compute"
    lines.append(speed)
    if timing.get("time_to_budget_s"):
        lines.append(f"About {seconds(timing['time_to_budget_s'])} to train on the token budget")
    memory = plan.get("memory") or []
    if memory:
        peak = max(memory, key=lambda m: shown_total(m) / max(m["capacity"], 1))
        lines.append(
            f"Fullest GPU: GPU {peak['gpu']} holds {shown_total(peak) / GIB:.1f} of {peak['capacity'] / GIB:.1f} GiB"
            + (f" ({peak['headroom'] / GIB:.1f} GiB free)" if peak["headroom"] >= 0 else " — does not fit")
        )
        lines.append(memory_figures(plan, peak))
    if training and plan.get("recipe"):
        lines.append(f"Recipe: {plan['recipe']}")  # the planner's words for the recipe the plan is sized for
    return lines


def shown_total(m: dict[str, Any]) -> int:
    """The larger of the formula's and the traced figure of one GPU (MemoryBreakdown.shown_total)."""
    return max(int(m["total"]), int(m.get("traced") or 0))


def memory_figures(plan: dict[str, Any], m: dict[str, Any]) -> str:
    """'Memory: formula 12.4 GiB · traced 13.1 GiB', or the formula with why it was not traced."""
    formula = f"Memory: formula {m['total'] / GIB:.1f} GiB"
    if m.get("traced") is not None:
        return f"{formula} · traced {m['traced'] / GIB:.1f} GiB"
    why = plan.get("verification") or ""  # untraced: empty, or why not ("not verified: …"), as the CLI shows it
    return formula + (f" ({why})" if why else "")


def tokens_per_s(v: float | None, training: bool = True) -> str:
    return units.si(v or None, "tokens/s" if training else "generated tokens/s")


def seconds(v: float | None) -> str:
    """A predicted time as the planner's explanation words it (the two stand side by side)."""
    return "n/a" if v is None else duration_text(v)


def error_text(error: BaseException) -> str:
    """One line for an inline message, whatever failed (an engine error, a UserError, a bug)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(error, UserError):
        if first and "\n" not in text:  # a refusal that names settings: by their controls here
            first = planner_text(first, (getattr(error, "fields", None) or {}).get("terms"))
        return first or type(error).__name__
    # Not the user's mistake: name the exception so a bug report says what broke.
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
