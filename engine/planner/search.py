"""Search: every valid way to split a workload over the selected GPUs, ranked by predicted throughput and headroom.

Training enumerates (tp, pp, dp) factorizations, the FSDP2 forms the engine runs
(full sharding and HSDP, ZeRO-2 as FSDP2 without resharding after forward, CPU
offload as FSDP2's CPUOffloadPolicy), activation checkpointing and micro-batch
(with gradient accumulation filling the global batch); DeepSpeed's ZeRO stages
and optimizer-only offload only for --export deepspeed. Pipelines use 1F1B and
tensor parallelism sequence parallel: the alternatives (GPipe, plain TP) cost the
same time and hold more memory, so they never win. An offloading plan is only
tried where the same split without offload does not fit. Training keeps tensor
parallelism inside groups of GPUs joined by NVLink or by P2P behind one PCIe
switch unless forced (a step's all-reduces carry whole activations); the plans it
would give elsewhere are still evaluated, so the explanation can say what they
would have cost. Inference tries it over any link and lets the step-time model
decide: a decode step all-reduces one token's hidden state, and where one GPU's
memory bandwidth binds, TP2 can win even through host memory (the explanation
gives the ratio and the all-reduces' share). Mixed GPUs: the smallest card
binds every symmetric plan (each GPU is checked against its own memory) and
pipelines give each stage layers in proportion to its memory.

Ranking (`rank`): the model's speeds are good to about 5%, so among plans that close the one with the
most free memory wins, and offload is recommended only where the best plan without it is more than
15% slower.

The training recipe (engine.planner.recipes): each layout gets the first recipe of the ladder that fits it
(mixed precision, chunked cross-entropy, pure bf16, 8-bit AdamW, the optimizer step in backward, activation
offloading; settings the user pinned stay as given), not a cross product. Recipes that change the numerics or
the step are kept only at the plainest rung any plan without CPU offload needs, so pure bf16 is never chosen
to make a plan faster where mixed precision fits, and CPU offload is tried only where no recipe without it fits.

Every candidate is judged by the engine's one capability contract,
`rigpilot.engine.capability.why_not` of `Layout.from_plan(plan)`: plans the engine cannot run
rank below all those it runs and carry the reason (`Plan.runs_here_reason`).
Plans that do not fit are dropped; for each family with no fitting plan the
result says what its smallest configuration needs. When nothing fits, the
smallest changes that would make it fit are tried by re-running the search.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rigpilot.engine.capability import RecipeContext, recipe_why_not
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import P2P, GpuPair, Machine, PciePath, short_gpu_name
from rigpilot.engine.hardware.specs import match_spec
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
from rigpilot.engine.layout import MICROBATCH_RANGE, Layout
from rigpilot.engine.models.spec import ModelSpec
from rigpilot.engine.planner.amounts import TIGHT_FILL, fmt_gib, gib_pair
from rigpilot.engine.planner.cluster import DEFAULT_LINK, Cluster, build_cluster, check_nodes, node_link
from rigpilot.engine.planner.explain import explain, number_word
from rigpilot.engine.planner.links import Calibration, Topology, no_bf16
from rigpilot.engine.planner.memory import (
    GIB,
    OFFLOAD_WINDOW_LAYERS,
    MemoryModel,
    StageMemory,
    plan_memory,
)
from rigpilot.engine.planner.model import ModelFacts, model_facts
from rigpilot.engine.planner.plan import (
    CHECKPOINTING,
    METHODS,
    PRECISIONS,
    TASKS,
    WEIGHT_BITS,
    LoraSettings,
    Parallelism,
    Plan,
    Workload,
    recipe_words,
    refusal_of,
)
from rigpilot.engine.planner.recipes import FREE, Rung, rung, techniques
from rigpilot.engine.planner.result import (
    FAMILY_ORDER,
    GPU_MEMORY,
    HOST_MEMORY,
    SPEED_TIE,
    Candidate,
    MemoryLimit,
    Rejection,
    SearchResult,
    Suggestion,
    leanest,
    memory_limit,
)
from rigpilot.engine.planner.scaling import multinode_lines, scaling_of
from rigpilot.engine.planner.settings import (
    EXPORTS,
    MAX_BATCH,
    MAX_TOKEN_BUDGET,
    OFFLOAD_CHOICES,
    OPTIMIZERS,
    ref,
    refusal,
    say,
)
from rigpilot.engine.planner.speed import SpeedModel
from rigpilot.engine.recipe import RECIPE_SETTINGS, Recipe
from rigpilot.engine.recipe_refusal import refused_setting
from rigpilot.engine.schema import Ref, Words

EXPORT_TARGETS = EXPORTS
MAX_SEQ = int(TRAIN_SETTINGS["seq_len"].hi)  # a job's own bound (2M tokens)
MAX_LORA_RANK = int(TRAIN_SETTINGS["lora_rank"].hi)
MAX_TP = 8


@dataclass
class SearchOptions:
    force_tp: bool = False  # allow tensor parallelism over slow links
    offload: str = "auto"  # CPU offload (training): "auto" only where nothing else fits, "on" only, "off" never
    export: str | None = None  # only plans this export target can run
    runners_up: int = 4
    suggest: bool = True  # when nothing fits, look for the smallest change that fits
    # Several machines (engine.planner.cluster): up to `nodes` identical nodes joined by `internode` (a name of
    # cluster.NODE_LINKS or a bandwidth in GB/s). The search also tries fewer nodes, and TP stays inside a node.
    nodes: int = 1
    internode: str = DEFAULT_LINK
    # Training: only plans with this micro-batch (a scaling study keeps it the same on every GPU count).
    micro_batch: int | None = None


# -- validation ------------------------------------------------------------------------------------------------


def validate_workload(w: Workload, spec: ModelSpec) -> None:
    if w.task not in TASKS:
        raise UserError(f"unknown task {w.task!r}; use train or infer",
                        reason="not_a_choice", setting="task", value=w.task, choices=list(TASKS))  # fmt: skip
    if w.method not in METHODS:
        raise UserError(f"unknown method {w.method!r}; use full, lora or qlora",
                        reason="not_a_choice", setting="method", value=w.method, choices=list(METHODS))  # fmt: skip
    if w.task == "infer" and w.method != "full":
        raise refusal("{method} is a way to train; for quantized inference use {int8} or {nf4}",
                      reason="method_is_for_training", fields={"setting": "method", "value": w.method},
                      method=ref("method", w.method), int8=ref("quant", "int8"), nf4=ref("quant", "4bit"))  # fmt: skip
    if w.precision not in PRECISIONS:
        raise UserError(f"unknown dtype {w.precision!r}; use bf16, fp16 or fp32",
                        reason="not_a_choice", setting="precision", value=w.precision, choices=list(PRECISIONS))  # fmt: skip
    if w.optimizer is not None and w.optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {w.optimizer!r}; use {', '.join(OPTIMIZERS)}",
                        reason="not_a_choice", setting="optimizer", value=w.optimizer, choices=list(OPTIMIZERS))  # fmt: skip
    if w.weight_bits not in WEIGHT_BITS:
        raise UserError(f"weights can be 16, 8 or 4 bits, not {w.weight_bits}")
    if w.training and w.weight_bits != 16:
        raise refusal("{quant} applies to inference; to train on 4-bit weights use {qlora}",
                      reason="quant_is_for_inference", fields={"setting": "quant", "value": w.weight_bits},
                      quant=ref("quant"), qlora=ref("method", "qlora"))  # fmt: skip
    if not w.training and w.master_weights not in (None, "fp32"):
        raise refusal("{master} applies to training", reason="master_weights_are_for_training",
                      fields={"setting": "master_weights", "value": w.master_weights},
                      master=ref("master_weights", w.master_weights))  # fmt: skip
    if not w.training:
        for name, value in w.pinned().items():
            if name != "master_weights" and value != RECIPE_SETTINGS[name].default:
                raise refusal("{setting} applies to training", reason="recipe_is_for_training",
                              fields={"setting": name, "value": value}, setting=_recipe_ref(name, value))  # fmt: skip
    else:
        for name, value in w.pinned().items():
            if name == "master_weights":
                continue  # checked below, as before the other recipe settings existed
            TRAIN_SETTINGS[name].check(value)
            conflict = TRAIN_SETTINGS[name].conflict(w)
            if conflict is not None:
                f = conflict.fields
                raise refusal("{mine} needs {other} (it is {found})", reason=conflict.reason, fields=f,
                              mine=_recipe_ref(name, value), other=ref("precision", f["needs"]), found=f["found"])  # fmt: skip
    if w.training and w.pinned():
        # Pinned settings that contradict each other whatever the layout (8-bit AdamW with the optimizer state in
        # host memory, the host optimizer under fp16): the contract's own line, not "nothing fits".
        pinned: dict[str, Any] = {k: v for k, v in w.pinned().items() if k != "fp8"}  # FP8: the GPUs decide (the search)
        recipe = dataclasses.replace(Recipe(), **pinned)
        asked = RecipeContext(method=w.method, precision=w.precision, decoder=spec.is_decoder)
        why = recipe_why_not(recipe, Layout(), asked)
        if why is not None:
            name, value = refused_setting(recipe, Layout(), asked, why)
            raise UserError(why, reason="recipe_refused", setting=name, value=value)
    if w.training:  # the job's own declaration and its requirement (bf16 master weights need bf16 compute)
        TRAIN_SETTINGS["master_weights"].check(w.master_weights)
        conflict = TRAIN_SETTINGS["master_weights"].conflict(w)
        if conflict is not None:
            f = conflict.fields
            raise refusal("{mine} needs {other} (it is {found})", reason=conflict.reason, fields=f,
                          mine=ref("master_weights", f["value"]), other=ref("precision", f["needs"]), found=f["found"])  # fmt: skip
    if w.method == "qlora" and w.precision == "fp32":
        raise refusal("QLoRA computes in bf16 or fp16; use {bf16}", reason="qlora_needs_half_precision",
                      fields={"setting": "precision", "value": w.precision}, bf16=ref("precision", "bf16"))  # fmt: skip
    # Finite bounds far past any real run: the search enumerates divisors of the batch, so an absurd
    # value would make it explode (2^63 once kept a request spinning for half an hour).
    for name, setting, value, lo, hi in (
        (say("sequence length ({seq})", seq=ref("seq_len")), "seq_len", w.seq_len, 1, MAX_SEQ),
        (say("batch ({batch})", batch=ref("batch")), "global_batch", w.global_batch, 1, MAX_BATCH),
        ("new tokens", "new_tokens", w.new_tokens, 0, MAX_SEQ),
    ):
        if not lo <= value <= hi:
            raise refusal("the {name} must be between {lo:,} and {hi:,}, not {value:,}", reason="out_of_range",
                          fields={"setting": setting, "value": value, "lo": lo, "hi": hi},
                          name=name, lo=lo, hi=hi, value=value)  # fmt: skip
    if w.token_budget is not None and not 1 <= w.token_budget <= MAX_TOKEN_BUDGET:
        raise UserError(f"the token budget must be between 1 and {MAX_TOKEN_BUDGET:.0e}, not {w.token_budget:,}")
    if w.lora is not None and w.lora.rank > MAX_LORA_RANK:
        raise UserError(f"the LoRA rank must be at most {MAX_LORA_RANK:,}, not {w.lora.rank:,}")
    ctx = spec.max_position_embeddings
    if ctx and w.seq_len > ctx:
        raise UserError(
            f"sequence length {w.seq_len} is longer than {spec.id or 'the model'}'s context of {ctx} tokens; "
            f"use a sequence length of {ctx} or less",
            reason="seq_too_long", setting="seq_len", value=w.seq_len, limit=ctx,
        )  # fmt: skip
    if not w.training and w.new_tokens >= w.seq_len:
        raise UserError(f"{w.new_tokens} new tokens leave no room for a prompt in a {w.seq_len}-token context")
    if w.lora is not None and w.lora.rank < 1:
        raise UserError("the LoRA rank must be at least 1")


def _recipe_ref(name: str, value: object) -> Ref:
    """A recipe setting named in a sentence (each literally, so the words' tests see every setting named)."""
    return {
        "optimizer": lambda: ref("optimizer", value),
        "optimizer_in_backward": lambda: ref("optimizer_in_backward", value),
        "loss_chunks": lambda: ref("loss_chunks", value),
        "activation_offload": lambda: ref("activation_offload", value),
        "optimizer_offload": lambda: ref("optimizer_offload", value),
        "compile": lambda: ref("compile", value),
        "fp8": lambda: ref("fp8", value),
    }[name]()


def select_gpus(machine: Machine, gpus: list[int] | None) -> list[int]:
    available = [g.index for g in machine.gpus]
    if not available:
        raise UserError(f"{machine.label} has no GPUs to plan for")
    if gpus is None:
        return available
    if not gpus:
        raise refusal("no GPUs selected: give at least one index to {gpus}", reason="no_gpus", gpus=ref("gpus"))
    seen: list[int] = []
    for i in gpus:
        if i not in available:
            raise UserError(f"GPU {i} does not exist; this machine has GPUs {_ranges(available)}")
        if i in seen:
            raise refusal("GPU {i} is listed twice in {gpus}", reason="gpu_listed_twice", fields={"gpu": i},
                          i=i, gpus=ref("gpus"))  # fmt: skip
        seen.append(i)
    return seen


def _ranges(idx: list[int]) -> str:
    return f"{idx[0]}-{idx[-1]}" if len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1)) else ", ".join(map(str, idx))


