"""Plain-language explanation of a search: the plan, why it wins on this machine, what was rejected."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

from rigpilot.engine.hardware.machine import short_gpu_name
from rigpilot.engine.planner.amounts import fmt_gib, gib_pair
from rigpilot.engine.planner.durations import duration_text
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.model import ModelFacts
from rigpilot.engine.planner.plan import Figure, Parallelism, Plan, Timing, Workload, recipe_words
from rigpilot.engine.planner.result import HOST_MEMORY, Candidate, SearchResult, leanest, memory_limit
from rigpilot.engine.planner.settings import ref, say
from rigpilot.engine.recipe import PLAIN_RECIPE

_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")


def number_word(n: int) -> str:
    return _WORDS[n] if 0 <= n < len(_WORDS) else str(n)


def params_text(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e7:
        return f"{n / 1e6:.0f}M"
    if n >= 1e5:  # small test models: "0.2M", not "0M"
        return f"{n / 1e6:.1f}M"
    return f"{n:,}"


def task_text(w: Workload) -> str:
    if not w.training:
        bits = {16: w.precision, 8: "int8", 4: "4-bit NF4"}[w.weight_bits]
        return f"inference in {bits}"
    prec = "fp32" if w.precision == "fp32" else f"{w.precision} mixed precision"
    if w.master_weights == "bf16" and w.precision == "bf16":
        prec = "bf16 with bf16 master weights"
    elif w.master_weights is None and w.precision != "fp32":
        prec = w.precision  # the recipe is the search's to choose; the plan's sentence says which it took
    if w.method == "full":
        return f"full fine-tuning in {prec}"
    lora = w.lora
    rank = f"rank {lora.rank}" if lora else "LoRA"
    targets = f", {len(lora.targets)} target linears" if lora else ""
    name = "QLoRA (4-bit base)" if w.method == "qlora" else "LoRA"
    return f"{name} fine-tuning ({rank}{targets}) in {prec}"


def gpus_text(topo: Topology, indices: list[int]) -> str:
    """'four RTX 4090', 'one RTX 4090 and one RTX 3090'."""
    names = Counter(short_gpu_name(topo.machine.gpu(i).name) for i in indices)
    parts = [f"{number_word(n)} {name}" for name, n in names.items()]
    return " and ".join(parts)


def links_text(topo: Topology, indices: list[int]) -> str:
    """How the selected GPUs are wired, in words."""
    if len(indices) < 2:
        return ""
    kinds: Counter[str] = Counter()
    nv_pairs = []
    for ai, a in enumerate(indices):
        for b in indices[ai + 1 :]:
            link = topo.link(a, b)
            kinds[link.kind] += 1
            if link.kind == "nvlink":
                nv_pairs.append(f"{a}–{b}")
    total = sum(kinds.values())
    if kinds["nvswitch"] == total:
        link = topo.link(indices[0], indices[1])
        return f"are all joined by {link.label}, about {link.gbs:.0f} GB/s each way per GPU"
    if kinds["nvlink"] == total:
        link = topo.link(indices[0], indices[1])
        return f"are joined by {link.label}, about {link.gbs:.0f} GB/s each way"
    if kinds["nvlink"]:
        return f"are NVLink-bridged only in pairs ({', '.join(nv_pairs)}); other pairs cross PCIe"
    if kinds["host"] + kinds["sys"] == total:
        sys_note = " and sit on two CPU sockets" if kinds["sys"] else ""
        slow = min((topo.link(a, b) for ai, a in enumerate(indices) for b in indices[ai + 1 :]), key=lambda x: x.gbs)
        return f"have no P2P{sys_note}: their traffic goes through host memory at about {slow.gbs:.0f} GB/s"
    slow = min((topo.link(a, b) for ai, a in enumerate(indices) for b in indices[ai + 1 :]), key=lambda x: x.gbs)
    return f"talk over PCIe; the slowest hop is {slow.label} at about {slow.gbs:.0f} GB/s"


def plan_summary(plan: Plan) -> str:
    t = plan.timing
    w = plan.workload
    if w.training:
        return f"{plan.parallelism.describe()}: {t.tokens_per_s:,.0f} tokens/s, {duration_text(t.step_s)} per step"
    return f"{plan.parallelism.describe()}: {t.tokens_per_s:,.0f} generated tokens/s"


def host_ram_owner(simulated: bool) -> str:
    """Whose RAM a plan's host figure is: a simulated profile's is not the RAM of the host its CPU ranks use."""
    return "the simulated machine's " if simulated else ""


def explain(
    result: SearchResult,
    cands: list[Candidate],
    topo: Topology,
    m: ModelFacts,
    timing_of: Callable[[Parallelism], Timing],
    gpus: list[int] | None = None,
    recipe_of: Callable[[Candidate], str] | None = None,
) -> list[str]:
    """`gpus`: the GPUs to describe as "your GPUs" in `topo`'s numbering (a multi-node search: one node's);
    `recipe_of`: a candidate's training recipe in words (the search's ladder), for the leanest plan's line."""
    w = result.workload
    lines: list[str] = []
    gpus = gpus or result.gpu_indices
    who = gpus_text(topo, gpus)
    if result.nodes > 1:
        who = f"{number_word(result.nodes)} nodes of {who} each"
    model = f"{m.spec.id or m.spec.model_type} ({params_text(m.params)} parameters)"
    best = result.best
    if best is None:
        closest = leanest(cands)
        line = f"Nothing fits for {task_text(w)} of {model} on your {who}"
        limit = memory_limit(closest) if closest is not None else None
        if closest is not None and limit is not None:
            with_recipe = f" with {recipe_of(closest)}" if recipe_of is not None and closest.recipe else ""
            if limit.code == HOST_MEMORY:
                need, have = gib_pair(limit.need_bytes, limit.have_bytes or 0)
                line += (
                    f": the leanest plan ({closest.par.describe()}{with_recipe}) fits its GPUs but needs "
                    f"{need} of host RAM and "
                    f"{'the simulated' if topo.machine.simulated else 'this'} machine has {have}"
                )
            else:
                line += (
                    f": even the leanest plan ({closest.par.describe()}{with_recipe}) needs "
                    f"{fmt_gib(closest.worst_total)} per GPU and you have {fmt_gib(closest.worst_capacity)}"
                )
        lines.append(line + ".")
        for s in result.suggestions:
            lines.append(say("It fits if you {change}: {summary}.", change=s.change, summary=plan_summary(s.plan)))
        if not result.suggestions:
            lines.append("No single change tried (LoRA, QLoRA, shorter sequences, more or larger GPUs) makes it fit.")
    else:
        par = best.parallelism
        recipe = ""
        if best.workload.training and recipe_words(best.workload) != recipe_words(dataclasses.replace(best.workload, **PLAIN_RECIPE)):
            recipe = f", with {recipe_words(best.workload)}"
        if best.runs_here:
            lines.append(f"Best plan for {task_text(w)} of {model} on your {who}: {par.describe()}{recipe}.")
        else:
            lines.append(
                f"No plan that fits for {task_text(w)} of {model} on your {who} is one Rigpilot's engine runs. "
                f"The fastest, {par.describe()}, cannot run here: {best.runs_here_reason}."
            )
            for s in result.suggestions:
                lines.append(say("It runs if you {change}: {summary}.", change=s.change, summary=plan_summary(s.plan)))
        lines.append(_timing_line(best))
        lines.append(_memory_line(best))
        if best.host.offloaded:
            lines.append(
                f"Host RAM: {fmt_gib(best.host.needed)} needed of {host_ram_owner(topo.machine.simulated)}"
                f"{fmt_gib(best.host.available or 0)}, "
                f"{fmt_gib(best.host.offloaded)} of it offloaded state."
            )
    if best is not None and best.runs_here:
        lines.extend(_passed_over(best, cands))
    lines.extend(_topology_lines(result, cands, topo, timing_of, gpus))
    if best is not None and not w.training:
        lines.extend(_tensor_parallel_pays(best, cands, topo.machine.simulated))
    for r in result.rejected:
        lines.append(say("Rejected {family}: {reason}.", family=r.family, reason=r.reason))
    if best is not None:
        lines.append(_figures_line(best))
    return [x for x in lines if x]


