"""What the engine can run: the one answer the planner, the submission path and the workers share.

The planner marks every plan it ranks with `why_not` of `Layout.from_plan(plan)` (engine.planner.plan.refusal)
(`runs_here` in the plan's JSON) and ranks plans the engine would refuse
below every plan it runs; a submission is refused with the same sentence
before anything is created for it; the workers read their model-family tables
from here. So a plan shown as "best" is one a job runs, and the reason a plan
cannot run reads the same everywhere.

Plain Python: the GUI, the CLI and the planner import it without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rigpilot.engine import schema
from rigpilot.engine.layout import Layout
from rigpilot.engine.recipe import Recipe

TRAIN_METHODS = tuple(schema.TrainMethod)
TRAIN_OPTIMIZERS = tuple(schema.Optimizer)
# torchao's float8 training needs FP8 tensor cores: Ada (8.9) and Hopper (9.0) or newer.
FP8_MIN_CAPABILITY = (8, 9)

# Decoders whose blocks are Llama's: q/k/v/o and gate/up/down projections, rotary embeddings at
# the model level. Other model types are refused rather than split wrongly.
LLAMA_STYLE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Llama's blocks with other norms around them, a scaled embedding (in the embedding module) and,
# for Gemma 2, soft-capped attention and final logits.
GEMMA_TYPES = ("gemma", "gemma2")
# Llama's attention with mixture-of-experts MLPs. Under tensor parallel the attention is split and
# the experts (fused 3-D parameters in transformers 5), router and shared experts are replicated:
# every TP rank computes every expert, so TP saves attention memory only; the MLP of a dense layer
# (Qwen-MoE's mlp_only_layers) is split as usual.
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Phi-3's fused qkv_proj and gate_up_proj cannot be split column-wise as one matrix (each rank
# would get all of q, none of v), so it runs with pipeline parallel but not tensor parallel.
FUSED_PROJECTION_TYPES = ("phi3",)
TENSOR_PARALLEL_TYPES = LLAMA_STYLE_TYPES + GEMMA_TYPES + MOE_TYPES
PIPELINE_TYPES = TENSOR_PARALLEL_TYPES + FUSED_PROJECTION_TYPES


def why_not(
    layout: Layout,
    kind: str = "train",
    *,
    method: str = "full",
    optimizer: str = "adamw",
    weight_bits: int = 16,
    model_type: str | None = None,
    nodes: int = 1,
    gpus_per_node: int = 0,
) -> str | None:
    """None when the engine runs a `kind` job ("train" | "infer") of `layout`; otherwise the one-line reason it
    cannot (no trailing period).

    `method` and `optimizer` are training's; `weight_bits` inference's (16: the precision, 8 or 4);
    `model_type` is config.json's, None when not known yet (the worker checks); a job over `nodes` > 1
    machines runs `gpus_per_node` ranks on each. The layout's degrees are valid by construction.
    """
    lt = layout
    if nodes < 1:
        return "a job spans at least one node"
    if nodes > 1 and lt.tp > 1 and lt.tp > gpus_per_node:
        # TP all-reduces every layer's activations, forward and backward: over the link between machines that
        # is the step itself, so the planner never proposes it and the engine never starts it.
        return (
            f"tensor parallel over {lt.tp} GPUs would cross nodes of {gpus_per_node} GPUs: "
            f"keep tp at most {gpus_per_node} and split across nodes with data or pipeline parallel"
        )
    mt = model_type
    if kind == "train":
        if method not in TRAIN_METHODS:
            return f"unknown training method {method!r}; choose one of {', '.join(TRAIN_METHODS)}"
        if optimizer not in TRAIN_OPTIMIZERS:
            return f"unknown optimizer {optimizer!r}; choose one of {', '.join(TRAIN_OPTIMIZERS)}"
        if lt.cpu_offload and (lt.tp > 1 or lt.pp > 1):
            return "CPU offload runs with FSDP2 data parallelism only, not with tensor or pipeline parallel"
        if method == "qlora" and (lt.tp > 1 or lt.pp > 1):
            # torchao's NF4 tensors shard under FSDP2 (their all-gather hooks) and replicate under DDP;
            # splitting them across tensor-parallel ranks or pipeline stages is not built or tested.
            return "QLoRA runs with data parallelism (DDP or FSDP), not with tensor parallel or pipeline parallel"
        if method == "qlora" and lt.cpu_offload:
            return "QLoRA's 4-bit base weights are not offloaded to the CPU: QLoRA without offload needs less memory"
    elif kind == "infer":
        if weight_bits != 16:
            return f"{weight_bits}-bit inference is not run by Rigpilot jobs yet; plan it in bf16 or fp16"
        if lt.cpu_offload:
            return "inference jobs do not offload to the CPU"
    if lt.tp > 1 and mt in FUSED_PROJECTION_TYPES:
        return f"tensor parallel cannot split {mt!r}'s fused qkv_proj and gate_up_proj: use pipeline parallel or FSDP"
    if lt.tp > 1 and mt is not None and mt not in TENSOR_PARALLEL_TYPES:
        return f"tensor parallel runs {_types(TENSOR_PARALLEL_TYPES)}; model type {mt!r} is not one of them"
    if lt.pp > 1 and mt is not None and mt not in PIPELINE_TYPES:
        return f"pipeline parallel runs {_types(PIPELINE_TYPES)}; model type {mt!r} is not one of them"
    return None


# -- the training recipe -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecipeContext:
    """What a recipe's refusals depend on besides the recipe and the layout."""

    method: str = "full"
    precision: str = "bf16"
    grad_accum: int = 1
    grad_clip: float = 0.0
    # The GPUs' compute capability (lowest of them), None where jobs run as CPU ranks (simulated machines) or
    # it is not known yet (the worker checks again on its device).
    gpu_capability: tuple[int, int] | None = None
    cpu_ranks: bool = False  # the job runs as CPU ranks (a simulated machine)
    # The model is a causal LM with an output head (engine.models.formulas.is_decoder of its config.json; the rank
    # asks its loaded model). True where the model is not known yet: a hub id the worker resolves checks again.
    decoder: bool = True