def _prepare(spec: ModelSpec, w: Workload) -> tuple[ModelFacts, Workload]:
    validate_workload(w, spec)
    m = model_facts(spec)
    if w.training and w.method != "full":
        lora = w.lora or LoraSettings()
        targets = m.resolve_targets(lora.targets)
        lora = dataclasses.replace(lora, targets=targets, quant_bits=4 if w.method == "qlora" else 16)
        w = dataclasses.replace(w, lora=lora)
    elif w.lora is not None:
        w = dataclasses.replace(w, lora=None)
    return m, w


# -- the search ------------------------------------------------------------------------------------------------


def search(
    spec: ModelSpec,
    machine: Machine,
    workload: Workload,
    *,
    gpus: list[int] | None = None,
    calibration: Calibration | None = None,
    options: SearchOptions | None = None,
    verifier: Callable[[SearchResult], list[str]] | None = None,
    node_machines: list[Machine] | None = None,
) -> SearchResult:
    """Find the best plan that fits (`rank`), with runners-up, rejected families and (if needed) suggestions.

    `verifier` (verify.check) checks the top plans once they are ranked and may change which is best,
    before the explanation is written, so that the explanation is of the plan recommended.
    `node_machines`: each node's machine (from its engine or an imported file) for a multi-node plan;
    without it `options.nodes` copies of `machine`. `gpus` are each node's GPUs.
    """
    start = time.perf_counter()
    opts = options or SearchOptions()
    if opts.export is not None and opts.export not in EXPORT_TARGETS:
        raise UserError(f"unknown export {opts.export!r}; use {', '.join(EXPORT_TARGETS)}")
    if opts.offload not in OFFLOAD_CHOICES:
        raise UserError(f"CPU offload can be {', '.join(OFFLOAD_CHOICES)}, not {opts.offload!r}")
    check_nodes(opts.nodes)
    if opts.micro_batch is not None and not 1 <= opts.micro_batch <= MAX_BATCH:
        raise UserError(f"a micro-batch is 1 to {MAX_BATCH} sequences, not {opts.micro_batch}")
    link = node_link(opts.internode)
    if node_machines is not None and len(node_machines) > 1 and opts.nodes not in (1, len(node_machines)):
        raise refusal("{nodes} does not match the {n} node machines given", reason="nodes_mismatch",
                      fields={"setting": "nodes", "value": opts.nodes, "machines": len(node_machines)},
                      nodes=ref("nodes", opts.nodes), n=len(node_machines))  # fmt: skip
    nodes = len(node_machines) if node_machines else opts.nodes
    indices = select_gpus(machine if not node_machines else node_machines[0], gpus)
    m, w = _prepare(spec, workload)
    cluster: Cluster | None = None
    label = machine.label
    if nodes > 1:
        if not w.training:
            raise UserError("multi-node plans are for training; for inference run a replica on each machine (plan one node)")
        cluster = build_cluster(node_machines or [machine] * nodes, indices, link)
        machine, label = cluster.machine, cluster.label
        calibration = calibration.for_nodes(indices, nodes) if calibration is not None else None
        topo = Topology(machine, list(range(nodes * len(indices))), calibration, per_node=len(indices), internode=link)
    else:
        machine = node_machines[0] if node_machines else machine
        label = machine.label
        topo = Topology(machine, indices, calibration)
    if w.precision == "bf16":
        for i in indices:
            if topo.gpus[i].peak.get("bf16") is None and topo.gpus[i].spec_key:
                raise no_bf16(i, topo.gpus[i].short_name)
    recipes = Recipes(m, w, topo)
    speed = recipes.plain.speed
    # First the recipes that change neither the numerics nor the step; the rest of the ladder only where no plan
    # without CPU offload fits with them (most workloads stop here, at the cost of the plain search).
    cands, skipped = _evaluate(m, w, topo, recipes, opts, FREE)
    if not any(c.fits and c.runs_here and not c.blocked and not c.par.offload for c in cands):
        if any(n not in FREE for n, _ in recipes.techniques):
            cands, skipped = _evaluate(m, w, topo, recipes, opts)
    fitting = rank(_leanest_needed(cands, recipes))
    notes = list(m.notes)
    best = _materialize(fitting[0], m, recipes, machine, notes, cluster, label) if fitting else None
    runners: list[Plan] = []
    seen_families = {(fitting[0].family, fitting[0].runs_here, fitting[0].par.nodes)} if fitting else set()
    for c in fitting[1:]:
        if len(runners) >= opts.runners_up:
            break
        if (c.family, c.runs_here, c.par.nodes) in seen_families:
            continue
        seen_families.add((c.family, c.runs_here, c.par.nodes))
        runners.append(_materialize(c, m, recipes, machine, [], cluster, label))
    if best is not None and len(runners) < opts.runners_up:
        # Few families fit: show the next-best variants of the winning one.
        for c in fitting[1:]:
            if len(runners) >= opts.runners_up:
                break
            if c.family == best.parallelism.family and c.runs_here and not _same_shape(c.par, best.parallelism):
                runners.append(_materialize(c, m, recipes, machine, [], cluster, label))
    # The variants were appended after the other families: show every plan in the ranking's order.
    position = {id(c.par): i for i, c in enumerate(fitting)}
    runners.sort(key=lambda p: position.get(id(p.parallelism), len(position)))
    if best is not None:
        why = _why_not_fastest(best, runners)
        if why:
            best.notes.append(why)
        if _plan_fill(best) > TIGHT_FILL:
            room = "a smaller micro-batch or more checkpointing" if best.workload.training else "a smaller batch"
            best.notes.append(
                f"tight: it fills {_fill_words(best)} of its fullest GPU and no plan leaving {1 - TIGHT_FILL:.0%} "
                f"free fits; fragmentation over a long run may still run it out of memory ({room} leaves room)"
            )
        said = _recipe_line(best, fitting[0], recipes, topo, cands)
        if said:
            best.notes.insert(0, said)
    rejected = _rejections(cands, skipped, fitting, recipes)
    suggestions: list[Suggestion] = []
    if (best is None or not best.runs_here) and opts.suggest and cluster is None:
        suggestions = suggest(spec, machine, w, indices, calibration, opts)
    if cluster is not None:
        for p in [*([best] if best else []), *runners]:
            p.scaling = scaling_of(p, fitting, speed, cluster)
    result = SearchResult(
        workload=w,
        machine=label,
        gpu_indices=indices,
        best=best,
        runners_up=runners,
        rejected=rejected,
        suggestions=suggestions,
        explanation=[],
        considered=len(cands),
        fitting=len(fitting),
        runnable=sum(c.runs_here for c in fitting),
        elapsed_s=0.0,
        notes=notes,
        nodes=nodes,
        internode=link.to_dict() if cluster is not None else None,
        limit=_limit(best, cands),
    )
    result.elapsed_s = time.perf_counter() - start  # the search alone, not its verification
    checked = verifier(result) if verifier is not None and best is not None else []
    shown = cluster.node_gpus(0) if cluster is not None else None
    lines = explain(result, cands, topo, m, speed.timing, gpus=shown, recipe_of=recipes.words)
    if cluster is not None:
        at = 3 if result.best is not None else len(lines)
        lines[at:at] = multinode_lines(result, fitting, speed, cluster)
    result.explanation = lines + checked
    return result