def _passed_over(best: Plan, cands: list[Candidate]) -> list[str]:
    """The fastest fitting plan the engine cannot run, when it would have beaten the best one."""
    faster = [
        c for c in cands
        if c.fits and not c.blocked and not c.runs_here and c.tokens_per_s > best.timing.tokens_per_s * 1.01
    ]  # fmt: skip
    if not faster:
        return []
    c = max(faster, key=lambda x: x.tokens_per_s)
    unit = "tokens/s" if best.workload.training else "generated tokens/s"
    return [
        f"Passed over a faster plan ({c.par.describe()}, {c.tokens_per_s:,.0f} {unit}): "
        f"the engine cannot run it ({c.cannot_run})."
    ]


def _tensor_parallel_pays(best: Plan, cands: list[Candidate], simulated: bool) -> list[str]:
    """Inference: whether splitting layers (TP) beats the best plan without it, in generated tokens/s.

    A decode step all-reduces every layer's output twice for one token's worth of work: TP pays on
    NVLink or NVSwitch when one GPU's memory bandwidth is the limit, and loses over PCIe or the host.
    """
    runnable = [c for c in cands if c.fits and not c.blocked and c.runs_here and c.timing]
    with_tp = max((c for c in runnable if c.par.tp > 1), key=lambda c: c.tokens_per_s, default=None)
    without = max((c for c in runnable if c.par.tp == 1), key=lambda c: c.tokens_per_s, default=None)
    lines: list[str] = []
    if with_tp is not None and without is not None and without.tokens_per_s > 0:
        ratio = with_tp.tokens_per_s / without.tokens_per_s
        if best.parallelism.tp > 1:
            lines.append(
                f"Tensor parallel pays here: {ratio:.2f}x the generated tokens/s of the best plan without it "
                f"({without.par.describe()})."
            )
        else:
            lines.append(
                f"Tensor parallel does not pay here: its best plan ({with_tp.par.describe()}) would give "
                f"{ratio:.2f}x the generated tokens/s of this one, its all-reduces costing more than they save."
            )
    if simulated and any(c.par.tp > 1 for c in cands):
        # Measured with benchmarks/inference_speed.py: TP2 over gloo on CPU ranks runs at a fraction of
        # one rank's speed, however the modelled GPUs are linked.
        lines.append(
            "On this simulated machine the ranks are CPU processes linked by gloo: there tensor parallel is "
            "slower than one rank (every layer waits for two all-reduces per token); pipeline or data "
            "parallel keeps its speed."
        )
    return lines


