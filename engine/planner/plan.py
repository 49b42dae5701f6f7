"""The plan: what to run (workload), how to split it (parallelism) and what to expect (predictions).

A `Plan` is plain data that round-trips exactly through JSON: the engine launches
jobs from the JSON, the GUI shows it, exports are made from it. Every field is a
JSON-native type (no tuples, no enums), so `from_dict(to_dict(p)) == p` and
serialising twice gives the same text.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from rigpilot.engine.capability import RecipeContext, recipe_why_not, why_not
from rigpilot.engine.errors import UserError
from rigpilot.engine.layout import Layout, accumulation_of_plan
from rigpilot.engine.recipe import RECIPE_SETTINGS, AskedRecipe, Recipe
from rigpilot.engine.schema import Checkpointing, MasterWeights, Optimizer, Precision, TrainMethod

PLAN_SCHEMA = "rigpilot.plan"
PLAN_VERSION = 1

TASKS = ("train", "infer")
METHODS = tuple(m for m in TrainMethod if m != TrainMethod.SCRATCH)  # the planner plans fine-tuning
PRECISIONS = tuple(Precision)
CHECKPOINTING = tuple(Checkpointing)
SCHEDULES = ("none", "1f1b", "gpipe")
BACKENDS = ("single", "ddp", "deepspeed", "fsdp", "inference")
WEIGHT_BITS = (16, 8, 4)


@dataclass
class LoraSettings:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["all-linear"])  # resolved names once planned
    quant_bits: int = 16  # 4 for QLoRA: base linears in NF4
    double_quant: bool = True  # QLoRA: quantize the absmax constants too (the QLoRA paper's setting)


@dataclass
class Workload(AskedRecipe):
    """What the user asked for, independent of how it is split.

    The training recipe's settings are AskedRecipe's fields (engine.recipe), flat as in job.json's `train`: None
    is open, the search chooses it (or leaves it at its default where it never chooses it); a value pins it. A
    plan's workload holds what the plan was sized for; plans saved before a field existed read it as None, and a
    job keeps its own setting there. master_weights "bf16" holds weights, gradients and AdamW's state in bf16."""

    model: str  # preset name, folder or hub repo id, as given
    task: str = "train"
    method: str = "full"
    precision: str = "bf16"  # training: mixed precision with that dtype; inference: the weights' dtype
    seq_len: int = 2048
    global_batch: int = 16  # training: sequences per optimizer step; inference: sequences in flight
    lora: LoraSettings | None = None
    weight_bits: int = 16  # inference: 16 (precision), 8 (LLM.int8) or 4 (NF4)
    new_tokens: int = 0  # inference: tokens generated per sequence (the rest of seq_len is the prompt)
    token_budget: int | None = None  # training: tokens to train on, for a time to finish

    @property
    def training(self) -> bool:
        return self.task == "train"

    @property
    def prompt_tokens(self) -> int:
        return max(self.seq_len - self.new_tokens, 1)

    @property
    def recipe(self) -> Recipe:
        """The recipe this workload trains with: each setting left open (None) at the engine's plain default."""
        return recipe_of(self)

    def to_dict(self) -> dict[str, Any]:
        """Its JSON: what was asked first, then the recipe (dataclasses put an inherited field first)."""
        d = dataclasses.asdict(self)
        return {**{k: v for k, v in d.items() if k not in RECIPE_SETTINGS}, **{k: d[k] for k in RECIPE_SETTINGS}}


def recipe_of(values: object) -> Recipe:
    """`Recipe.of` for a workload whose settings may be open (None: the declaration's default)."""
    found = {name: getattr(values, name, None) for name in RECIPE_SETTINGS}
    return Recipe(**{k: v for k, v in found.items() if v is not None})


# torchtune's names for the techniques, in the order the search reaches for them.
RECIPE_WORDS = {
    "master_weights": "pure bf16",
    "optimizer": "8-bit AdamW",
    "optimizer_in_backward": "optimizer in backward",
    "loss_chunks": "chunked cross-entropy",
    "activation_offload": "activation offloading",
    "optimizer_offload": "optimizer state in host memory (as torchtune's paged AdamW)",
    "compile": "compiled",
    "fp8": "FP8 matmuls",
}