def _same_shape(a: Parallelism, b: Parallelism) -> bool:
    return (a.dp, a.tp, a.pp, a.zero_stage, a.shard_degree, a.checkpointing, a.micro_batch, a.nodes) == (
        b.dp, b.tp, b.pp, b.zero_stage, b.shard_degree, b.checkpointing, b.micro_batch, b.nodes,
    )


# CPU offload pins host RAM, leans on host memory bandwidth that other work shares and is the least predictable
# part of the model: a plan without it is recommended unless it is more than this much slower than the offload.
OFFLOAD_MARGIN = 0.15
# Plans that leave at least this share of their fullest GPU free count as equally roomy: beyond the formula's 10%
# error bound and the allocator's fragmentation, more free memory buys nothing, and the faster plan wins.
ROOMY_FILL = 0.80
RANKING = (
    f"best first: within {SPEED_TIE:.0%} of the fastest, the one with the most free memory "
    f"(up to {1 - ROOMY_FILL:.0%} free); offload only where the best plan without it is more than "
    f"{OFFLOAD_MARGIN:.0%} slower; a plan filling over {TIGHT_FILL:.0%} of a GPU (tight) after those that leave more"
)


def _score(c: Candidate) -> float:
    return c.tokens_per_s * (1.0 - OFFLOAD_MARGIN) if c.par.offload else c.tokens_per_s


def _fill(c: Candidate) -> float:
    return c.worst_total / max(c.worst_capacity, 1)


def _tight(c: Candidate) -> bool:
    return _fill(c) > TIGHT_FILL


def rank(fitting: list[Candidate]) -> list[Candidate]:
    """Fitting candidates in the order the plan table shows them, best first.

    Plans the engine refuses come after every plan it runs, and plans filling more than TIGHT_FILL of their
    fullest GPU after every plan that leaves that headroom (a tight plan is still shown, and is the best when
    nothing roomier fits). Within each of those, the next plan is taken from those within SPEED_TIE of the
    fastest left (offload counted at its speed less OFFLOAD_MARGIN): the one with the most free memory on its
    fullest GPU (in steps of 1% of capacity, every plan using at most ROOMY_FILL of it counting as equal), then
    the faster, the simpler family, fewer GPUs; before all that, the plan on fewer nodes (multi-node searches).
    An offloading plan is taken by headroom only while the fastest left offloads too, so a plan without offload
    within the margin always comes first.
    """
    out: list[Candidate] = []
    for runs_here in (True, False):
        for tight in (False, True):
            out += _rank_by_speed([c for c in fitting if c.runs_here == runs_here and _tight(c) == tight])
    return out


