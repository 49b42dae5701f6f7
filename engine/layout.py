"""`Layout`: how a job's ranks are arranged, the one type from plan to device mesh.

The planner's plan (`Layout.from_plan`), the CLI's degrees (`Layout.from_settings`) and a job's
job.json (its `parallelism` object, `Layout.from_dict`) all become a `Layout`; the submission
checks it (`engine.capability.why_not`), the worker builds its device mesh from it and the memory
tracer traces it. A `Layout` is valid from the moment it exists: every degree in range and one
pipeline-schedule spelling; `fitted`/`check_ranks` hold the product of the degrees to the ranks.

Gradient accumulation is not part of it: it is a training setting (job.json `train.grad_accum`),
how many schedule runs make one optimizer step. Under pipeline parallelism the plan's micro-batches
are the pipeline's (`pp_microbatches`) and accumulation is 1; `from_plan` and `accumulation_of_plan`
make that split in one place.

Plain Python: the GUI, the CLI and the planner import it without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from rigpilot.engine.errors import UserError
from rigpilot.engine.schema import Range, Setting, declared, setting

# The pipeline schedules the workers run (torch.distributed.pipelining), as job.json and the CLI spell them.
SCHEDULES = ("1F1B", "GPipe")
_SPELLINGS = {s.lower(): s for s in SCHEDULES}  # plans write "1f1b"/"gpipe"; any case is read
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first, as init_device_mesh lays ranks out


def schedule_name(text: Any) -> str | None:
    """The pipeline schedule `text` names ("1f1b", "GPIPE" …), spelled as SCHEDULES does; None if none."""
    return _SPELLINGS.get(text.lower()) if isinstance(text, str) else None


class _PlannedSplit(Protocol):
    """The fields of engine.planner.plan.Parallelism a layout is made from."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    shard_degree: int
    sequence_parallel: bool
    pipeline_schedule: str
    grad_accum: int
    offload_optimizer: bool
    offload_params: bool


class _Planned(Protocol):
    @property
    def parallelism(self) -> _PlannedSplit: ...