def recipe_words(w: Any) -> str:
    """The recipe in words a user knows: "pure bf16 + 8-bit AdamW + optimizer in backward"; a plain recipe is its
    precision ("bf16 mixed precision", "fp32"). `w`: a Workload, or a job's TrainSettings (the same names)."""
    r = recipe_of(w)
    parts = []
    if r.master_weights == MasterWeights.BF16:
        parts.append(RECIPE_WORDS["master_weights"])
    if r.optimizer == Optimizer.ADAMW8BIT:
        parts.append(RECIPE_WORDS["optimizer"])
    if r.optimizer_in_backward:
        parts.append(RECIPE_WORDS["optimizer_in_backward"])
    if r.loss_chunks > 1:
        parts.append(f"{RECIPE_WORDS['loss_chunks']} ({r.loss_chunks} chunks)")
    if r.activation_offload:
        parts.append(RECIPE_WORDS["activation_offload"])
    if r.optimizer_offload:
        parts.append(RECIPE_WORDS["optimizer_offload"])
    if r.compile:
        parts.append(RECIPE_WORDS["compile"])
    if r.fp8:
        parts.append(RECIPE_WORDS["fp8"])
    if r.master_weights != MasterWeights.BF16:
        parts.insert(0, "fp32" if w.precision == "fp32" else f"{w.precision} mixed precision")
    return " + ".join(parts)