def _rank_by_speed(group: list[Candidate]) -> list[Candidate]:
    out: list[Candidate] = []
    by_speed = sorted(group, key=lambda c: -_score(c))
    taken = [False] * len(by_speed)
    heaps: dict[bool, list[tuple]] = {False: [], True: []}
    head = nxt = 0
    while head < len(by_speed):
        top = _score(by_speed[head])
        while nxt < len(by_speed) and _score(by_speed[nxt]) >= top * (1.0 - SPEED_TIE):
            c = by_speed[nxt]
            # Fewer machines first: another node is worth its link only when it is more than SPEED_TIE faster.
            key = (c.par.nodes, round(max(_fill(c), ROOMY_FILL), 2), -_score(c), FAMILY_ORDER.index(c.family), c.par.world_size, nxt)
            heapq.heappush(heaps[c.par.offload], key)
            nxt += 1
        pools = [heaps[False], heaps[True]] if by_speed[head].par.offload else [heaps[False]]
        pool = min((h for h in pools if h), key=lambda h: h[0])
        i = heapq.heappop(pool)[-1]
        taken[i] = True
        out.append(by_speed[i])
        while head < len(by_speed) and taken[head]:
            head += 1
    return out


def _plan_fill(p: Plan) -> float:
    peak = p.peak_memory
    return (peak.capacity - peak.headroom) / max(peak.capacity, 1)


def _fill_words(p: Plan) -> str:
    """A tight plan's share of its fullest GPU, with the digits it takes not to read as TIGHT_FILL itself."""
    fill = _plan_fill(p)
    for digits in (0, 1, 2):
        text = f"{fill:.{digits}%}"
        if float(text[:-1]) / 100 > TIGHT_FILL:
            break
    return text


def _why_not_fastest(best: Plan, runners: list[Plan]) -> str:
    """Why a faster runner-up the engine runs ranks below the best plan, in one line ("" when none is faster)."""
    faster = [p for p in runners if p.runs_here == best.runs_here and p.timing.tokens_per_s > best.timing.tokens_per_s * 1.001]
    if not faster:
        return ""
    f = max(faster, key=lambda p: p.timing.tokens_per_s)
    gain = f.timing.tokens_per_s / best.timing.tokens_per_s - 1
    name = f"{f.parallelism.family} ({f.parallelism.describe()})"
    if f.parallelism.nodes > best.parallelism.nodes:
        return (
            f"ranked above {name}, which is {gain:.1%} faster on {f.parallelism.nodes} nodes: another node is used "
            f"only where it is more than {SPEED_TIE:.0%} faster"
        )
    if f.parallelism.offload and not best.parallelism.offload:
        return (
            f"ranked above {name}, which is {gain:.0%} faster: offload is recommended only where the best plan "
            f"without it is more than {OFFLOAD_MARGIN:.0%} slower"
        )
    beyond_tie = f.timing.tokens_per_s * (1.0 - SPEED_TIE) > best.timing.tokens_per_s
    if beyond_tie and _plan_fill(f) > TIGHT_FILL >= _plan_fill(best):
        return (
            f"ranked above {name}, which is {gain:.1%} faster but fills {_fill_words(f)} of its fullest GPU: "
            f"a plan over {TIGHT_FILL:.0%} is ranked after the plans that leave that headroom"
        )
    return (
        f"ranked above {name}, which is {gain:.1%} faster: within {SPEED_TIE:.0%} this plan leaves "
        f"{fmt_gib(best.peak_memory.headroom)} free on its fullest GPU against {fmt_gib(f.peak_memory.headroom)}"
    )


def cannot_run(par: Parallelism, w: Workload, model_type: str, **context: Any) -> str:
    """rigpilot.engine.capability.why_not of the layout a plan with `par` asks for, and recipe_why_not of its
    recipe ("" when the engine runs it): the same functions `Plan.from_dict` and the submission path apply to a
    plan. `context`: refusal_of's gpu_capability and cpu_ranks."""
    return refusal_of(par, w, model_type, **context)


def _materialize(
    c: Candidate, m: ModelFacts, recipes: Recipes, machine: Machine, notes: list[str],
    cluster: Cluster | None = None, label: str | None = None,
) -> Plan:  # fmt: skip
    """A full plan (per-GPU breakdowns, communication items, figures) from a ranked candidate, its workload
    carrying the recipe it was sized for.

    Multi-node searches work on the cluster's GPU numbers; the plan gets each node's own GPU indices back.
    """
    speed = recipes[c.recipe].speed
    w = recipes[c.recipe].rung.workload
    memory, host = plan_memory(speed.mm, c.par, speed.topo)
    timing = speed.timing(c.par, compile=speed.mm.recipe.compile)
    par = c.par
    names = [short_gpu_name(machine.gpu(i).name) for i in c.par.gpu_indices]
    if cluster is not None:
        per = c.par.world_size // c.par.nodes
        par = dataclasses.replace(
            c.par, gpu_indices=[cluster.to_local(g) for g in c.par.gpu_indices[:per]],
            internode=cluster.link.to_dict() if c.par.nodes > 1 else None,
        )  # fmt: skip
        names = names[:per]
        memory = [dataclasses.replace(mb, gpu=cluster.to_local(mb.gpu), node=cluster.node_of(mb.gpu)) for mb in memory]
        for item in timing.comm:
            item.group = [cluster.to_local(g) for g in item.group]
    plan_notes = list(notes)
    if c.par.backend == "ddp" and c.par.dp > 1:
        plan_notes.append(
            "assumes DDP(gradient_as_bucket_view=True); PyTorch's default keeps a second copy of the gradients "
            f"(+{fmt_gib(memory[0].gradients)} per GPU)"
        )
    if host.available is None:
        plan_notes.append("host RAM is unknown; its check was skipped")
    if c.par.backend == "fsdp" and c.par.offload:
        plan_notes.append(
            f"CPU offload pins {fmt_gib(host.offloaded)} of host RAM (parameters, gradients and optimizer state), "
            "which cannot be swapped out"
        )
    if w.training and speed.mm.recipe.optimizer_in_backward:
        plan_notes.append(
            f"the optimizer step in backward runs without gradient accumulation or clipping: each step's "
            f"{w.global_batch} sequences are {c.par.micro_batch} per micro-batch × {c.par.dp} data-parallel "
            f"replica{'s' if c.par.dp > 1 else ''}"
        )
    if speed.mm.host_optimizer(c.par):
        gbs, cpu_class = speed.host_memory_class()
        on_host = sum(speed.mm.host_optimizer_params(c.par, st) for st in range(c.par.pp))
        plan_notes.append(
            f"the optimizer state in host memory keeps the master copy, gradient and AdamW state of "
            f"{on_host / 1e9:.2f}B parameters in pinned host RAM and leaves the GPU their weights: each gradient goes "
            f"to the host over PCIe as backward makes it, AdamW steps on the CPU (assuming {gbs:.0f} GB/s of host "
            f"memory bandwidth, a {cpu_class}; not measured) and the weights come back before the next forward"
        )
    moved = sum(speed.mm.offloaded_activations(c.par, st) for st in range(c.par.pp))
    if moved:
        plan_notes.append(
            f"activation offloading keeps {fmt_gib(moved)} of saved activations per GPU in pinned host RAM "
            f"(all blocks' but {OFFLOAD_WINDOW_LAYERS} and the loss's), copied over PCIe each micro-batch"
        )
    if c.par.offload:
        gbs, cpu_class = speed.host_memory_class()
        ranks = max(speed.ranks_per_node(c.par).values())
        plan_notes.append(
            f"offload time assumes {gbs:.0f} GB/s of host memory bandwidth per socket (a {cpu_class}, from the CPU "
            f"model; not measured), shared by the up to {ranks} ranks on one NUMA node: the copies to and from "
            "the GPUs, the gradient accumulation on the host and the CPU optimizer step all stream through it"
        )
    plan = Plan(
        workload=w,
        parallelism=par,
        memory=memory,
        host=host,
        timing=timing,
        machine=label or machine.label,
        gpu_names=names,
        model_params=m.params,
        model_type=m.spec.model_type,
        architecture=m.spec.architecture,
        notes=plan_notes,
        runs_here=c.runs_here,
        runs_here_reason=c.cannot_run,
    )
    return plan


