"""What a search produces: evaluated candidates, rejected families, suggestions and the result.

Its own module so that the search (which builds these) and the explanation
(which reads them) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rigpilot.engine.planner.plan import HostMemory, Parallelism, Plan, Timing, Workload
from rigpilot.engine.schema import terms_of

if TYPE_CHECKING:  # the memory model runs in the engine; a client reading a result needs only its shape
    from rigpilot.engine.planner.memory import StageMemory

# Families from simplest to most involved: ties in throughput go to the simpler plan.
FAMILY_ORDER = (
    "single GPU", "replicas", "DDP", "ZeRO-1", "ZeRO-2", "FSDP", "HSDP", "tensor parallel", "pipeline", "offload",
)


# Predicted speeds closer than this are within the model's error (tests/unit/test_published_runs.py): among
# them the plan with the most free memory wins, since running out of memory costs more than 5%.
SPEED_TIE = 0.05


# What a plan does not fit (MemoryLimit.code, Rejection.limit): the GPUs' memory, or the machine's host RAM (what
# is pinned there: CPU offload's and the host optimizer's state, the weights as they load). Clients word them.
GPU_MEMORY = "gpu_memory"
HOST_MEMORY = "host_memory"


@dataclass
class Rejection:
    family: str
    reason: str  # may name settings (engine.schema.Words): `reason_terms` in the JSON
    need_bytes: int | None = None  # per GPU, its smallest configuration (host RAM where `limit` says so)
    have_bytes: int | None = None
    limit: str | None = None  # GPU_MEMORY or HOST_MEMORY: what the bytes are of; None: not a matter of memory

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "reason": str(self.reason), "need_bytes": self.need_bytes,
                "have_bytes": self.have_bytes, "limit": self.limit, "reason_terms": terms_of(self.reason)}  # fmt: skip


@dataclass(frozen=True)
class MemoryLimit:
    """The memory a plan does not fit, with its figures: the fullest GPU's (bytes per GPU) or the host's RAM."""

    code: str  # GPU_MEMORY | HOST_MEMORY
    need_bytes: int
    have_bytes: int | None  # None: the host's RAM is unknown
    plan: str  # the plan, described (Parallelism.describe)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "need_bytes": self.need_bytes, "have_bytes": self.have_bytes, "plan": self.plan}


@dataclass
class Suggestion:
    # In words, naming the setting it changes (engine.schema.Words): "train LoRA adapters instead (--method lora)"
    # on the command line; `change_terms` in the JSON, for a client to word with its own controls.
    change: str
    kind: str  # "method" | "quantize" | "seq" | "batch" | "gpus" | "larger-gpus" | "more-gpus"
    plan: Plan  # the best plan with the change, found by searching again
    # The change as facts, for a client to word in its own terms (a flag, a control's label) rather than
    # parse `change`: the `rigpilot plan` option's dest ("seq_len", "method", "quant", "batch", "gpus",
    # "optimizer") and the value it takes there ("lora", "int8", "0,1,2,3"); None for a different machine.
    setting: str | None = None
    value: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"change": str(self.change), "kind": self.kind, "plan": self.plan.to_dict(), "setting": self.setting,
                "value": self.value, "change_terms": terms_of(self.change)}  # fmt: skip


@dataclass
class SearchResult:
    workload: Workload
    machine: str
    gpu_indices: list[int]
    best: Plan | None
    runners_up: list[Plan]
    rejected: list[Rejection]
    suggestions: list[Suggestion]
    explanation: list[str]  # lines that may name settings (engine.schema.Words): `explanation_terms` in the JSON
    considered: int
    fitting: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    runnable: int = 0  # of the fitting plans, those the engine runs (engine.capability.why_not is None)
    nodes: int = 1  # the nodes the search could use (the best plan may use fewer: its parallelism.nodes)
    internode: dict[str, Any] | None = None  # the link between them (cluster.NodeLink.to_dict), None on one node
    # The memory trace's outcome ({"traced": plans traced, "tried": plans tried, "seconds": ...}); None: not traced.
    # Clients word it from these numbers; `notes` has the CLI's line.
    trace: dict[str, Any] | None = None
    # Why the best plan offloads to the CPU (what the leanest plan without CPU offload does not fit) or, with no
    # best plan, what the leanest plan does not fit; None otherwise. `explanation` and the best plan's notes have
    # the CLI's line.
    limit: MemoryLimit | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload.to_dict(),
            "machine": self.machine,
            "gpu_indices": self.gpu_indices,
            "best": self.best.to_dict() if self.best else None,
            "runners_up": [p.to_dict() for p in self.runners_up],
            "rejected": [r.to_dict() for r in self.rejected],
            "suggestions": [s.to_dict() for s in self.suggestions],
            "explanation": [str(line) for line in self.explanation],
            "explanation_terms": [terms_of(line) for line in self.explanation],
            "considered": self.considered,
            "fitting": self.fitting,
            "runnable": self.runnable,
            "elapsed_s": self.elapsed_s,
            "notes": self.notes,
            "nodes": self.nodes,
            "internode": self.internode,
            "trace": self.trace,
            "limit": self.limit.to_dict() if self.limit is not None else None,
        }


@dataclass
class Candidate:
    par: Parallelism
    stages: list[StageMemory]
    host: HostMemory
    fits: bool
    worst_total: float  # the fullest GPU's predicted bytes
    worst_capacity: int
    blocked: str | None = None  # why the search would not pick it (slow links for TP), though it was evaluated
    timing: Timing | None = None
    cannot_run: str = ""  # engine.capability.why_not of its layout; empty when the engine runs it
    recipe: tuple[str, ...] = ()  # the techniques the search added to the recipe asked for (engine.planner.recipes)

    @property
    def family(self) -> str:
        return self.par.family

    @property
    def tokens_per_s(self) -> float:
        return self.timing.tokens_per_s if self.timing else 0.0

    @property
    def runs_here(self) -> bool:
        return not self.cannot_run


def memory_limit(c: Candidate) -> MemoryLimit | None:
    """What `c` does not fit: its fullest GPU's memory first, else the host's RAM; None where it fits both."""
    if c.worst_total > c.worst_capacity:
        return MemoryLimit(GPU_MEMORY, int(c.worst_total), int(c.worst_capacity), c.par.describe())
    if not c.host.fits:
        return MemoryLimit(HOST_MEMORY, c.host.needed, c.host.available, c.par.describe())
    return None


def leanest(cands: list[Candidate]) -> Candidate | None:
    """The candidate nearest to fitting its GPUs (the one "nothing fits" names)."""
    return min(cands, key=lambda c: c.worst_total / max(c.worst_capacity, 1), default=None)