@dataclass
class Parallelism:
    """How a workload is split over GPUs. Ranks map to `gpu_indices` in order (pp, dp, tp; tp fastest).

    Several machines: the plan spans `nodes` identical nodes and `gpu_indices` are the GPUs it uses on EACH
    node; the degrees dp, tp and pp are global (dp·tp·pp = nodes · len(gpu_indices)). Ranks are node-major
    (torchrun: rank = node_rank · nproc_per_node + local_rank), so rank r runs on node r // len(gpu_indices),
    GPU gpu_indices[r % len(gpu_indices)], and tp <= len(gpu_indices) keeps tensor parallelism inside a node
    (engine.capability refuses anything else). `internode` describes the link between nodes the plan was
    made for (engine.planner.cluster.NodeLink.to_dict: name, label, gbits_per_nic, nics, efficiency, gbs
    achievable per node, latency_s, source); None on one node. Plans saved before these fields read as one node.
    """

    gpu_indices: list[int]
    dp: int = 1  # data-parallel replicas (= dp_replicate × dp_shard)
    tp: int = 1
    pp: int = 1
    # 0: replicated (DDP); 1: optimizer sharded (DeepSpeed only); 2: + gradients (FSDP2 without resharding after
    # forward); 3: + parameters (FSDP2 full sharding)
    zero_stage: int = 0
    shard_degree: int = 1  # ZeRO/FSDP sharding group size; < dp means HSDP (replicate across groups)
    backend: str = "ddp"
    sequence_parallel: bool = False
    pipeline_schedule: str = "none"
    micro_batch: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step per replica (= pipeline micro-batches when pp > 1)
    checkpointing: str = "none"
    # FSDP2's CPU offload moves parameters, gradients and optimizer state together (both flags set); DeepSpeed
    # plans (--export deepspeed) may offload the optimizer alone.
    offload_optimizer: bool = False
    offload_params: bool = False
    stage_layers: list[list[int]] = field(default_factory=list)  # [first, end) layers of each pipeline stage
    nodes: int = 1
    internode: dict[str, Any] | None = None

    @property
    def gpus_per_node(self) -> int:
        return len(self.gpu_indices) if self.nodes > 1 else self.world_size

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def layout(self) -> Layout:
        """How a job runs this split: engine.layout's one mapping of a plan onto degrees."""
        return Layout.from_plan(self)

    @property
    def replicate_degree(self) -> int:
        return self.layout.dp_replicate

    @property
    def offload(self) -> bool:
        return self.offload_optimizer or self.offload_params

    @property
    def reshard_after_forward(self) -> bool:
        """False for FSDP2's ZeRO-2 form: every unit stays gathered from its forward through its backward."""
        return self.layout.reshard_after_forward

    @property
    def hsdp(self) -> bool:
        lt = self.layout
        return self.zero_stage == 3 and lt.dp_replicate > 1 and lt.dp_shard > 1

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Device-mesh dimensions, outermost first (torch.distributed.init_device_mesh order)."""
        return self.layout.mesh_shape

    @property
    def family(self) -> str:
        """The family a plan belongs to, for ranking summaries and rejection reasons."""
        if self.pp > 1:
            return "pipeline"
        if self.tp > 1:
            return "tensor parallel"
        if self.backend == "inference":
            return "replicas" if self.dp > 1 else "single GPU"
        if self.offload_params or self.offload_optimizer:
            return "offload"
        if self.world_size == 1:
            return "single GPU"
        if self.hsdp:
            return "HSDP"
        return {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}[self.zero_stage]

    def describe(self) -> str:
        """One line: 'FSDP (ZeRO-3) over 8 GPUs, micro-batch 2 × 2 accumulation, full checkpointing'."""
        text = self._describe()
        if self.nodes > 1:
            link = (self.internode or {}).get("label")
            text += f", on {self.nodes} nodes of {len(self.gpu_indices)} GPUs" + (f" joined by {link}" if link else "")
        return text

    def _describe(self) -> str:
        parts = []
        n = self.world_size
        if self.backend == "inference":
            if self.tp > 1:
                parts.append(f"tensor parallel over {self.tp} GPUs")
            if self.pp > 1:
                parts.append(f"layers split over {self.pp} GPUs")
            if self.dp > 1:
                parts.append(f"{self.dp} independent replicas")
            return ", ".join(parts) or "one GPU"
        fsdp_offload = self.backend == "fsdp" and self.offload
        if fsdp_offload:
            parts.append("FSDP2 (ZeRO-3) with CPU offload " + (f"over {self.dp}" if self.dp > 1 else "on one GPU"))
        elif n == 1:
            parts.append("one GPU")
        elif self.hsdp:
            parts.append(f"HSDP: FSDP2 sharded over {self.shard_degree}, replicated ×{self.replicate_degree}")
        elif self.dp > 1:
            if self.backend == "deepspeed":
                name = f"DeepSpeed ZeRO-{self.zero_stage}" if self.zero_stage else "DeepSpeed data parallel"
            elif self.backend == "fsdp" and self.zero_stage in (1, 2):
                name = "FSDP2"
            else:
                name = {0: "DDP", 3: "FSDP2 (ZeRO-3)"}.get(self.zero_stage, f"ZeRO-{self.zero_stage}")
            parts.append(f"{name} over {self.dp}")
            if self.backend != "deepspeed" and not self.reshard_after_forward:
                parts.append("parameters kept gathered through backward (ZeRO-2)")
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}" + (" with sequence parallel" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"{self.pp} pipeline stages ({self.pipeline_schedule.upper()})")
        parts.append(f"micro-batch {self.micro_batch} × {self.grad_accum} accumulation")
        if self.checkpointing != "none":
            parts.append(f"{self.checkpointing} activation checkpointing")
        if self.backend != "fsdp" and self.offload_params:
            parts.append("parameters and optimizer offloaded to CPU")
        elif self.backend != "fsdp" and self.offload_optimizer:
            parts.append("optimizer offloaded to CPU")
        return ", ".join(parts)


@dataclass
class MemoryBreakdown:
    """Predicted peak memory of one GPU, in bytes. `total` is the sum of the parts."""

    gpu: int
    stage: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    kv_cache: int
    buffers: int  # communication buckets, gathered FSDP units, logits and loss, optimizer-step temporaries
    overhead: int  # CUDA context, NCCL, allocator reserve
    total: int
    capacity: int  # the GPU's memory
    headroom: int  # capacity - the larger of total and traced (negative: does not fit)
    # Bytes of a traced step of the engine's own model plus `overhead` (planner.verify), None when not traced.
    traced: int | None = None
    node: int = 0  # multi-node plans: the node this GPU is on (`gpu` is its index there)

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    @property
    def shown_total(self) -> int:
        """The larger of the formula's and the trace's figure: the one the plan counts."""
        return max(self.total, self.traced or 0)


@dataclass
class HostMemory:
    needed: int  # bytes of host RAM the job needs at its peak (loading or offloaded state)
    available: int | None  # the machine's RAM, None when unknown
    offloaded: int = 0  # of `needed`, optimizer state or parameters moved off the GPUs

    @property
    def fits(self) -> bool:
        return self.available is None or self.needed <= self.available


@dataclass
class CommItem:
    what: str  # "FSDP all-gather + reduce-scatter", "TP all-reduce", ...
    group: list[int]  # GPU indices of one such group
    link: str  # the binding link in words
    bytes_per_step: int
    seconds: float  # total time on the wire per step
    exposed_seconds: float  # not hidden behind compute


@dataclass
class Figure:
    """A number the prediction rests on, and whether it was measured or assumed."""

    name: str
    value: float
    unit: str
    source: str  # "measured" | "spec" | "assumed"


@dataclass
class Timing:
    """Predicted time of one optimizer step (training) or one generation batch (inference)."""

    step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    offload_s: float = 0.0
    tokens_per_s: float = 0.0  # trained tokens/s, or generated tokens/s
    mfu: float = 0.0  # model FLOPs utilisation over the plan's GPUs
    time_to_budget_s: float | None = None
    prefill_s: float = 0.0  # inference: time to first token
    decode_token_s: float = 0.0  # inference: time per generated token (per sequence)
    comm: list[CommItem] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)


@dataclass
class Plan:
    workload: Workload
    parallelism: Parallelism
    memory: list[MemoryBreakdown]
    host: HostMemory
    timing: Timing
    machine: str  # the machine's label
    gpu_names: list[str]  # names of the plan's GPUs, in rank order
    model_params: int
    model_type: str = ""
    architecture: str = ""
    notes: list[str] = field(default_factory=list)
    schema_version: int = PLAN_VERSION
    # engine.capability.why_not of the plan's layout: whether a Rigpilot job runs this plan, and if not, why.
    runs_here: bool = True
    runs_here_reason: str = ""
    # planner.verify: "traced: <how>, <seconds>" or "not verified: <reason>"; empty when not attempted.
    verification: str = ""
    # Multi-node plans: how they scale against the best plan on one of their nodes (engine.planner.scaling):
    # nodes, one_node_tokens_per_s (None where nothing fits on one node), speedup, efficiency (speedup / nodes),
    # internode_s (per step on the link between nodes) and internode_exposed_s (of it, not hidden). None on one node.
    scaling: dict[str, Any] | None = None

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory) and self.host.fits

    @property
    def peak_memory(self) -> MemoryBreakdown:
        return min(self.memory, key=lambda m: (m.headroom, m.gpu))

    # -- JSON --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {"schema": PLAN_SCHEMA, **dataclasses.asdict(self)}
        d["workload"] = self.workload.to_dict()
        # Derived, for launchers that build a device mesh; ignored when read back.
        d["parallelism"]["world_size"] = self.parallelism.world_size
        d["recipe"] = recipe_words(self.workload) if self.workload.training else ""
        try:
            layout = self.parallelism.layout
        except UserError:  # a hand-edited plan past the degrees' ranges: shown as it is, refused when run
            return d
        d["parallelism"]["mesh_shape"] = layout.mesh_shape
        d["parallelism"]["family"] = self.parallelism.family
        d["parallelism"]["reshard_after_forward"] = layout.reshard_after_forward
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("schema", PLAN_SCHEMA) != PLAN_SCHEMA:
            raise UserError(f"not a Rigpilot plan (schema {d.get('schema')!r})", reason="not_a_plan")
        version = d.get("schema_version")
        if version is None and isinstance(d.get("parallelism"), dict) and isinstance(d.get("workload"), dict):
            version = 1  # written by hand, or by a script: its layout and workload are what a job needs
        if not isinstance(version, int) or isinstance(version, bool):
            raise UserError("not a Rigpilot plan: it has no schema_version (write one with 'rigpilot plan --json')",
                            reason="not_a_plan")  # fmt: skip
        if version > PLAN_VERSION:
            raise UserError(f"plan schema version {version} is newer than this Rigpilot understands ({PLAN_VERSION})",
                            reason="plan_too_new", version=version, understood=PLAN_VERSION)  # fmt: skip
        try:
            w = dict(d["workload"])
            w["lora"] = LoraSettings(**w["lora"]) if w.get("lora") else None
            # A hand-made plan may say only how to run: predictions it lacks are zero, as for a plan not measured.
            t = dict(d.get("timing") or {"step_s": 0.0, "compute_s": 0.0, "exposed_comm_s": 0.0, "bubble_s": 0.0})
            t["comm"] = [CommItem(**c) for c in t.get("comm", [])]
            t["figures"] = [Figure(**f) for f in t.get("figures", [])]
            par = parallelism_from_dict(d["parallelism"])
            if not isinstance(par.nodes, int) or isinstance(par.nodes, bool) or par.nodes < 1:
                raise UserError(f"malformed plan: parallelism.nodes must be a whole number of at least 1, not {par.nodes!r}")
            if par.internode is not None and not isinstance(par.internode, dict):
                raise UserError("malformed plan: parallelism.internode must be an object or null")
            scaling = d.get("scaling")
            plan = cls(
                workload=Workload(**w),
                parallelism=par,
                memory=[MemoryBreakdown(**m) for m in d.get("memory") or []],
                host=HostMemory(**(d.get("host") or {"needed": 0, "available": None})),
                timing=Timing(**t),
                machine=str(d.get("machine") or ""),
                gpu_names=list(d.get("gpu_names") or []),
                model_params=d.get("model_params") or 0,
                model_type=d.get("model_type", ""),
                architecture=d.get("architecture", ""),
                notes=list(d.get("notes", [])),
                schema_version=version,
                verification=str(d.get("verification") or ""),
                scaling=scaling if isinstance(scaling, dict) else None,
            )
        except (KeyError, TypeError) as e:
            raise UserError(f"malformed plan: {e}") from e
        if isinstance(d.get("runs_here"), bool):
            plan.runs_here, plan.runs_here_reason = d["runs_here"], str(d.get("runs_here_reason") or "")
        else:  # plans saved before these fields existed are judged now, by the same contract
            plan.runs_here_reason = refusal(plan)
            plan.runs_here = not plan.runs_here_reason
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise UserError(f"plan is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise UserError("plan JSON must be an object")
        return cls.from_dict(d)


_PARALLELISM_FIELDS = {f.name for f in dataclasses.fields(Parallelism)}


def parallelism_from_dict(d: dict[str, Any]) -> Parallelism:
    """A plan's `parallelism` object; the derived fields `to_dict` adds (world_size, mesh_shape …) are ignored."""
    return Parallelism(**{k: v for k, v in d.items() if k in _PARALLELISM_FIELDS})