@dataclass
class RecipeModels:
    """One recipe of the ladder with the memory and speed models of its workload."""

    rung: Rung
    mm: MemoryModel
    speed: SpeedModel


class Recipes:
    """The recipes a search tries (engine.planner.recipes), each one's models built when first asked for."""

    def __init__(self, m: ModelFacts, w: Workload, topo: Topology) -> None:
        self.m, self.w, self.topo = m, w, topo
        self.techniques = techniques(w, decoder=m.is_decoder)
        self._models: dict[tuple[str, ...], RecipeModels] = {}
        self.plain = self[()]

    def words(self, c: Candidate) -> str:
        """The recipe a candidate was sized with, in words ("pure bf16 + 8-bit AdamW")."""
        return recipe_words(self[c.recipe].rung.workload)

    def __getitem__(self, added: tuple[str, ...]) -> RecipeModels:
        found = self._models.get(added)
        if found is None:
            r = rung(self.w, added)
            mm = MemoryModel(self.m, r.workload)
            found = self._models[added] = RecipeModels(r, mm, SpeedModel(self.m, r.workload, self.topo, mm))
        return found


def _leanest_needed(cands: list[Candidate], recipes: Recipes) -> list[Candidate]:
    """The fitting candidates the ranking may choose from: those whose recipe is free (chunked cross-entropy) or
    no further down the ladder than the plainest one some runnable plan without CPU offload needs (any plan,
    where none fits without offload). So a recipe that changes the numerics is used only where it is needed."""
    fitting = [c for c in cands if c.fits and not c.blocked]
    runnable = [c for c in fitting if c.runs_here]
    pool = [c for c in runnable if not c.par.offload] or runnable
    need = min((recipes[c.recipe].rung.level for c in pool), default=0)
    return [c for c in fitting if not c.runs_here or recipes[c.recipe].rung.free or recipes[c.recipe].rung.level <= need]


