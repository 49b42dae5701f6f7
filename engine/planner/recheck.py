"""Does a plan still fit after the user changed it? The planner's memory and speed models on one changed plan.

The job wizard gets its recommendation from the `plan` request; when the user
overrides degrees, micro-batch, checkpointing, sequence length or LoRA rank,
the same request with `recheck` recomputes that plan's per-GPU memory and step
time with the search's own formulas, in milliseconds, so the answer can follow
every change. A change that makes no layout at all (more GPUs than selected, a
tensor-parallel degree the heads do not divide) is refused with a reason code
and its facts; a layout that does not fit comes back with `fits` false.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS
from rigpilot.engine.models import ModelSpec
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.memory import MemoryModel, plan_memory
from rigpilot.engine.planner.model import ModelFacts, model_facts
from rigpilot.engine.planner.overrides import Overrides
from rigpilot.engine.planner.plan import CHECKPOINTING, Parallelism, Plan, Workload, refusal
from rigpilot.engine.planner.search import MAX_TP
from rigpilot.engine.planner.speed import SpeedModel
from rigpilot.engine.recipe import RECIPE_SETTINGS

GIB = 1024**3
CHANGED = "changed in the wizard from the planner's recommendation"  # the note a changed plan carries


class PlanChecker:
    """Re-checks plans of one model on one machine (the per-model facts are built once)."""

    def __init__(self, spec: ModelSpec, machine: Machine):
        self.spec = spec
        self.facts: ModelFacts = model_facts(spec)
        self.machine = machine

    def check(self, plan: dict[str, Any], o: Overrides, gpus: list[int] | None = None) -> dict[str, Any]:
        """{"plan": the plan with the overrides, memory and timing recomputed, "fits", "message": one line}."""
        o.check()
        p = Plan.from_dict(plan)
        par0 = p.parallelism
        dp, tp, pp = o.dp or par0.dp, o.tp or par0.tp, o.pp or par0.pp
        available = list(gpus) if gpus else list(par0.gpu_indices)
        self._check_degrees(dp, tp, pp, len(available))
        w = self._workload(p, o, dp, o.micro_batch or par0.micro_batch)
        par = self._parallelism(par0, o, w, dp, tp, pp, available)
        topo = Topology(self.machine, list(par.gpu_indices))
        mm = MemoryModel(self.facts, w)
        memory, host = plan_memory(mm, par, topo)
        timing = SpeedModel(self.facts, w, topo, mm).timing(par, compile=mm.recipe.compile)
        notes = [n for n in p.notes if "changed in the wizard" not in n]
        new = dataclasses.replace(
            p, workload=w, parallelism=par, memory=memory, host=host, timing=timing,
            notes=[*notes, CHANGED] if par != par0 or w != p.workload else notes,
        )  # fmt: skip
        new.runs_here_reason = refusal(new)
        new.runs_here = not new.runs_here_reason
        d = new.to_dict()
        if not d["runs_here"]:
            return {"plan": d, "fits": False, "message": f"The engine does not run this layout: {d['runs_here_reason']}."}
        return {"plan": d, "fits": new.fits, "message": fit_message(new)}

    def _check_degrees(self, dp: int, tp: int, pp: int, available: int) -> None:
        world = dp * tp * pp
        if min(dp, tp, pp) < 1:
            raise UserError("Every parallel degree must be at least 1.", reason="degree_below_one", dp=dp, tp=tp, pp=pp)
        if world > available:
            raise UserError(f"dp {dp} × tp {tp} × pp {pp} = {world} GPUs, but {available} are selected.",
                            reason="too_few_gpus", dp=dp, tp=tp, pp=pp, need=world, selected=available)  # fmt: skip
        heads, kv = self.spec.num_heads, self.spec.num_kv_heads
        if tp > 1 and (tp > MAX_TP or heads % tp or (kv % tp and tp % kv)):
            raise UserError(f"Tensor parallel {tp} must divide the model's {heads} attention heads ({kv} KV heads).",
                            reason="tp_not_a_divisor", tp=tp, heads=heads, kv_heads=kv, max_tp=MAX_TP)  # fmt: skip
        if pp > self.spec.num_layers:
            raise UserError(f"{pp} pipeline stages for {self.spec.num_layers} layers: at most one stage per layer.",
                            reason="too_many_stages", pp=pp, layers=self.spec.num_layers)  # fmt: skip

    def _workload(self, p: Plan, o: Overrides, dp: int, micro: int) -> Workload:
        w0 = w = p.workload
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
        if w.training:
            changed = {name: getattr(o, name) for name in RECIPE_SETTINGS if getattr(o, name) is not None}
            if changed:
                w = dataclasses.replace(w, **changed)
                for name in changed:
                    conflict = TRAIN_SETTINGS[name].conflict(w)
                    if conflict is not None:
                        raise conflict
            accum = o.grad_accum or max(1, math.ceil(w0.global_batch / (dp * micro)))
            return dataclasses.replace(w, global_batch=dp * micro * accum)
        w = dataclasses.replace(
            w, global_batch=o.global_batch or w.global_batch, new_tokens=o.new_tokens or w.new_tokens
        )
        if w.new_tokens >= w.seq_len:
            raise UserError(f"{w.new_tokens} new tokens leave no room for a prompt in {w.seq_len} tokens.",
                            reason="no_room_for_prompt", new_tokens=w.new_tokens, seq_len=w.seq_len)  # fmt: skip
        return w

    def _parallelism(
        self, par0: Parallelism, o: Overrides, w: Workload, dp: int, tp: int, pp: int, available: list[int]
    ) -> Parallelism:
        micro = o.micro_batch or par0.micro_batch
        accum = w.global_batch // (dp * micro) if w.training else 1
        checkpointing = o.checkpointing or par0.checkpointing
        if checkpointing not in CHECKPOINTING:
            raise UserError(f"Unknown activation checkpointing {checkpointing!r}.", reason="not_a_choice",
                            setting="checkpointing", value=checkpointing, choices=list(CHECKPOINTING))  # fmt: skip
        world = dp * tp * pp
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
        return par


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