def refusal(plan: Plan) -> str:
    """Why the engine would refuse the plan, or "" when a job runs it: the one capability contract."""
    return refusal_of(plan.parallelism, plan.workload, plan.model_type)


def refusal_of(
    par: Parallelism, w: Workload, model_type: str, *, gpu_capability: tuple[int, int] | None = None,
    cpu_ranks: bool = False,
) -> str:  # fmt: skip
    """engine.capability.why_not of the job a plan with `par` for `w` asks for, then recipe_why_not of its
    training recipe ("" when the engine runs it). `gpu_capability` (the lowest of the GPUs') and `cpu_ranks`
    (a simulated machine) are what the recipe's refusals depend on beyond the plan."""
    try:
        layout = Layout.from_plan(par)
    except UserError as e:  # degrees past any real job: a hand-edited plan
        return str(e)
    training = w.task != "infer"
    per_node = min(len(par.gpu_indices), par.world_size // max(par.nodes, 1)) if par.nodes > 1 else 0
    reason = why_not(
        layout, "train" if training else "infer", method=w.method if training else "full",
        optimizer=w.optimizer or "adamw" if training else "adamw", weight_bits=w.weight_bits,
        model_type=model_type or None, nodes=par.nodes, gpus_per_node=per_node,
    )  # fmt: skip
    if reason:
        return reason
    if training:
        ctx = RecipeContext(method=w.method, precision=w.precision, grad_accum=accumulation_of_plan(par),
                            gpu_capability=gpu_capability, cpu_ranks=cpu_ranks)  # fmt: skip
        return recipe_why_not(recipe_of(w), layout, ctx) or ""
    return ""