def _timing_line(plan: Plan) -> str:
    t, w = plan.timing, plan.workload
    if not w.training:
        return (
            f"Predicted {duration_text(t.prefill_s)} to the first token, then {duration_text(t.decode_token_s)} per token: "
            f"{t.tokens_per_s:,.0f} generated tokens/s for {w.global_batch} sequence{'s' if w.global_batch > 1 else ''}."
        )
    parts = [f"compute {duration_text(t.compute_s)}"]
    if t.exposed_comm_s > 0:
        parts.append(f"exposed communication {duration_text(t.exposed_comm_s)} ({t.exposed_comm_s / t.step_s:.0%})")
    if t.bubble_s > 0:
        parts.append(f"pipeline bubble {duration_text(t.bubble_s)} ({t.bubble_s / t.step_s:.0%})")
    if t.offload_s > 0:
        what = "CPU offload" if plan.parallelism.offload or not w.recipe.optimizer_offload else "host optimizer"
        parts.append(f"{what} {duration_text(t.offload_s)} ({t.offload_s / t.step_s:.0%})")
    line = (
        f"Predicted {duration_text(t.step_s)} per step of {w.global_batch} × {w.seq_len} tokens, "
        f"{t.tokens_per_s:,.0f} tokens/s at {t.mfu:.0%} MFU ({', '.join(parts)})."
    )
    if t.time_to_budget_s:
        line += f" {w.token_budget:,} tokens take about {duration_text(t.time_to_budget_s)}."
    return line