@dataclass(frozen=True)
class Layout:
    """How the ranks are arranged; the product of the degrees is the world size.

    Field names are job.json's `parallelism` keys, so job files written before this type load as they are.
    """

    # Each field is declared once (engine.schema), like the job's settings: the CLI's degree flags, this check,
    # the wizard's spin boxes and the refusals' words come from here. The bounds are generous, far past any real
    # job, and stop a typo before a worker does.
    dp_replicate: int = setting(1, flags="--dp", range=Range(1, 4096), metavar="N", label="Data-parallel replicas",
                                help="Plain data-parallel replicas (DDP, or the replicate dimension of HSDP).")  # fmt: skip
    dp_shard: int = setting(1, flags="--fsdp", range=Range(1, 4096), metavar="N", label="FSDP sharding",
                            help="FSDP2 sharding degree (1: no sharding).")  # fmt: skip
    tp: int = setting(1, flags="--tp", range=Range(1, 512), metavar="N", label="Tensor parallel",
                      help="Tensor-parallel degree.")  # fmt: skip
    pp: int = setting(1, flags="--pp", range=Range(1, 512), metavar="N", label="Pipeline stages",
                      help="Pipeline stages.")  # fmt: skip
    sequence_parallel: bool = setting(False, flags="--sequence-parallel", label="Sequence parallel",
                                      help="With tensor parallelism: split norms and residuals along the sequence.")  # fmt: skip
    # False: parameters stay gathered from forward through backward (FSDP's SHARD_GRAD_OP, the
    # equivalent of ZeRO-2): less communication, more memory than resharding (ZeRO-3).
    reshard_after_forward: bool = setting(True, label="Reshard after forward",
                                          help="FSDP2 frees each block's gathered parameters after its forward.")  # fmt: skip
    pp_schedule: str = setting("1F1B", flags="--pp-schedule", choices=SCHEDULES, parse=lambda t: schedule_name(t) or t,
                               label="Pipeline schedule", help="The pipeline schedule.")  # fmt: skip
    pp_microbatches: int = setting(1, flags="--pp-microbatches", range=Range(1, 4096), metavar="N",
                                   default_words="the number of stages", label="Pipeline micro-batches",
                                   help="Micro-batches per pipeline run.")  # fmt: skip
    # FSDP2's CPUOffloadPolicy: sharded parameters, gradients and the optimizer step live in host RAM.
    cpu_offload: bool = setting(False, flags="--cpu-offload", label="CPU offload",
                                help="FSDP2 CPU offload: parameters, gradients and optimizer state in host RAM.")  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "pp_microbatches"):
            _check_range(name, getattr(self, name), LAYOUT_SETTINGS[name])
        schedule = schedule_name(self.pp_schedule)
        if schedule is None:
            shown = repr(self.pp_schedule[:60]) if isinstance(self.pp_schedule, str) else repr(self.pp_schedule)
            raise UserError(
                f"parallelism setting pp_schedule={shown}: must be one of {', '.join(SCHEDULES)}",
                reason="not_a_choice", setting="parallelism.pp_schedule", value=self.pp_schedule, choices=list(SCHEDULES),
            )  # fmt: skip
        object.__setattr__(self, "pp_schedule", schedule)

    # -- what it is -----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Device-mesh dimensions, outermost first (torch.distributed.init_device_mesh order)."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def runs_ddp(self) -> bool:
        """Whether a training job of this layout runs under DDP: replicas only, no FSDP2 sharding, tensor or pipeline
        parallel and no CPU offload (with those the replicas are FSDP2's; engine.workers.parallelize.uses_fsdp)."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.tp == 1 and self.pp == 1 and not self.cpu_offload

    def sharded(self) -> Layout:
        """The same ranks with every data-parallel replica an FSDP2 shard instead (DDP's replicas as FSDP2's)."""
        # Kept gathered through backward (ZeRO-2): reduce-scatter plus all-gather move what DDP's all-reduce did.
        return dataclasses.replace(self, dp_replicate=1, dp_shard=self.dp, reshard_after_forward=False)

    def words(self) -> str:
        """`dp 2 × fsdp 2 × tp 1 × pp 1`: the degrees as the CLI names them."""
        return f"dp {self.dp_replicate} × fsdp {self.dp_shard} × tp {self.tp} × pp {self.pp}"

    def to_dict(self) -> dict[str, Any]:
        """job.json's `parallelism` object."""
        return dataclasses.asdict(self)

    # -- the ranks ------------------------------------------------------------------------------------
    def fitted(self, ranks: int) -> Layout:
        """This layout on `ranks` ranks: no degrees given (all 1) means plain data parallel over them all."""
        if self.world_size == 1 and ranks > 1:
            return dataclasses.replace(self, dp_replicate=ranks)
        self.check_ranks(ranks)
        return self

    def check_ranks(self, ranks: int) -> None:
        """Refuse a layout whose degrees do not multiply to `ranks`."""
        if self.world_size != ranks:
            raise UserError(
                f"the parallel degrees ({self.words()} = {self.world_size}) must multiply to the number of ranks ({ranks})",
                reason="bad_layout", product=self.world_size, ranks=ranks, **self.mesh_shape,
            )  # fmt: skip

    # -- made from ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        """A job.json `parallelism` object, or the given part of one (the rest default)."""
        if not isinstance(d, dict):
            raise UserError("parallelism must be an object", reason="bad_layout")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_settings(cls, **given: Any) -> Layout:
        """The layout of the settings given (LAYOUT_SETTINGS' names: dp_replicate, tp, …; None or False: not
        given, the default applies): what the command line's degree flags ask for."""
        return cls.from_dict({k: v for k, v in given.items() if v is not None and v is not False})

    @classmethod
    def from_plan(cls, plan: _Planned | _PlannedSplit) -> Layout:
        """The layout a planner `Plan` (or its `parallelism`) runs as: the one mapping of a plan onto degrees.

        ZeRO-3 shards over the plan's sharding degree (HSDP when it is smaller than dp). ZeRO-1/2
        run as FSDP2 over all of dp without resharding after forward, PyTorch's form of ZeRO-2
        (ZeRO-1 has no FSDP2 form; it shards gradients too). CPU offload of either kind is FSDP2's
        CPUOffloadPolicy. The plan's micro-batches per step are the pipeline's when pp > 1.
        """
        par: _PlannedSplit = plan.parallelism if hasattr(plan, "parallelism") else plan  # type: ignore[assignment]
        for name in ("dp", "tp", "pp", "zero_stage", "shard_degree", "grad_accum"):
            value = getattr(par, name)
            if not isinstance(value, int) or isinstance(value, bool):  # plan files are read, not trusted
                raise UserError(
                    f"malformed plan: parallelism.{name} must be a whole number, not {value!r}"[:200],
                    reason="bad_layout", setting=f"plan.parallelism.{name}", value=repr(value)[:60],
                )  # fmt: skip
        dp, zero, degree = par.dp, par.zero_stage, par.shard_degree
        shard = 1
        if zero == 3 and degree >= 1 and dp % degree == 0:
            shard = degree
        elif zero in (1, 2):
            shard = dp
        pipelined = par.pp > 1
        return cls(
            dp_replicate=max(dp // shard, 1),
            dp_shard=shard,
            tp=par.tp,
            pp=par.pp,
            sequence_parallel=bool(par.sequence_parallel) and par.tp > 1,
            reshard_after_forward=zero not in (1, 2) or dp == 1,
            cpu_offload=bool(par.offload_params or par.offload_optimizer),
            pp_schedule=schedule_name(par.pipeline_schedule) or "1F1B",
            pp_microbatches=max(par.grad_accum, 1) if pipelined else 1,
        )


def accumulation_of_plan(plan: _Planned | _PlannedSplit) -> int:
    """Gradient accumulation (schedule runs per optimizer step) of a plan: its micro-batches unless pipelined."""
    par: _PlannedSplit = plan.parallelism if hasattr(plan, "parallelism") else plan  # type: ignore[assignment]
    return 1 if par.pp > 1 else max(par.grad_accum, 1)


# Every field of a Layout, declared ("parallelism.tp" …); the degrees' and micro-batches' ranges from them.
LAYOUT_SETTINGS: dict[str, Setting] = declared(Layout, "parallelism")
MICROBATCH_RANGE = (1, int(LAYOUT_SETTINGS["pp_microbatches"].hi))


def _check_range(name: str, value: Any, decl: Setting) -> None:
    lo, hi = int(decl.lo), int(decl.hi)
    if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(
            f"parallelism setting {name}={value!r}: must be a whole number in [{lo}, {hi}]",
            reason="bad_layout", setting=f"parallelism.{name}", value=repr(value),
        )  # fmt: skip
    shown = f"{value:.3g}" if abs(value) >= 10**12 else str(value)
    raise UserError(
        f"parallelism setting {name}={shown}: must be in [{lo}, {hi}]",
        reason="out_of_range", setting=f"parallelism.{name}", value=value, lo=lo, hi=hi,
    )  # fmt: skip