def recipe_why_not(recipe: Recipe, layout: Layout, ctx: RecipeContext) -> str | None:
    """None when the engine trains `layout` with `recipe`; otherwise the one-line reason it cannot (no period).

    One check per technique, each in its own function below, so each reads as the contract it states.
    """
    for check in _RECIPE_CHECKS:
        why = check(recipe, layout, ctx)
        if why is not None:
            return why
    return None


def _master_weights(r: Recipe, lt: Layout, ctx: RecipeContext) -> str | None:
    if r.master_weights == schema.MasterWeights.BF16 and ctx.precision != schema.Precision.BF16:
        return f"bf16 master weights need bf16 precision (it is {ctx.precision})"
    if r.master_weights == schema.MasterWeights.BF16 and lt.cpu_offload and lt.world_size > 1:
        # torchao's compiled step fails on FSDP2's CPU-offloaded shards once they are split over several ranks
        # ('Tensor' object has no attribute 'codes'); on one rank it runs.
        return (
            "pure bf16's stochastically rounded step does not run on CPU-offloaded shards over several GPUs: "
            "use fp32 master weights with CPU offload"
        )
    return None


def _optimizer(r: Recipe, lt: Layout, ctx: RecipeContext) -> str | None:
    if r.optimizer not in TRAIN_OPTIMIZERS:
        return f"unknown optimizer {r.optimizer!r}; choose one of {', '.join(TRAIN_OPTIMIZERS)}"
    # torchao's 8-bit moments run and checkpoint on one rank, DDP, FSDP2 and tensor parallel
    # (tests/workers/test_workers_optimizers.py), and train on pipeline stages. bitsandbytes' paged variant
    # (CUDA only) is not installed with Rigpilot, so it is not offered.
    if r.optimizer == schema.Optimizer.ADAMW8BIT and lt.cpu_offload:
        return "8-bit AdamW steps on the GPU; with CPU offload the optimizer runs on the host: use AdamW there"
    return None


def _optimizer_in_backward(r: Recipe, lt: Layout, ctx: RecipeContext) -> str | None:
    if not r.optimizer_in_backward:
        return None
    if ctx.grad_accum > 1:
        return (
            "the optimizer step in backward updates each weight as its gradient arrives, so gradients cannot "
            f"be accumulated over {ctx.grad_accum} micro-batches: use gradient accumulation 1"
        )
    if lt.pp > 1:
        return "the optimizer step in backward cannot run with pipeline parallel (its micro-batches accumulate)"
    if ctx.grad_clip > 0:
        return (
            "the optimizer step in backward updates each weight before the whole gradient's norm is known, "
            "so it cannot clip: use gradient clipping 0"
        )
    if ctx.precision == schema.Precision.FP16:
        return "the optimizer step in backward cannot run under fp16's loss scaling: use bf16"
    if lt.cpu_offload:
        return "the optimizer step in backward runs on the GPU; with CPU offload the optimizer runs on the host"
    if lt.runs_ddp:
        # DDP all-reduces gradients in buckets that hold every gradient until the whole backward is done, so
        # stepping each weight early frees nothing; one GPU and FSDP2 (which frees each shard's gradient as its
        # weight is stepped) are where it saves memory.
        return (
            "the optimizer step in backward saves no memory under DDP, whose all-reduce buckets keep every "
            "gradient: shard with FSDP2 (--fsdp N) or drop the optimizer step in backward"
        )
    return None