def _memory_line(plan: Plan) -> str:
    mb = plan.peak_memory
    parts = [
        ("weights", mb.weights), ("gradients", mb.gradients), ("optimizer", mb.optimizer),
        ("activations", mb.activations), ("KV cache", mb.kv_cache), ("buffers", mb.buffers), ("overhead", mb.overhead),
    ]
    listed = ", ".join(f"{name} {fmt_gib(v)}" for name, v in parts if v > 0)
    return (
        f"Fullest GPU (GPU {mb.gpu}): {fmt_gib(mb.total)} of {fmt_gib(mb.capacity)} ({listed}); "
        f"{fmt_gib(mb.headroom)} to spare."
    )


def _topology_lines(
    result: SearchResult, cands: list[Candidate], topo: Topology, timing_of: Callable[[Parallelism], Timing],
    gpus: list[int],
) -> list[str]:
    if len(gpus) < 2:
        return []
    who = gpus_text(topo, gpus)
    wiring = links_text(topo, gpus)
    lines: list[str] = []
    blocked_tp = [c for c in cands if c.blocked and c.par.tp > 1]
    allowed_tp = max((c.par.tp for c in cands if not c.blocked), default=1)
    if blocked_tp:
        # What tensor parallelism over the slow links would have cost, from its best evaluated plan.
        fitting = [c for c in blocked_tp if c.fits and c.timing]
        c = max(fitting, key=lambda x: x.tokens_per_s) if fitting else min(blocked_tp, key=lambda x: x.worst_total)
        t = c.timing or timing_of(c.par)
        tp_item = next((x for x in t.comm if x.what.startswith("tensor-parallel")), None)
        share = (tp_item.exposed_seconds if tp_item else t.exposed_comm_s) / t.step_s if t.step_s else 0.0
        link = topo.collective(_tp_groups(c.par))
        where = "the CPU" if link.kind in ("host", "sys") else link.label
        if allowed_tp > 1:
            lines.append(
                f"Your {who} {wiring}. Tensor parallelism stays within groups of {allowed_tp}: over "
                f"{c.par.tp} GPUs its all-reduces would cross {where}, about {share:.0%} of a step."
            )
        else:
            lines.append(say(
                "Your {who} {wiring}, so every tensor-parallel all-reduce would cross {where}: about {share:.0%} of a "
                "step; tensor parallelism was left out ({force_tp} allows it).",
                who=who, wiring=wiring, where=where, share=share, force_tp=ref("force_tp"),
            ))  # fmt: skip
        who = "The plan's GPUs"
        wiring = ""
    best = result.best
    if best is not None and best.timing.comm:
        main = max(best.timing.comm, key=lambda x: x.seconds)
        t = best.timing
        unit = "step" if result.workload.training else "generation"
        share = main.exposed_seconds / t.step_s if t.step_s else 0.0
        if main.exposed_seconds >= 0.95 * main.seconds:
            tail = f"none of it overlaps compute ({share:.0%} of the {unit})"
        elif share > 0.05:
            tail = f"{share:.0%} of the {unit} waits for them"
        else:
            tail = f"all but {duration_text(main.exposed_seconds)} hides behind compute"
        lead = f"Your {who} {wiring}; the" if wiring else "The"
        lines.append(f"{lead} {main.what} take {duration_text(main.seconds)} per {unit} over {main.link}, and {tail}.")
    elif wiring:
        lines.append(f"Your {who} {wiring}.")
    return lines


def _tp_groups(par: Parallelism) -> list[list[int]]:
    g, tp = par.gpu_indices, par.tp
    return [g[i : i + tp] for i in range(0, len(g), tp)]


def _figures_line(plan: Plan) -> str:
    measured = [f for f in plan.timing.figures if f.source == "measured"]
    assumed = [f for f in plan.timing.figures if f.source != "measured"]

    def show(f: Figure) -> str:
        unit = f" {f.unit}" if f.unit else ""
        return f"{f.name} {f.value:g}{unit} ({f.source})"

    parts = []
    if measured:
        parts.append("measured: " + "; ".join(show(f) for f in measured))
    if assumed:
        parts.append("from the spec table and priors: " + "; ".join(show(f) for f in assumed))
    return "Numbers used — " + " | ".join(parts) + "." if parts else ""
