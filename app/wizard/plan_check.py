"""Does a plan still fit after the user changed it? The planner's memory and speed models, run here.

The wizard gets its recommendation from the engine's `plan` request; when the
user overrides degrees, micro-batch, checkpointing, sequence length or LoRA
rank, `PlanChecker.check` recomputes that plan's per-GPU memory and step time
with the same formulas, in milliseconds, so the answer can follow every change.
Work functions only: no Qt. `describe_for_job` runs in a background task.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import EITHER, check_given_path, is_given_file
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.models import ModelSpec, describe_config, describe_model
from rigpilot.engine.models.config_file import read_config
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.memory import MemoryModel, plan_memory
from rigpilot.engine.planner.model import ModelFacts, model_facts
from rigpilot.engine.planner.plan import CHECKPOINTING, Plan, refusal
from rigpilot.engine.planner.speed import SpeedModel

GIB = 1024**3
MAX_TP = 8


def describe_for_job(ref: str, trust_remote_code: bool = False) -> ModelSpec:
    """A model as a job names it: also a bare config.json file, which training from scratch takes."""
    path = check_given_path(ref.strip(), "model", expect=EITHER, missing_ok=True)
    if path.is_file():
        if path.suffix.lower() != ".json":
            raise UserError(f"{ref} is a file but not a config.json")
        return describe_config(read_config(path), id=path.parent.name or path.name)
    return describe_model(ref, trust_remote_code=trust_remote_code)


WEIGHT_FILES = ("*.safetensors", "*.bin")


def missing_weights(ref: str) -> str | None:
    """The local model folder `ref` names when it has a config.json but no weight files, else None.

    Such a folder describes a model (the planner is happy) but a fine-tune would have nothing to
    start from; training from scratch is what it can do.
    """
    if is_given_file(ref.strip()):
        path = Path(ref.strip()).expanduser()
        folder = path.parent if path.name == "config.json" else path
    else:
        folder = Path(ref.strip())
    if not is_given_file(folder / "config.json"):
        return None  # a preset or hub id: the engine fetches the weights
    if any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
        return None
    return folder.name or str(folder)


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


@dataclass
class CheckResult:
    plan: dict[str, Any] | None  # the plan with the overrides, memory and timing recomputed; None if invalid
    fits: bool
    message: str  # one line for the user
    refusal: UserError | None = None  # why there is no plan, where the check refused it: its reason and fields


class PlanChecker:
    """Re-checks plans of one model on one machine (the per-model facts are built once)."""

    def __init__(self, spec: ModelSpec, machine: dict[str, Any] | Machine):
        self.spec = spec
        self.facts: ModelFacts = model_facts(spec)
        self.machine = machine if isinstance(machine, Machine) else Machine.from_dict(machine)

    def check(self, plan: dict[str, Any], o: Overrides, gpus: list[int] | None = None) -> CheckResult:
        try:
            return self._check(Plan.from_dict(plan), o, gpus)
        except UserError as e:
            return CheckResult(None, False, str(e), e)

    def _check(self, p: Plan, o: Overrides, gpus: list[int] | None) -> CheckResult:
        par0, w0 = p.parallelism, p.workload
        dp, tp, pp = o.dp or par0.dp, o.tp or par0.tp, o.pp or par0.pp
        world = dp * tp * pp
        available = list(gpus) if gpus else list(par0.gpu_indices)
        problem = self._degree_problem(dp, tp, pp, world, len(available))
        if problem:
            return CheckResult(None, False, problem)

        w = w0
        if o.seq_len is not None and o.seq_len != w.seq_len:
            ctx = self.spec.max_position_embeddings
            if ctx and o.seq_len > ctx:
                raise UserError(f"Sequence length {o.seq_len} is longer than the model's {ctx} tokens.",
                                reason="seq_too_long", setting="seq_len", value=o.seq_len, limit=ctx)  # fmt: skip
            w = dataclasses.replace(w, seq_len=o.seq_len)
        if w.lora is not None and (o.lora_rank or o.lora_alpha or o.lora_targets):
            targets = self.facts.resolve_targets(o.lora_targets) if o.lora_targets else w.lora.targets
            w = dataclasses.replace(
                w, lora=dataclasses.replace(w.lora, rank=o.lora_rank or w.lora.rank,
                                            alpha=o.lora_alpha or w.lora.alpha, targets=targets),
            )  # fmt: skip
        micro = o.micro_batch or par0.micro_batch
        if w.training:
            accum = o.grad_accum or max(1, math.ceil(w0.global_batch / (dp * micro)))
            w = dataclasses.replace(w, global_batch=dp * micro * accum)
        else:
            accum = 1
            w = dataclasses.replace(
                w, global_batch=o.global_batch or w.global_batch, new_tokens=o.new_tokens or w.new_tokens
            )
            if w.new_tokens >= w.seq_len:
                return CheckResult(
                    None, False, f"{w.new_tokens} new tokens leave no room for a prompt in {w.seq_len} tokens."
                )
        checkpointing = o.checkpointing or par0.checkpointing
        if checkpointing not in CHECKPOINTING:
            return CheckResult(None, False, f"Unknown activation checkpointing {checkpointing!r}.")

        if world == par0.world_size and set(par0.gpu_indices) <= set(available):
            order = list(par0.gpu_indices)  # the planner's order puts groups on the fastest links
        else:
            order = sorted(available)[:world]
        shard = par0.shard_degree if par0.zero_stage else 1
        if dp % max(shard, 1) or shard > dp:
            shard = dp
        par = dataclasses.replace(
            par0, gpu_indices=order, dp=dp, tp=tp, pp=pp, micro_batch=micro, grad_accum=accum,
            checkpointing=checkpointing, shard_degree=max(shard, 1) if dp > 1 else 1,
            zero_stage=par0.zero_stage if dp > 1 or par0.backend == "deepspeed" else 0,
            sequence_parallel=par0.sequence_parallel and tp > 1,
            pipeline_schedule=(par0.pipeline_schedule if par0.pp > 1 else "1f1b") if pp > 1 else "none",
            stage_layers=par0.stage_layers if pp == par0.pp else even_stages(self.spec.num_layers, pp),
        )  # fmt: skip
        if par.backend == "single" and par.world_size > 1:
            par.backend = "ddp"
        if pp > 1 and o.pp_schedule:
            par.pipeline_schedule = o.pp_schedule.lower()
        if o.sequence_parallel is not None:
            par.sequence_parallel = o.sequence_parallel and tp > 1
        if o.cpu_offload is not None and o.cpu_offload != (par.offload_params or par.offload_optimizer):
            par.offload_params = par.offload_optimizer = o.cpu_offload
            if o.cpu_offload:  # the engine offloads with FSDP2 only: shard over every data-parallel rank
                par.backend, par.zero_stage, par.shard_degree = "fsdp", 3, dp

        topo = Topology(self.machine, order)
        mm = MemoryModel(self.facts, w)
        memory, host = plan_memory(mm, par, topo)
        timing = SpeedModel(self.facts, w, topo, mm).timing(par)
        notes = [n for n in p.notes if "changed in the wizard" not in n]
        new = dataclasses.replace(
            p, workload=w, parallelism=par, memory=memory, host=host, timing=timing,
            notes=[*notes, "changed in the wizard from the planner's recommendation"] if par != par0 or w != w0 else notes,
        )  # fmt: skip
        new.runs_here_reason = refusal(new)
        new.runs_here = not new.runs_here_reason
        d = new.to_dict()
        if not d["runs_here"]:
            return CheckResult(d, False, f"The engine does not run this layout: {d['runs_here_reason']}.")
        return CheckResult(d, new.fits, fit_message(new))

    def _degree_problem(self, dp: int, tp: int, pp: int, world: int, available: int) -> str | None:
        if min(dp, tp, pp) < 1:
            return "Every parallel degree must be at least 1."
        if world > available:
            return f"dp {dp} × tp {tp} × pp {pp} = {world} GPUs, but {available} are selected."
        heads, kv = self.spec.num_heads, self.spec.num_kv_heads
        if tp > 1 and (tp > MAX_TP or heads % tp or (kv % tp and tp % kv)):
            return f"Tensor parallel {tp} must divide the model's {heads} attention heads ({kv} KV heads)."
        if pp > self.spec.num_layers:
            return f"{pp} pipeline stages for {self.spec.num_layers} layers: at most one stage per layer."
        return None


def even_stages(layers: int, pp: int) -> list[list[int]]:
    """[first, end) layers of each stage, as even as can be; spare layers go to the middle stages."""
    if pp <= 1:
        return []
    base, extra = divmod(layers, pp)
    counts = [base] * pp
    middle = list(range(1, pp - 1)) or list(range(pp))
    for i in range(extra):
        counts[middle[i % len(middle)]] += 1
    out, start = [], 0
    for n in counts:
        out.append([start, start + n])
        start += n
    return out


def fit_message(plan: Plan) -> str:
    worst = min(plan.memory, key=lambda m: m.headroom)
    if not plan.host.fits:
        need = plan.host.needed / GIB
        have = (plan.host.available or 0) / GIB
        return f"Does not fit: the host needs {need:.0f} GiB of RAM and has {have:.0f} GiB."
    if worst.headroom < 0:
        return (
            f"Does not fit: GPU {worst.gpu} needs {worst.total / GIB:.1f} GiB of {worst.capacity / GIB:.1f} GiB. "
            "Try a smaller micro-batch, activation checkpointing, or more sharding."
        )
    return f"Fits: the fullest GPU ({worst.gpu}) holds {worst.total / GIB:.1f} of {worst.capacity / GIB:.1f} GiB."


def plan_here(
    ref: str, machine: dict[str, Any], workload: dict[str, Any], gpus: list[int], trust_remote_code: bool = False
) -> dict[str, Any]:
    """The `plan` request's result, computed in this process (no engine, or a model only this side can read)."""
    from rigpilot.engine.planner.plan import LoraSettings, Workload
    from rigpilot.engine.planner.search import search

    spec = describe_for_job(ref, trust_remote_code)
    args = dict(workload)
    lora = args.pop("lora", None)
    w = Workload(model=ref, lora=LoraSettings(**lora) if lora else None, **args)
    return search(spec, Machine.from_dict(machine), w, gpus=list(gpus)).to_dict()