def _evaluate(
    m: ModelFacts, w: Workload, topo: Topology, recipes: Recipes, opts: SearchOptions,
    allowed: frozenset[str] | None = None,
) -> tuple[list[Candidate], dict[str, str]]:
    """Every layout the search tries, each with the plainest recipe that fits it; `allowed`: the ladder's
    techniques the search may add (None: all)."""  # fmt: skip
    cands: list[Candidate] = []
    skipped: dict[str, str] = {}
    gen = _train_layouts(m, w, topo, opts, skipped) if w.training else _infer_layouts(m, w, topo, opts, skipped)
    available = topo.machine.host.memory_total
    caps = {i: g.memory for i, g in topo.gpus.items()}
    twin_fits: set[tuple] = set()
    refusals: dict[tuple, str] = {}
    context = _recipe_context(topo)
    ladder = [n for n, _ in recipes.techniques if allowed is None or n in allowed]
    in_backward = "optimizer_in_backward" in ladder or bool(w.optimizer_in_backward)
    for layout, blocked, micro_batches in gen:
        for ckpt in (CHECKPOINTING if w.training else ("none",)):
            last_only = False
            fitted: frozenset[str] = frozenset()  # the recipe the last micro-batch fitted with
            for mb in micro_batches:
                if last_only and layout.grad_accum // mb > 1:
                    continue
                par = dataclasses.replace(layout, checkpointing=ckpt, micro_batch=mb, grad_accum=layout.grad_accum // mb if w.training else 1)
                if par.pp > 1 and par.grad_accum > MICROBATCH_RANGE[1]:
                    # The schedule's micro-batches per step: past the engine's limit (engine.layout) no job runs it.
                    skipped.setdefault("pipeline", f"a pipeline step of more than {MICROBATCH_RANGE[1]:,} micro-batches "
                                                   "(a smaller global batch or a larger micro-batch runs)")  # fmt: skip
                    continue
                # An offloading plan's twin keeps the same split with everything on the GPU.
                key = (par.tp, par.pp, par.dp, par.zero_stage if par.dp > 1 else 0, ckpt, mb)
                offloading = par.offload_optimizer or par.offload_params
                if offloading and key in twin_fits:
                    continue  # the same plan without offload fits and is faster
                layout_key = (par.dp, par.tp, par.pp, par.zero_stage, par.shard_degree, par.sequence_parallel, offloading,
                              par.nodes, par.grad_accum > 1)  # fmt: skip
                # The plainest recipe that fits this layout: down the ladder, each technique added to the last
                # recipe tried unless the engine does not run it with this layout.
                added: tuple[str, ...] = ()
                base_why = ""
                cand = None
                for name in ("", *ladder):
                    trying = (*added, name) if name else added
                    refusals_key = (trying, *layout_key)
                    if refusals_key not in refusals:
                        refusals[refusals_key] = cannot_run(par, recipes[trying].rung.workload, m.spec.model_type, **context)
                    why = refusals[refusals_key]
                    if not name:
                        base_why = why
                    elif why:
                        continue  # a technique the engine does not run with this layout
                    added = trying
                    if set(added) < fitted and not base_why:
                        continue  # a plainer recipe than a smaller micro-batch needed: it does not fit this one
                    cand = _check(par, recipes[added].mm, topo, caps, available)
                    cand.recipe, cand.cannot_run, cand.blocked = added, why, blocked
                    if cand.fits or base_why:
                        break  # a layout the engine refuses is shown for comparison, in the recipe asked for
                assert cand is not None  # the leanest recipe tried is always evaluated
                if cand.fits:
                    fitted = frozenset(cand.recipe)
                cands.append(cand)
                if not cand.fits:
                    if in_backward and par.grad_accum > 1 and par.pp == 1:
                        # A larger micro-batch needs more memory still, except the one without accumulation,
                        # where the optimizer step in backward frees every gradient.
                        last_only = True
                        continue
                    break
                if not offloading:
                    twin_fits.add(key)
                rec = recipes[cand.recipe]
                cand.timing = rec.speed.timing(par, detail=False, compile=rec.mm.recipe.compile)
    return cands, skipped


def _recipe_context(topo: Topology) -> dict[str, Any]:
    """What the recipe's refusals depend on beyond the plan (capability.RecipeContext): the GPUs' lowest compute
    capability, and whether jobs run as CPU ranks (a simulated machine)."""
    caps = []
    for i in topo.indices:
        text = topo.machine.gpu(i).compute_capability if i < len(topo.machine.gpus) else None
        try:
            major, minor = (int(x) for x in str(text).split(".")[:2])
        except ValueError:
            continue
        caps.append((major, minor))
    return {"gpu_capability": min(caps) if caps else None, "cpu_ranks": topo.machine.simulated}


def _recipe_line(best: Plan, c: Candidate, recipes: Recipes, topo: Topology, cands: list[Candidate]) -> str:
    """What the recipe the search chose saves, against the plain recipe on the same layout: "pure bf16 + 8-bit
    AdamW + optimizer in backward: 17.8 GiB per GPU, no offload needed; mixed precision would need 35 GiB"; for a
    plan with CPU offload, what the leanest plan without it would need."""
    rung = recipes[c.recipe].rung
    if not best.workload.training:
        return ""
    if c.par.offload:
        x = _leanest_without_offload(cands)
        limit = memory_limit(x) if x is not None else None
        if x is not None and limit is not None and limit.code == HOST_MEMORY:
            need, have = gib_pair(limit.need_bytes, limit.have_bytes or 0)
            # It fits its GPUs: the host RAM it pins (the host optimizer's state, the weights as they load) does not.
            return (
                f"CPU offload is needed: without it the leanest plan, {x.par.describe()} with {recipes.words(x)}, "
                f"fits its GPUs but needs {need} of host RAM of {have}"
            )
        if x is not None:
            return (
                f"CPU offload is needed: without it the leanest plan, {x.par.describe()} with "
                f"{recipes.words(x)}, needs {fmt_gib(x.worst_total)} per GPU of {fmt_gib(x.worst_capacity)}"
            )
    if rung.plain:
        return ""
    caps = {i: g.memory for i, g in topo.gpus.items()}
    plain = _check(c.par, recipes.plain.mm, topo, caps, topo.machine.host.memory_total)
    offload = "with CPU offload" if c.par.offload else "no CPU offload needed"
    return (
        f"{recipe_words(best.workload)}: {fmt_gib(best.peak_memory.total)} per GPU, {offload}; "
        f"{recipe_words(recipes.plain.rung.workload)} would need {fmt_gib(plain.worst_total)}"
    )


def _leanest_without_offload(cands: list[Candidate]) -> Candidate | None:
    """The runnable plan without CPU offload nearest to fitting its GPUs: what a plan with offload is measured by."""
    return leanest([x for x in cands if not x.par.offload and x.runs_here and not x.blocked])


def _limit(best: Plan | None, cands: list[Candidate]) -> MemoryLimit | None:
    """SearchResult.limit: what the leanest plan without CPU offload does not fit, where the best plan offloads;
    what the leanest plan does not fit, where none fits."""
    if best is None:
        closest = leanest(cands)
    elif best.parallelism.offload:
        closest = _leanest_without_offload(cands)
    else:
        return None
    return memory_limit(closest) if closest is not None else None


def _check(par: Parallelism, mm: MemoryModel, topo: Topology, caps: dict[int, int], available: int | None) -> Candidate:
    per_stage = par.dp * par.tp
    stages: list[StageMemory] = []
    fits = True
    worst = (-float("inf"), 0.0, 1)
    for s in range(par.pp):
        gpus = par.gpu_indices[s * per_stage : (s + 1) * per_stage]
        sm = mm.stage(par, s, topo.gpus[gpus[0]].architecture)
        stages.append(sm)
        total = sm.total
        for g in gpus:
            over = total - caps[g]
            if over > 0:
                fits = False
            if over > worst[0]:
                worst = (over, total, caps[g])
    host = mm.host_memory(par, stages, available)
    return Candidate(par, stages, host, fits and host.fits, worst[1], worst[2])


# -- layouts -----------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(m: ModelFacts, tp: int) -> bool:
    heads, kv = m.spec.num_heads, m.spec.num_kv_heads
    return tp <= MAX_TP and heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def _order(topo: Topology, gpus: list[int], pp: int, dp: int, tp: int, z: int) -> list[int]:
    """GPU order for ranks (pp, dp, tp): stages, then sharding groups, then TP groups on the fastest links."""
    out: list[int] = []
    for stage in topo.partition(gpus, dp * tp):
        for shard in topo.partition(stage, z * tp):
            for group in topo.partition(shard, tp):
                out.extend(group)
    return out


def _stage_layers(topo: Topology, order: list[int], pp: int, per_stage: int, layers: int) -> list[list[int]]:
    """Layer ranges per stage: even, or in proportion to memory when stages differ (mixed GPUs)."""
    caps = [min(topo.gpus[g].memory for g in order[s * per_stage : (s + 1) * per_stage]) for s in range(pp)]
    if len(set(caps)) == 1:
        base, extra = divmod(layers, pp)
        # Spare layers go to middle stages: the first holds the embeddings, the last the head and loss.
        counts = [base] * pp
        middle = list(range(1, pp - 1)) or list(range(pp))
        for i in range(extra):
            counts[middle[i % len(middle)]] += 1
    else:
        total = sum(caps)
        counts = [max(1, int(layers * c / total)) for c in caps]
        while sum(counts) < layers:
            counts[max(range(pp), key=lambda i: caps[i] / counts[i])] += 1
        while sum(counts) > layers:
            counts[min(range(pp), key=lambda i: caps[i] / counts[i] if counts[i] > 1 else float("inf"))] -= 1
    ranges, start = [], 0
    for n in counts:
        ranges.append([start, start + n])
        start += n
    return ranges


def node_counts(nodes: int) -> list[int]:
    """The node counts a multi-node search tries: one, powers of two, and all of them."""
    out = {1, nodes}
    k = 2
    while k < nodes:
        out.add(k)
        k *= 2
    return sorted(out)


def _train_layouts(
    m: ModelFacts, w: Workload, topo: Topology, opts: SearchOptions, skipped: dict[str, str]
) -> Iterator[tuple[Parallelism, str | None, list[int]]]:
    if not topo.per_node:
        yield from _node_layouts(m, w, topo, opts, skipped, topo.indices, 1)
        return
    for k in node_counts(len(topo.indices) // topo.per_node):
        yield from _node_layouts(m, w, topo, opts, skipped, topo.indices[: k * topo.per_node], k)


def _node_layouts(
    m: ModelFacts, w: Workload, topo: Topology, opts: SearchOptions, skipped: dict[str, str], gpus: list[int], nodes: int
) -> Iterator[tuple[Parallelism, str | None, list[int]]]:
    """Training layouts over `gpus`, the first `nodes` nodes' GPUs of a multi-node topology (or one machine's)."""
    n = len(gpus)
    per = n // nodes
    for tp in _divisors(n):
        if not _tp_ok(m, tp):
            continue
        if nodes > 1 and per % tp:
            # Never across nodes: every layer's TP all-reduces would wait on the link between machines.
            link = topo.internode.label if topo.internode else "the network"
            skipped.setdefault(
                "tensor parallel",
                f"tensor parallel stays inside a node of {per} GPUs: across nodes every layer's all-reduces would cross {link}",
            )
            continue
        blocked = None
        if tp > 1:
            if opts.export == "deepspeed":
                continue
            node_sets = [gpus[i * per : (i + 1) * per] for i in range(nodes)]
            if any(topo.fast_partition(g, tp) is None for g in node_sets) and not opts.force_tp:
                blocked = _slow_tp_reason(topo, node_sets[0], tp)
                skipped.setdefault("tensor parallel", blocked)
        for pp in _divisors(n // tp):
            if pp > m.layers:
                continue
            if pp > 1 and opts.export in ("accelerate", "deepspeed"):
                skipped.setdefault("pipeline", f"{opts.export} cannot run pipeline-parallel plans")
                continue
            dp = n // (tp * pp)
            if w.global_batch % dp:
                why = f"the global batch of {w.global_batch} does not split over {dp} data-parallel replicas"
                families = ["tensor parallel"] if tp > 1 else ["pipeline"] if pp > 1 else ["DDP", "ZeRO-1", "ZeRO-2", "FSDP", "offload"]
                for family in families:
                    skipped.setdefault(family, why)
                continue
            per_replica = w.global_batch // dp
            micro_batches = _divisors(per_replica)
            if opts.micro_batch is not None:
                if per_replica % opts.micro_batch:
                    why = f"micro-batch {opts.micro_batch} does not divide the {per_replica} sequences of each of {dp} replicas"
                    families = ["tensor parallel"] if tp > 1 else ["pipeline"] if pp > 1 else ["DDP", "ZeRO-1", "ZeRO-2", "FSDP", "offload"]
                    for family in families:
                        skipped.setdefault(family, why)
                    continue
                micro_batches = [opts.micro_batch]
            local = dp * tp  # GPUs of one stage
            if nodes > 1 and local % per and per % local:
                continue  # a stage that straddles nodes unevenly: no layout is the same on every node
            for backend, zero, z, off_opt, off_par in _sharding_options(dp, tp, pp, n, opts):
                if nodes > 1:
                    # Each node gets the same local layout: a part of one stage, or whole stages.
                    dp_l = per // tp if local >= per else dp
                    pp_l = per // local if local < per else 1
                    zl = math.gcd(z if zero == 3 else dp, dp_l)
                    one = _order(topo, gpus[:per], pp_l, dp_l, tp, zl)
                    order = [k * per + g for k in range(nodes) for g in one]
                else:
                    order = _order(topo, gpus, pp, dp, tp, z if zero == 3 else dp)
                stage_layers = _stage_layers(topo, order, pp, dp * tp, m.layers) if pp > 1 else []
                par = Parallelism(
                    gpu_indices=order,
                    dp=dp,
                    tp=tp,
                    pp=pp,
                    zero_stage=zero,
                    shard_degree=z,
                    backend=backend,
                    sequence_parallel=tp > 1,
                    pipeline_schedule="1f1b" if pp > 1 else "none",
                    grad_accum=per_replica,  # divided by the micro-batch when evaluated
                    offload_optimizer=off_opt,
                    offload_params=off_par,
                    stage_layers=stage_layers,
                    nodes=nodes,
                )
                if par.offload != (opts.offload == "on") and opts.offload != "auto":
                    if opts.offload == "off":
                        skipped.setdefault("offload", "CPU offload is turned off")
                    continue
                if par.offload:
                    # Offload is the last resort, tried only where nothing else fits; a form of it the engine
                    # refuses (QLoRA's 4-bit base) is not evaluated, and the rejection says why.
                    refused = cannot_run(par, w, m.spec.model_type)
                    if refused:
                        skipped.setdefault("offload", refused)
                        continue
                yield par, blocked, micro_batches


def _sharding_options(dp: int, tp: int, pp: int, n: int, opts: SearchOptions) -> list[tuple[str, int, int, bool, bool]]:
    """(backend, ZeRO stage, sharding degree, offload optimizer, offload parameters) choices.

    By default the forms the engine runs: DDP, FSDP2 with parameters kept gathered through backward
    (ZeRO-2), FSDP2 full sharding (ZeRO-3) and HSDP, and FSDP2 with CPU offload, which moves parameters,
    gradients and optimizer state to the host together. ZeRO-1 and optimizer-only offload exist only in
    DeepSpeed, so only a search for --export deepspeed offers them.
    """
    out: list[tuple[str, int, int, bool, bool]] = []
    if tp > 1 or pp > 1:
        # torch TP/PP compose with DDP and FSDP2 (2D/3D meshes), not with DeepSpeed's ZeRO.
        out.append(("ddp", 0, 1, False, False))
        if dp > 1:
            out.append(("fsdp", 3, dp, False, False))
        return out
    if opts.export == "deepspeed":
        # DeepSpeed's stage 0 is its plain data parallelism (bf16 weights, fp32 master copy in the optimizer).
        if dp == 1:
            return [("deepspeed", 0, 1, False, False), ("deepspeed", 2, 1, True, False), ("deepspeed", 3, 1, True, True)]
        return [
            ("deepspeed", 0, 1, False, False), ("deepspeed", 1, dp, False, False), ("deepspeed", 2, dp, False, False),
            ("deepspeed", 3, dp, False, False), ("deepspeed", 2, dp, True, False), ("deepspeed", 3, dp, True, False),
            ("deepspeed", 3, dp, True, True),
        ]  # fmt: skip
    if dp == 1:
        return [("single" if n == 1 else "ddp", 0, 1, False, False), ("fsdp", 3, 1, True, True)]
    out.append(("ddp", 0, 1, False, False))
    out.append(("fsdp", 2, dp, False, False))
    out.append(("fsdp", 3, dp, False, False))
    out += [("fsdp", 3, z, False, False) for z in _divisors(dp) if 1 < z < dp]
    out.append(("fsdp", 3, dp, True, True))
    return out


def _slow_tp_reason(topo: Topology, gpus: list[int], tp: int) -> Words:
    groups = topo.partition(gpus, tp)
    worst = min((topo.ring(g) for g in groups), key=lambda x: x.gbs)
    return say(
        "no group of {tp} of GPUs {gpus} is joined by NVLink or a PCIe switch (slowest hop: {hop}, about "
        "{gbs:.0f} GB/s); {force_tp} considers it anyway",
        tp=tp, gpus=_ranges(sorted(gpus)), hop=worst.label, gbs=worst.gbs, force_tp=ref("force_tp"),
    )  # fmt: skip


def _infer_layouts(
    m: ModelFacts, w: Workload, topo: Topology, opts: SearchOptions, skipped: dict[str, str]
) -> Iterator[tuple[Parallelism, str | None, list[int]]]:
    # Use the biggest, fastest GPUs first when a plan needs fewer than all of them.
    ordered = sorted(topo.indices, key=lambda i: (-round(topo.gpus[i].memory / GIB), -topo.gpus[i].peak_tflops("fp16"), i))
    n = len(ordered)
    sizes = sorted({k for k in (1, 2, 4, 8, 16, n) if k <= n})
    for k in sizes:
        gpus = ordered[:k]
        for tp in _divisors(k):
            if not _tp_ok(m, tp):
                continue
            # No fixed rule against slow links here (see the module's docstring): the speed model ranks them.
            blocked = None
            for pp in _divisors(k // tp):
                if pp > m.layers:
                    continue
                dp = k // (tp * pp)
                if dp > w.global_batch:
                    continue  # replicas beyond the number of sequences would idle
                order = _order(topo, gpus, pp, dp, tp, dp)
                stage_layers = _stage_layers(topo, order, pp, dp * tp, m.layers) if pp > 1 else []
                par = Parallelism(
                    gpu_indices=order, dp=dp, tp=tp, pp=pp, backend="inference", sequence_parallel=False,
                    pipeline_schedule="none", stage_layers=stage_layers,
                )
                yield par, blocked, [1]


# -- rejections ------------------------------------------------------------------------------------------------


def _rejections(
    cands: list[Candidate], skipped: dict[str, str], fitting: list[Candidate], recipes: Recipes | None = None
) -> list[Rejection]:
    fit_families = {c.family for c in fitting}
    by_family: dict[str, Candidate] = {}
    for c in cands:
        if c.fits or c.blocked:
            continue
        best = by_family.get(c.family)
        if best is None or _need(c) < _need(best):
            by_family[c.family] = c
    out: list[Rejection] = []
    for family in FAMILY_ORDER:
        if family in fit_families:
            continue
        closest = by_family.get(family)
        if closest is not None:
            out.append(_reject_reason(closest, recipes))
        elif family in skipped:
            out.append(Rejection(family, skipped[family]))
    return out


def _need(c: Candidate) -> tuple[float, int, int]:
    # The leanest configuration; among equals name the one with the most checkpointing and smallest batch.
    over = (c.worst_total - c.worst_capacity) / max(c.worst_capacity, 1) + (0 if c.host.fits else 10.0)
    return (round(over, 3), -CHECKPOINTING.index(c.par.checkpointing), c.par.micro_batch)


def _reject_reason(c: Candidate, recipes: Recipes | None = None) -> Rejection:
    par = c.par
    if c.worst_total > c.worst_capacity and par.backend == "inference":
        need, have = gib_pair(c.worst_total, c.worst_capacity, whole_from=10)
        return Rejection(
            c.family,
            f"{c.family} needs {need} per GPU ({par.describe()}); you have {have}",
            int(c.worst_total),
            int(c.worst_capacity),
            GPU_MEMORY,
        )
    if c.worst_total > c.worst_capacity:
        how = f"micro-batch {par.micro_batch}"
        if par.checkpointing != "none":
            how += f" with {par.checkpointing} checkpointing"
        if par.offload_optimizer or par.offload_params:
            how += ", " + ("parameters and optimizer" if par.offload_params else "optimizer") + " offloaded"
        if recipes is not None and c.recipe:
            how += f" and {recipes.words(c)}"
        name = c.family if c.family != "offload" else "CPU offload"
        need, have = gib_pair(c.worst_total, c.worst_capacity, whole_from=10)
        return Rejection(
            c.family,
            f"{name} needs {need} per GPU even at {how}; you have {have}",
            int(c.worst_total),
            int(c.worst_capacity),
            GPU_MEMORY,
        )
    name = c.family if c.family != "offload" else "CPU offload"
    need, have = gib_pair(c.host.needed, c.host.available or 0, whole_from=10)
    return Rejection(
        c.family,
        f"{name} needs {need} of host RAM; this machine has {have}",
        c.host.needed,
        c.host.available,
        HOST_MEMORY,
    )


# -- suggestions -------------------------------------------------------------------------------------------------


def suggest(
    spec: ModelSpec,
    machine: Machine,
    w: Workload,
    gpus: list[int],
    calibration: Calibration | None,
    opts: SearchOptions,
    limit: int = 4,
) -> list[Suggestion]:
    """The least invasive changes that make the workload fit, each verified by searching again."""
    inner = dataclasses.replace(opts, suggest=False, runners_up=0)
    out: list[Suggestion] = []

    def attempt(change: str, kind: str, work: Workload, mach: Machine = machine, sel: list[int] | None = gpus,
                to: tuple[str, str] | None = None) -> bool:  # fmt: skip
        """`change` (a sentence naming the setting it changes, `say`) tried; `to`: that setting and its value."""
        try:
            r = search(spec, mach, work, gpus=sel, calibration=calibration, options=inner)
        except UserError:
            return False
        if r.best is None or not r.best.runs_here:
            return False  # a change is only worth suggesting if the engine then runs the plan
        out.append(Suggestion(change, kind, r.best, *(to or (None, None))))
        return True

    all_gpus = [g.index for g in machine.gpus]
    if len(gpus) < len(all_gpus):
        attempt(say("use all {n} GPUs ({gpus})", n=len(all_gpus), gpus=ref("gpus", all_gpus)), "gpus", w, machine,
                all_gpus, to=("gpus", ",".join(map(str, all_gpus))))  # fmt: skip
    if w.training:
        if w.method == "full":
            attempt(say("train LoRA adapters instead of every weight ({lora})", lora=ref("method", "lora")), "method", dataclasses.replace(w, method="lora", lora=LoraSettings()), to=("method", "lora"))
        if w.method in ("full", "lora"):
            rank = w.lora.rank if w.lora else LoraSettings().rank
            attempt(say("train LoRA on 4-bit weights ({qlora})", qlora=ref("method", "qlora")), "method", dataclasses.replace(w, method="qlora", lora=LoraSettings(rank=rank)), to=("method", "qlora"))
        if w.optimizer == "adamw" and w.method == "full":
            attempt(say("use 8-bit AdamW ({adamw8bit})", adamw8bit=ref("optimizer", "adamw8bit")), "optimizer", dataclasses.replace(w, optimizer="adamw8bit"), to=("optimizer", "adamw8bit"))
    else:
        if w.weight_bits == 16:
            attempt(say("load the weights in 8 bits ({int8})", int8=ref("quant", "int8")), "quantize", dataclasses.replace(w, weight_bits=8), to=("quant", "int8"))
        if w.weight_bits > 4:
            attempt(say("load the weights in 4 bits ({nf4})", nf4=ref("quant", "4bit")), "quantize", dataclasses.replace(w, weight_bits=4), to=("quant", "4bit"))
        batch = w.global_batch // 2
        while batch >= 1 and len(out) < limit:
            change = say("generate for {n} sequence{s} at a time ({batch})", n=batch, s="s" if batch > 1 else "",
                         batch=ref("batch", batch))  # fmt: skip
            if attempt(change, "batch", dataclasses.replace(w, global_batch=batch), to=("batch", str(batch))):
                break
            batch //= 2
    seq = w.seq_len // 2
    while seq >= 256 and len(out) < limit:
        new = min(w.new_tokens, seq // 2)
        if attempt(say("use sequences of {n} tokens ({seq})", n=seq, seq=ref("seq_len", seq)), "seq", dataclasses.replace(w, seq_len=seq, new_tokens=new), to=("seq_len", str(seq))):
            break
        seq //= 2
    if len(out) < limit:
        _suggest_hardware(spec, machine, w, gpus, attempt)
    return out[:limit] if len(out) > limit else out


def _suggest_hardware(spec: ModelSpec, machine: Machine, w: Workload, gpus: list[int], attempt: Callable[..., bool]) -> None:
    base = machine.gpu(gpus[0])
    have = min(machine.gpu(i).memory_total or 0 for i in gpus)
    n = len(gpus)
    count = f"{number_word(n)} {'' if n == 1 else '×'}"
    for key, nvml_name in LARGER_GPUS:
        spec_row = match_spec(nvml_name)
        if spec_row is None or spec_row.key != key or spec_row.memory_gib * GIB <= have * 1.02:
            continue
        memory = int(spec_row.memory_gib * GIB * 0.99)  # drivers report a little less than the nominal size
        hypo = _hypothetical(machine, gpus, n, memory=memory, name=nvml_name)
        what = f"use {count}{short_gpu_name(nvml_name)} ({spec_row.memory_gib:.0f} GiB{' each' if n > 1 else ''}) instead"
        if attempt(what, "larger-gpus", w, hypo, None):
            break
    for more in (2, 4, 8, 16):
        if more <= n:
            continue
        hypo = _hypothetical(machine, gpus, more, memory=base.memory_total or 0, name=base.name)
        if attempt(f"use {more} {short_gpu_name(base.name)} instead of {n}", "more-gpus", w, hypo, None):
            break


# Larger GPUs to suggest, smallest first: (spec key, the name the driver reports).
LARGER_GPUS = (
    ("rtx-5090", "NVIDIA GeForce RTX 5090"),
    ("rtx-a6000", "NVIDIA RTX A6000"),
    ("h100-sxm5", "NVIDIA H100 80GB HBM3"),
    ("rtx-pro-6000-blackwell", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"),
    ("h200-sxm", "NVIDIA H200"),
    ("b200", "NVIDIA B200"),
)


def _hypothetical(machine: Machine, gpus: list[int], count: int, *, memory: int, name: str) -> Machine:
    """A machine like this one with `count` GPUs called `name`, every pair wired like its slowest selected pair."""
    proto = machine.gpu(gpus[0])
    pairs = [p for p in machine.pairs if p.a in gpus and p.b in gpus]
    worst = min(pairs, key=lambda p: (p.nvlink_count, -(p.pcie.rank if p.pcie else 0)), default=None)
    if worst is None:
        # Nothing to copy from one GPU: assume plain PCIe through the CPU without P2P, the common desktop case.
        worst = GpuPair(a=0, b=1, pcie=PciePath.PHB, p2p_read=P2P.UNSUPPORTED, p2p_write=P2P.UNSUPPORTED)
    new_gpus = [
        dataclasses.replace(proto, index=i, name=name, memory_total=memory, uuid=None, nvlink_links=0, unavailable={})
        for i in range(count)
    ]
    new_pairs = [dataclasses.replace(worst, a=a, b=b) for a in range(count) for b in range(a + 1, count)]
    return dataclasses.replace(machine, gpus=new_gpus, pairs=new_pairs, notes=[*machine.notes, "hypothetical"])


__all__ = [
    "EXPORT_TARGETS",
    "Candidate",
    "Rejection",
    "SearchOptions",
    "SearchResult",
    "Suggestion",
    "search",
    "select_gpus",
    "suggest",
    "validate_workload",
]