def _loss_chunks(r: Recipe, lt: Layout, ctx: RecipeContext) -> str | None:
    # Runs on every layout (engine.workers.chunked_loss; tests/workers/test_workers_activation_layouts.py: one
    # rank, DDP, FSDP2 with accumulation, TP with the vocabulary-parallel loss, PP, PP x FSDP2, CPU offload).
    if (r.loss_chunks or 1) > 1 and not ctx.decoder:
        return "loss chunks apply a decoder's output head a chunk at a time; this model has none: use loss chunks 1"
    return None


def _activation_offload(r: Recipe, lt: Layout, ctx: RecipeContext) -> str | None:
    # Runs on every layout, beside every checkpointing mode and compiled blocks, bit for bit the same training
    # (engine.workers.activation_offload; tests/workers/test_workers_activation_*.py).
    return None


def _optimizer_offload(r: Recipe, lt: Layout, ctx: RecipeContext) -> str | None:
    if not r.optimizer_offload:
        return None
    if lt.world_size > 1:
        return (
            "the optimizer state in host memory runs on one GPU; with several, shard it with FSDP2 "
            "(CPU offload) instead"
        )
    if lt.cpu_offload:
        return "CPU offload already keeps the optimizer state in host memory: use one or the other"
    if r.optimizer_in_backward:
        return (
            "the optimizer state in host memory already steps each weight apart on the CPU: "
            "drop the optimizer step in backward"
        )
    if r.optimizer == schema.Optimizer.ADAMW8BIT:
        return "8-bit AdamW runs on the GPU; with the optimizer state in host memory the step is CPU AdamW"
    if ctx.precision == schema.Precision.FP16:
        # GradScaler unscales and checks the gradients on the GPU, which have left for the host by then.
        return "the optimizer state in host memory cannot run under fp16's loss scaling: use bf16"
    return None


def _compile(r: Recipe, lt: Layout, ctx: RecipeContext) -> str | None:
    return None


def fp8_hardware_why_not(*, cpu_ranks: bool, capability: tuple[int, int] | None) -> str | None:
    """Why the ranks' devices cannot run FP8 matmuls, or None: the contract's words, which the worker repeats
    on the device it really has (engine.workers.compile). `capability` None: not known."""
    if cpu_ranks:
        return "FP8 matmuls need a GPU of compute capability 8.9 or newer; this job runs as CPU ranks"
    cc = capability
    if cc is not None and tuple(cc) < FP8_MIN_CAPABILITY:
        return (
            f"FP8 matmuls need a GPU of compute capability 8.9 or newer (Ada, Hopper); these GPUs are {cc[0]}.{cc[1]}"
        )
    return None


def _fp8(r: Recipe, lt: Layout, ctx: RecipeContext) -> str | None:
    if not r.fp8:
        return None
    why = fp8_hardware_why_not(cpu_ranks=ctx.cpu_ranks, capability=ctx.gpu_capability)
    if why is not None:
        return why
    if ctx.precision != schema.Precision.BF16:
        return f"FP8 matmuls run under bf16 precision (it is {ctx.precision})"
    if ctx.method in (schema.TrainMethod.LORA, schema.TrainMethod.QLORA):
        # torchao converts plain linear layers; LoRA's wrap their frozen base layer (QLoRA's is 4-bit NF4).
        return f"FP8 matmuls train full fine-tunes and models from scratch, not {ctx.method}'s adapters"
    return None


_RECIPE_CHECKS: tuple[Callable[[Recipe, Layout, RecipeContext], str | None], ...] = (
    _master_weights,
    _optimizer,
    _optimizer_in_backward,
    _loss_chunks,
    _activation_offload,
    _optimizer_offload,
    _compile,
    _fp8,
)


# -- the inference backend ------------------------------------------------------------------------------------

# "transformers": Rigpilot's own generator (engine.workers.infer), which runs every layout above.
# "vllm": vLLM's offline LLM class (engine.workers.infer_vllm), where it is installed and the job fits it.
INFER_BACKENDS = tuple(schema.InferBackend)  # the names; `BackendChoice` below is the one chosen
# vLLM's SamplingParams takes temperatures in [0, 2] and raises one in (0, 0.01) to 0.01
# (vllm/sampling_params.py: _MAX_TEMP and _verify_args).
VLLM_MAX_TEMPERATURE = 2.0
VLLM_MIN_TEMPERATURE = 0.01


@dataclass(frozen=True)
class WorkerVllm:
    """What the worker environment says of vLLM, asked without importing it (engine.runtime.worker_vllm)."""

    python: str | None  # the interpreter the job's process starts with
    version: str | None  # None: not installed there
    problem: str | None = None  # the environment could not be asked (no interpreter, it failed)


@dataclass(frozen=True)
class BackendChoice:
    """Which generator an inference job runs, and why; `refusal` is the one line when the one asked for cannot."""

    name: str  # "transformers" | "vllm": what runs
    asked: str  # "auto" | "transformers" | "vllm"
    reason: str  # why it runs, in words (for "auto": why this one and not the other)
    refusal: str | None = None


def vllm_why_not(
    layout: Layout,
    *,
    simulated: bool,
    temperature: float = 0.0,
    nodes: int = 1,
    slurm: bool = False,
    weight_bits: int = 16,
) -> str | None:
    """None when an inference job of `layout` can run on vLLM (vLLM being installed aside); else why not.

    Rigpilot runs one vLLM engine per job on one machine's real GPUs, its tensor and pipeline degrees
    the plan's; anything else runs on Rigpilot's own generator, which covers every layout.
    """
    lt = layout
    if simulated:
        return "the machine's GPUs are simulated and jobs run as CPU ranks; vLLM needs real CUDA GPUs"
    if slurm:
        return "a SLURM job runs on the cluster's nodes, whose environment Rigpilot has not checked for vLLM"
    if nodes > 1:
        return f"the job spans {nodes} nodes; Rigpilot runs vLLM on one node"
    dp = lt.dp
    if dp > 1:
        return (
            f"the layout has data parallel {dp}; Rigpilot runs one vLLM engine per job, split by tensor and "
            "pipeline parallel only (give --tp/--pp degrees that use every GPU)"
        )
    if lt.cpu_offload or weight_bits != 16:
        return "vLLM jobs run 16-bit weights without CPU offload"
    if 0 < temperature < VLLM_MIN_TEMPERATURE:
        return f"temperature {temperature:g} is below the {VLLM_MIN_TEMPERATURE:g} vLLM's SamplingParams raises it to"
    if temperature > VLLM_MAX_TEMPERATURE:
        return f"temperature {temperature:g} is above the {VLLM_MAX_TEMPERATURE:g} vLLM's SamplingParams accepts"
    return None


def choose_infer_backend(
    asked: str,
    layout: Layout,
    *,
    simulated: bool,
    worker_vllm: Callable[[], WorkerVllm],
    temperature: float = 0.0,
    nodes: int = 1,
    slurm: bool = False,
) -> BackendChoice:
    """The one decision of which backend an inference job runs: submit, --check and the job views use it.

    `worker_vllm` is called only when everything else allows vLLM, so a simulated machine or a layout
    vLLM does not take never starts the worker interpreter to ask.
    """
    if asked == "transformers":
        return BackendChoice("transformers", asked, "asked for")
    how = "asked for" if asked == "vllm" else "chosen automatically"
    why = vllm_why_not(layout, simulated=simulated, temperature=temperature, nodes=nodes, slurm=slurm)
    fix = ""
    if why is None:
        found = worker_vllm()
        where = found.python or "no interpreter"
        if found.problem:
            why, fix = f"the worker environment could not be asked about vLLM ({found.problem})", "repair it or "
        elif found.version is None:
            why, fix = f"vLLM is not installed in the worker environment ({where})", "install it there or "
        else:
            degrees = f"tensor parallel {layout.tp} × pipeline parallel {layout.pp}"
            return BackendChoice("vllm", asked, f"{how}: vLLM {found.version} in the worker environment, {degrees}")
    if asked == "vllm":
        return BackendChoice(
            "transformers", asked, why, refusal=f"backend vllm: {why}; {fix}use --backend transformers"
        )
    return BackendChoice("transformers", asked, f"{how}: {why}")


def backend_words(name: str, reason: str = "") -> str:
    """`transformers — chosen automatically: vLLM is not installed …`: the backend as job views show it."""
    shown = "vLLM" if name == "vllm" else "transformers (Rigpilot's own generator)"
    return f"{shown} — {reason}" if reason else shown


def _types(types: tuple[str, ...]) -> str:
    return f"Llama-style decoders ({', '.join(types)})"
