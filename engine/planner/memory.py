"""GPU memory: what a training step or a generation batch holds at its peak, per GPU.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (their s·b·h·(34 + 5·a·s/h) per layer), adapted to what
PyTorch and Hugging Face transformers actually keep today:

* SDPA / flash attention saves q, k, v, the output and a log-sum-exp per head,
  never the s×s scores, so the 5·a·s/h term is gone;
* there is no dropout in modern decoders, so no masks;
* the sizes come from the model's own shapes (GQA's narrower k and v, SwiGLU's
  three MLP tensors, the MoE's top-k experts) and dtypes: under torch.autocast
  with fp32 weights the residual stream stays fp32, RMSNorm saves an fp32 copy
  of its input, every linear saves its own bf16 cast of an fp32 input, and the
  bf16 casts of the weights are kept for backward;
* frozen linears (LoRA's base, QLoRA's 4-bit layers) save nothing for their
  weights; adapters save their own copy of the input.

Checked tensor by tensor against `saved_tensors_hooks` on the Llama
implementation of transformers 5 (fp32, bf16 autocast, pure bf16, LoRA, with and
without checkpointing). Loss and logits add 4·V bytes per token saved (the fp32
log-softmax) plus transient logits, often the peak for small models.

Sharding follows the FSDP2 layout the engine runs (fp32 shards, bf16 all-gathered
units): its ZeRO-2 form keeps every unit gathered from forward through backward,
so all blocks' compute-dtype parameters are held at the end of forward; its CPU
offload keeps no sharded state on the GPU (parameter, gradient and AdamW shards,
16 bytes per parameter over the sharding degree, sit in pinned host RAM) and only
stages each unit's fp32 shards on the way in and out. DeepSpeed plans (made only
for --export deepspeed) follow the ZeRO paper's accounting (Rajbhandari et al. 2020).

The training recipe (engine.recipe; `MemoryModel` takes it from its workload, each setting left open at its
plain default): pure bf16 holds weights, gradients and AdamW's moments in 2 bytes; 8-bit AdamW (torchao) holds
both moments as uint8 codes with an fp32 scale per block of 256; the optimizer step in backward frees each
gradient as soon as its parameter is updated, so one parameter's gradient (its shard under FSDP2) exists at a
time instead of all of them, except under DDP, whose buckets hold every gradient anyway; chunked cross-entropy
keeps 1/chunks of the fp32 logits and their bf16 chunk; activation offloading moves what the blocks save for
backward to pinned host RAM, keeping a window of OFFLOAD_WINDOW_LAYERS blocks (the one computing and the one
prefetched) and the head and loss's on the GPU; the optimizer state in host memory (one GPU) keeps the master
copy, the gradients and AdamW's state of every tensor but the small ones in pinned host RAM (counted against the
machine's RAM as CPU offload's is) and leaves the GPU the weights and one gradient on its way out. torch.compile is counted at eager's memory: torchtitan reports
a smaller peak for compiled blocks, but how much depends on the fusions inductor picks, so the formula keeps
eager's as the bound. FP8 matmuls are counted as bf16 (torchao's float8 keeps bf16 weights, and what it saves
for backward is no larger than bf16's).
"""

from __future__ import annotations

from dataclasses import dataclass

from rigpilot.engine.errors import UserError
from rigpilot.engine.models.spec import Linear, ModelSpec
from rigpilot.engine.planner.allocator import reserved_for
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.model import LinearUse, ModelFacts, model_facts
from rigpilot.engine.planner.plan import HostMemory, LoraSettings, MemoryBreakdown, Parallelism, Workload, recipe_of
from rigpilot.engine.recipe import Recipe
from rigpilot.engine.schema import ADAPTER_METHODS, Precision

GIB = 1024**3
MIB = 1024**2

DDP_BUCKET_BYTES = 25 * MIB  # torch DDP's default bucket_cap_mb
DEEPSPEED_BUCKET_ELEMENTS = 50_000_000  # reduce/all-gather bucket sizes the DeepSpeed export sets
CUDA_CONTEXT_BYTES = int(0.55 * GIB)  # context + cuBLAS/cuDNN workspaces on Ampere/Ada
CUDA_CONTEXT_BYTES_LARGE = int(0.75 * GIB)  # Hopper/Blackwell load more kernels into the context
NCCL_BYTES_PER_GROUP = int(0.25 * GIB)  # ring/tree buffers of one communicator
ALLOCATOR_RESERVE = 0.05  # inference: caching-allocator fragmentation and rounding, as a share of what is allocated
ALLOCATOR_MIN_BYTES = 128 * MIB
# Training: the caching allocator's reserve beyond the tensors (engine.planner.allocator has its rules), measured
# by replaying the engine's traced step through those rules (benchmarks/allocator_replay.py, Llama-3.1-8B widths,
# one GPU, LoRA and full, 2 and 4 blocks, micro-batch 1 and 2): the reserved peak exceeds the allocated one by
# 0.38-0.39 of the loss's logits tensors, whatever the number of blocks (the fp32 logits, their softmax and
# gradient are freed and requested again at other sizes, and the blocks they leave serve nothing else), plus,
# under full fine-tuning, the optimizer's fp32 temporaries of parameters larger than any block forward and
# backward freed (the embedding and head: they take new segments).
LOSS_FRAGMENTATION = 0.39
# engine.workers.optimizer_offload.STAGING_BUFFERS: pinned buffers of the largest tensor a later micro-batch's
# gradients pass through (the planner does not import the workers).
STAGING_BUFFERS = 2
HOST_BYTES_PER_RANK = int(2.5 * GIB)  # Python, torch, CUDA runtime and pinned staging of one process
LOAD_SHARD_BYTES = 5 * GIB  # a safetensors shard, what loading straight to the GPUs holds in RAM

# Bytes per parameter of one bitsandbytes NF4 weight: 4 bits + one absmax per 64 weights
# (uint8 with double quantization, plus an fp32 constant per 256 blocks; fp32 without).
NF4_BYTES_DQ = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_BYTES = 0.5 + 4 / 64
INT8_BYTES = 1.0  # LLM.int8 weights; the per-row fp32 scales are negligible
# torchao's AdamW8bit: uint8 codes and one fp32 scale per block of 256 values, for each of the two moments.
ADAMW8BIT_BLOCK = 256
ADAMW8BIT_BYTES = 2.0 * (1 + 4 / ADAMW8BIT_BLOCK)
# Activation offloading keeps the block computing and the one being prefetched back on the GPU.
OFFLOAD_WINDOW_LAYERS = 2


@dataclass(frozen=True)
class Regime:
    """The dtypes a training step runs with (see the module docstring)."""

    autocast: bool  # torch.autocast is on and some weights it casts are fp32
    resid: int  # bytes per element of the residual stream (the embedding output's dtype)
    compute: int  # bytes per element of matmul outputs
    fp32_trainable: bool  # trainable weights are fp32 (autocast keeps bf16 copies of them)
    # LoRA adapters compute in the half dtype without autocast (FSDP2's mixed-precision policy casts
    # them with the base): every adapter reading a tensor shares it, as the frozen base does.
    half_adapters: bool = False


@dataclass(frozen=True)
class Trainable:
    full: bool  # every parameter trains (else only LoRA adapters)
    targets: frozenset[str]  # LoRA target names
    rank: int


def parse_precision(precision: str) -> tuple[str, bool]:
    """('bf16', False) for mixed precision with fp32 weights; ('bf16', True) when weights are held in bf16."""
    p = precision.strip().lower().replace("_", "-")
    pure = p.endswith(("-true", "-pure")) or p.startswith("pure-")
    for dtype in Precision:
        if dtype in p or (dtype == Precision.FP32 and p in ("32", "float32", "float")):
            return dtype.value, pure and dtype != Precision.FP32
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "16-mixed": "fp16", "bf16-mixed": "bf16"}
    if p in aliases:
        return aliases[p], False
    raise UserError(f"unknown precision {precision!r}; use bf16, fp16 or fp32")


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def training_regime(method: str, precision: str, *, half_weights: bool) -> Regime:
    """The regime of a training recipe.

    `half_weights`: the weights the forward pass sees are already bf16/fp16 (FSDP
    mixed precision, DeepSpeed, or weights stored in half), so autocast casts nothing
    and the residual stream is half.
    """
    dtype, pure = parse_precision(precision)
    if dtype == "fp32":
        return Regime(autocast=False, resid=4, compute=4, fp32_trainable=False)
    if method == "full":
        if half_weights or pure:
            return Regime(autocast=False, resid=2, compute=2, fp32_trainable=False)
        return Regime(autocast=True, resid=4, compute=2, fp32_trainable=True)
    # LoRA/QLoRA: the base is loaded in half, peft keeps adapters in fp32, and autocast runs them in half;
    # under FSDP2 (half_weights) its policy gathers them in half, and no autocast runs.
    if half_weights:
        return Regime(autocast=False, resid=2, compute=2, fp32_trainable=False, half_adapters=True)
    return Regime(autocast=not pure, resid=2, compute=2, fp32_trainable=not pure)


def _trainable(m: ModelFacts, method: str, lora_rank: int, lora_targets: list[str] | str | None) -> Trainable:
    if method == "full":
        return Trainable(True, frozenset(), 0)
    if method not in ADAPTER_METHODS:
        raise UserError(f"unknown method {method!r}; use full, lora or qlora")
    return Trainable(False, frozenset(m.resolve_targets(lora_targets)), lora_rank)


# -- activations ---------------------------------------------------------------------------------------------


def _inputs_saved(uses: tuple[LinearUse, ...], in_bytes: int, reg: Regime, tr: Trainable, *, already_saved: bool = False) -> float:
    """Bytes per token that the linears reading one tensor keep of it for their weight gradients.

    A trainable linear keeps its input; under autocast an fp32 input is cast to
    bf16 separately by each reader. An adapter keeps its own cast (peft casts the
    input to the adapter's fp32, autocast casts it back). Expert linears see the
    tokens gathered per expert, one tensor shared by an expert's linears.
    """
    shared = 0.0
    shared_experts = 0.0
    separate = 0.0
    for u in uses:
        n_in = u.lin.in_features * u.per_token
        expert = u.copies > 1
        if tr.full:
            if expert:
                # transformers 5 runs each expert's gate and up as one fused matmul: one cast of its tokens.
                shared_experts = max(shared_experts, (2 if reg.autocast else in_bytes) * n_in)
            elif reg.autocast and in_bytes != 2:
                separate += 2 * n_in
            else:
                shared = max(shared, (2 if reg.autocast else in_bytes) * n_in)
        if u.lin.name in tr.targets:
            if reg.half_adapters:
                shared = max(shared, in_bytes * n_in)
            elif reg.autocast:
                separate += 2 * n_in
            elif in_bytes == 4:
                shared = max(shared, 4 * n_in)
            else:
                separate += 4 * n_in
            separate += (2 if reg.autocast or reg.half_adapters else 4) * tr.rank * u.per_token
    if already_saved:
        shared = 0.0
    return shared + shared_experts + separate


def _norm_saved(m: ModelFacts, reg: Regime, trainable_weight: bool) -> tuple[float, int]:
    """(bytes per token a norm saves, bytes per element of its output)."""
    h = m.h
    if m.layernorm:
        # Native layer_norm saves its input (fp32 under autocast, which lists it as an fp32 op) and mean/rstd.
        return (4 * h if (reg.autocast or reg.resid == 4) else reg.resid * h) + 8, (4 if reg.autocast else reg.resid)
    # HF RMSNorm: x.float() (kept by pow and mul), rsqrt, and the normalized x when the weight trains.
    normed = 4 if m.fp32_norm else reg.resid
    return 4 * h + 4 + (normed * h if trainable_weight else 0), reg.resid


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token one layer saves, split by how the engine's tensor parallelism divides them.

    `apply_tensor_parallel` (engine/workers/parallelize.py) splits attention heads and dense MLP
    columns; with sequence parallel it splits the norms along the sequence, but each column-parallel
    linear saves the all-gathered, whole-sequence input it multiplies (PyTorch's TP, unlike
    Megatron's, keeps the gathered tensor for backward), and mixture-of-experts MLPs run whole on
    every rank.
    """

    split: float  # divided by the TP degree (attention heads, dense MLP columns)
    norms: float  # divided by the TP degree under sequence parallel only (norms, residual-path dropout)
    whole: float  # on every TP rank whole (inputs of column-parallel linears, masks, replicated experts)
    weight_copies: float  # bytes per layer (not per token): autocast's bf16 copies of fp32 weights
    # GQA's k and v repeated to every query head where SDPA is given a mask (split like the heads); the
    # repeat is a view, not a copy, where a rank holds a single KV head.
    kv_repeat: float = 0.0
    kv_heads: int = 0
    # Checkpointed blocks: the bytes per token of the input each keeps (its sequence shard under SP).
    block_input: float = 0.0

    def per_gpu(self, tp: int, sp: bool) -> float:
        per = self.split / tp + (self.norms / tp if sp else self.norms) + self.whole
        if self.kv_repeat and self.kv_heads // tp > 1:
            per += self.kv_repeat / tp
        return per


_CLAMPED_SWIGLU_TYPES = frozenset({"gpt_oss"})
_SINK_ATTENTION_TYPES = frozenset({"gpt_oss"})


def _expert_bytes(reg: Regime, tr: Trainable) -> int:
    """Bytes per element of routed-expert tensors.

    transformers 5 runs fused experts with grouped_mm, which autocast does not cover: it casts the
    input to the weights' dtype, so fp32 master weights under autocast compute (and save) in fp32.
    """
    if tr.full and reg.autocast and reg.fp32_trainable:
        return 4
    return reg.compute


def layer_activations(
    m: ModelFacts, reg: Regime, tr: Trainable, checkpointing: str = "none", seq_len: int = 0
) -> LayerActivations:
    """What one transformer block keeps for backward, per token, averaged over the layers.

    checkpointing "full": only the block's input (HF gradient checkpointing);
    "selective": the block's input plus every matmul and attention output, with
    norms, rotary embeddings and activation functions recomputed (PyTorch's
    selective activation checkpointing policy that saves matmuls; the flash-
    attention adaptation of Korthikanti's selective scheme, whose s×s tensors no
    longer exist).

    `seq_len` sizes what grows with the sequence: eager attention's scores and
    probabilities (a·s per token), and the explicit mask SDPA is handed beyond a
    sliding window (s per token).
    """
    h, c, r = m.h, reg.compute, reg.resid
    copies = _layer_weight_copies(m, reg, tr)
    if checkpointing == "full":
        return LayerActivations(split=0.0, norms=float(r * h), whole=0.0, weight_copies=copies, block_input=r * h)
    if checkpointing == "selective":
        return _selective_layer(m, reg, tr, seq_len, copies)
    if checkpointing != "none":
        raise UserError(f"unknown checkpointing {checkpointing!r}; use none, selective or full")

    spec = m.spec
    norm, norm_out = _norm_saved(m, reg, tr.full)
    norms = m.norms_per_layer * norm
    if spec.hidden_dropout > 0:
        norms += 2.0 * h  # bool masks of the dropouts on the attention and MLP outputs
    whole = _inputs_saved(tuple(u for u in m.attn_in if u.lin.in_features == h), norm_out, reg, tr)
    split = 0.0
    # Linears fed by a latent rather than the norm (multi-head latent attention) keep their own input.
    split += _inputs_saved(tuple(u for u in m.attn_in if u.lin.in_features != h), c, reg, tr)
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    kv_repeat = 0.0
    windowed = spec.sliding_window is not None and seq_len >= spec.sliding_window and not spec.attn_eager
    if spec.attn_eager:
        # Eager attention: the score matmul keeps q and the key repeated to every query head, the
        # probability matmul its probabilities and the repeated value, o_proj its own input.
        split += 4 * c * m.q_dim + _scores_saved(m, reg, seq_len, tr)
    else:
        # SDPA keeps q, k, v, its output and a log-sum-exp per head and query; GQA's k and v stay narrow
        # unless a mask is passed, when transformers repeats them to every head (enable_gqa needs no mask).
        split += c * (2 * m.q_dim + 2 * m.kv_dim) + 4 * heads
        if windowed:
            share = spec.sliding_layers / max(m.layers, 1)  # of the layers, those with a window
            kv_repeat = share * c * 2 * (m.q_dim - m.kv_dim)
            # From the window on the mask is explicit; SDPA converts it to the query's dtype in every layer.
            whole += share * c * seq_len
    if m.fused_qkv and m.rope and not spec.attn_eager:
        # q and k are views of one fused output, rotated into new tensors; v stays a view, so its saved
        # storage is the whole fused output, q's and k's part included.
        split += c * (m.q_dim + m.kv_dim)
    if m.cat_rope and not spec.attn_eager:
        split += c * m.q_dim  # o_proj keeps a copy of SDPA's output (saved by SDPA too)
    if m.qk_norm:
        # x.float() (kept by pow and mul) and rsqrt per head; with a trainable weight the normalized x, which
        # Gemma's RMSNorm keeps in fp32 (it multiplies by 1 + weight before casting back).
        normed = 4 if m.fp32_norm else c
        split += 4 * (m.q_dim + m.kv_dim) + 4 * (heads + kv_heads) + (normed * (m.q_dim + m.kv_dim) if tr.full else 0)
    # o_proj's input is SDPA's saved output, or counted with eager attention's tensors.
    split += _inputs_saved(m.attn_out, c, reg, tr, already_saved=True)

    dense_in = tuple(u for u in m.mlp_in if u.copies == 1)
    dense_out = tuple(u for u in m.mlp_out if u.copies == 1)
    expert_out = tuple(u for u in m.mlp_out if u.copies > 1)
    inter = sum(u.lin.in_features for u in dense_out) if m.spec.is_moe else m.inter_per_token
    mlp_split = 0.0
    act_out = c
    if inter:
        if m.gated:
            mlp_split += 3 * c * inter  # SwiGLU: act(gate) keeps gate; gate·up keeps act(gate) and up
        elif m.act_saves == 1:
            mlp_split += c * inter  # a native GELU keeps its input
        elif reg.autocast:
            # gelu_new in Python, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): autocast runs pow in fp32, so
            # pow keeps an fp32 x, tanh its fp32 output, the last product 0.5·x (bf16) and 1 + tanh (fp32).
            mlp_split += (4 + 4 + 2 + 4) * inter
            act_out = 4
        else:
            mlp_split += 4 * c * inter  # the same four tensors in one dtype
        mlp_split += _inputs_saved(dense_out, act_out, reg, tr)
    mlp_whole = _inputs_saved(dense_in, norm_out, reg, tr)
    if spec.is_moe:
        e = _expert_bytes(reg, tr)
        k = max(spec.experts_per_token, 1)
        expert_inter = sum(u.lin.in_features * u.per_token for u in expert_out)
        # gpt-oss's clamped SwiGLU, (up.clamp + 1) · gate.clamp · sigmoid(α · gate.clamp), keeps three more
        # tensors of the expert width than act(gate) · up: the clamped gate, the sigmoid and up + 1.
        extra = 3 * expert_inter if spec.model_type in _CLAMPED_SWIGLU_TYPES else 0
        # Per routed token: its gathered input, the gate/up output, act(gate), their product (the down
        # projection's input) and the down output kept to weight it; the router's fp32 probabilities.
        if tr.full:
            mlp_split += e * (2 * h * k + 4 * expert_inter + extra) + 4 * spec.num_experts
        else:
            # Frozen experts (LoRA's base) keep no inputs for weight gradients: only what the activation and
            # the routing weights' gradients need.
            mlp_split += e * (h * k + 3 * expert_inter + extra) + 4 * spec.num_experts
        # The engine keeps mixture-of-experts MLPs whole on every TP rank (their dense shared part too).
        mlp_whole += mlp_split
        mlp_split = 0.0
    return LayerActivations(
        split=split + mlp_split, norms=norms, whole=whole + mlp_whole, weight_copies=copies,
        kv_repeat=kv_repeat, kv_heads=kv_heads,
    )  # fmt: skip


def _selective_layer(m: ModelFacts, reg: Regime, tr: Trainable, seq_len: int, copies: float) -> LayerActivations:
    """What the engine's selective policy keeps: the block's input and the output of every matmul and attention.

    Every matmul counts, the frozen ones too: a LoRA layer keeps its base output, A's rank-r output
    and B's full-width output, so LoRA saves more here than without checkpointing (where a frozen
    linear keeps nothing). Under tensor parallel a column-parallel matmul's output is split, but a
    row-parallel one (o_proj, down_proj) outputs the whole width before its reduction; A's output is
    whole on every rank; a row-parallel layer's B runs on the sequence shard under sequence parallel
    (whole without). Weight casts are recomputed, not kept. Mixture-of-experts MLPs run whole.
    """
    spec, c = m.spec, reg.compute
    split = c * m.q_dim + 4.0 * spec.num_heads  # SDPA's output (or eager's probability matmul) and log-sum-exp
    if spec.attn_eager:
        split += c * spec.num_heads * seq_len  # the score matmul's output
    norms = float(reg.resid * m.h)  # the block's input
    whole = 0.0
    rows = {id(u) for u in (*m.attn_out, *m.mlp_out)}
    mlp = {id(u) for u in (*m.mlp_in, *m.mlp_out)}
    for u in m.linears():
        out = c * u.lin.out_features * u.per_token
        lora = u.lin.name in tr.targets
        adapter_a = c * tr.rank * u.per_token if lora else 0.0
        if spec.is_moe and id(u) in mlp:
            whole += out * (2 if lora else 1) + adapter_a
            continue
        row = id(u) in rows
        whole += adapter_a
        if row:
            whole += out
            norms += out if lora else 0.0
        else:
            split += out * (2 if lora else 1)
    return LayerActivations(split=split, norms=norms, whole=whole, weight_copies=copies, block_input=reg.resid * m.h)


def lora_params_per_rank(m: ModelFacts, rank: int, targets: frozenset[str] | set[str], tp: int) -> float:
    """Adapter parameters of one layer on one TP rank, split as apply_tensor_parallel splits them.

    A column-parallel layer's B is split by output feature and its A is whole on every rank; a
    row-parallel layer's A is split by input feature and its B is whole. Mixture-of-experts MLPs
    stay whole.
    """
    rows = {id(u) for u in (*m.attn_out, *m.mlp_out)}
    mlp = {id(u) for u in (*m.mlp_in, *m.mlp_out)}
    total = 0.0
    for u in m.linears():
        if u.lin.name not in targets:
            continue
        a, b = rank * u.lin.in_features * u.copies, rank * u.lin.out_features * u.copies
        if tp == 1 or (m.spec.is_moe and id(u) in mlp):
            total += a + b
        elif id(u) in rows:
            total += a / tp + b
        else:
            total += a + b / tp
    return total


def _scores_saved(m: ModelFacts, reg: Regime, seq_len: int, tr: Trainable | None = None) -> float:
    """Bytes per token eager attention keeps of its a×s scores (nothing under SDPA)."""
    spec = m.spec
    if not spec.attn_eager:
        return 0.0
    c = reg.compute
    if spec.model_type in _SINK_ATTENTION_TYPES:
        # gpt-oss appends each head's learned sink logit as one more column and takes the softmax in the
        # dtype of that concatenation: fp32 when the sinks are fp32 trainable weights under autocast (then the
        # probabilities are cast back for the value matmul, which keeps that copy), else the compute dtype,
        # whose softmax output the value matmul keeps as it is (a view without the sink column).
        fp32 = tr is not None and tr.full and reg.fp32_trainable
        per_key = (4 * (seq_len + 1) + c * seq_len) if fp32 else c * (seq_len + 1)
        return per_key * spec.num_heads
    per = 4.0  # softmax upcasts to fp32 and keeps its output
    if spec.attn_softcap:
        per += c  # tanh keeps its output
    if spec.attention_dropout > 0:
        per += 1 + c  # dropout's bool mask; the probability matmul keeps the dropped probabilities
    elif c != 4:
        per += c  # the probability matmul keeps the fp32 probabilities cast back to the compute dtype
    return per * spec.num_heads * seq_len


def _layer_weight_copies(m: ModelFacts, reg: Regime, tr: Trainable) -> float:
    if not reg.autocast:
        return 0.0
    total = 0.0
    for u in m.linears():
        if tr.full and reg.fp32_trainable and u.copies == 1:
            total += 2 * u.weight_params  # grouped_mm experts are not cast (see _expert_bytes)
        if u.lin.name in tr.targets:
            total += 2 * tr.rank * (u.lin.in_features + u.lin.out_features) * u.copies
    return total


@dataclass(frozen=True)
class EdgeActivations:
    """Bytes per token saved outside the blocks, and what the loss needs transiently."""

    first: float  # embedding stage: token ids (and the embedding dropout's mask)
    logits: float  # head stage: what scales with the vocabulary (divided by TP when the head is split)
    head_input: float  # head stage: final norm and the head's input, whole on every TP rank
    head_weight_copy: float  # bytes: autocast's bf16 copy of an fp32 output matrix
    loss_transient: float  # bytes per token: logits, their fp32 upcast and its gradient, briefly
    rope_tables: float  # bytes per sequence position: cos and sin shared by all layers
    # Chunked cross-entropy only (0 otherwise), bytes: the output matrix's compute-dtype copy that each chunk's
    # backward recomputes, and the output matrix's gradient in the dtype autograd sums the chunks' parts in.
    head_recompute: float = 0.0
    head_grad: float = 0.0


def edge_activations(
    m: ModelFacts, reg: Regime, tr: Trainable, checkpointing: str = "none", loss_chunks: int = 1
) -> EdgeActivations:
    """`loss_chunks` > 1: chunked cross-entropy (engine.workers.chunked_loss), which checkpoints each chunk's head
    and loss: forward keeps only the final hidden states and the labels, and each chunk's backward recomputes
    that chunk's logits and the head's compute-dtype copy, then adds its part of the head's gradient."""
    h, c, v = m.h, reg.compute, m.vocab
    first = 8.0 if tr.full else 0.0  # int64 ids, kept by a trainable embedding
    if m.spec.hidden_dropout > 0:
        first += h  # the embedding dropout's bool mask
    norm, norm_out = _norm_saved(m, reg, tr.full)
    head_input = norm
    logits = 0.0
    head_copy = 0.0
    transient = 0.0
    recompute = 0.0
    head_grad = 0.0
    k = max(loss_chunks, 1)
    if m.is_decoder:
        weight_copy = 2.0 * v * h if tr.full and reg.autocast and reg.fp32_trainable else 0.0
        # transformers upcasts logits to fp32 for the loss; cross-entropy keeps the fp32 log-softmax and
        # the int64 labels. Briefly there are also the logits themselves and the log-softmax's gradient.
        vocab_saved = 4.0 * v + (c * v if m.spec.final_softcap else 0.0)  # tanh(logits / cap) keeps its output
        if k == 1:
            if tr.full:
                head_input += _inputs_saved((LinearUse(_head_linear(m), 1, 1),), norm_out, reg, tr)
            head_copy = weight_copy
            logits = vocab_saved + 8.0
            transient = (2 * c + 4.0) * v
        else:
            # The checkpoint keeps the final hidden states (its input) and the labels; what the head and the loss
            # save exists only inside one chunk's backward, with that chunk's recomputed copy of the head.
            head_input += norm_out * h
            logits = 8.0
            transient = (vocab_saved + (2 * c + 4.0) * v) / k
            if reg.autocast and norm_out == 4:
                transient += 2.0 * h / k  # the chunk's hidden states cast for the head's matmul
            recompute = weight_copy
            if tr.full:
                head_grad = (4.0 if reg.fp32_trainable else c) * v * h
    rope = 0.0
    if m.rope and checkpointing != "full":
        rope = 2.0 * m.spec.head_dim * reg.resid
    return EdgeActivations(first, logits, head_input, head_copy, transient, rope, recompute, head_grad)


def head_split(m: ModelFacts, training: bool) -> bool:
    """Whether tensor parallel splits the LM head (and the logits) by vocabulary, as the engine runs it.

    Training asks apply_tensor_parallel for a vocabulary-parallel head, which it grants unless the
    head is tied to the embedding (then every rank holds the whole head and the whole logits).
    Inference keeps the head whole to sample from.
    """
    return training and m.is_decoder and not m.spec.tied_embeddings


def stage_activations(
    m: ModelFacts,
    layer: LayerActivations,
    full_layer: LayerActivations,
    edge: EdgeActivations,
    *,
    n_layers: int,
    tokens: int,
    seq_len: int,
    tp: int,
    sp: bool,
    in_flight: int,
    first: bool,
    last: bool,
    checkpointing: str,
    training: bool = True,
    recompute: bool = True,
    whole_grads: bool = True,
) -> tuple[float, float]:
    """(bytes saved for backward on one GPU of a stage, the loss's transient bytes there).

    `recompute`: add what a checkpointed layer briefly holds again in backward (the peak);
    without it, what is saved at the end of the forward pass. `whole_grads`: the plan's gradient term holds the
    head's whole gradient (not a shard of it, as FSDP's and ZeRO-2's do).
    """
    act = n_layers * layer.per_gpu(tp, sp) * tokens * in_flight
    if not recompute:
        pass
    elif checkpointing != "none" and n_layers:
        # Backward recomputes one layer at a time; its full activations (and weight casts) exist briefly.
        act += max(full_layer.per_gpu(tp, sp) - layer.per_gpu(tp, sp), 0.0) * tokens
    if checkpointing == "none":
        act += n_layers * layer.weight_copies / tp
    elif n_layers and recompute:
        act += full_layer.weight_copies / tp  # checkpointed blocks recompute their weight casts
    if first:
        act += edge.first * tokens * in_flight
        if sp and tp > 1 and n_layers and layer.block_input:
            # The first checkpointed block is handed the embedding's whole output (sequence parallel's
            # split happens inside it), so it keeps the whole tensor, not a shard.
            act += layer.block_input * (1 - 1 / tp) * tokens * in_flight
    loss = 0.0
    if last:
        v = tp if head_split(m, training) else 1
        # The block stack returns whole sequences (sequence parallel gathers after the last block), so
        # the final norm and the head's input are whole on every rank.
        act += (edge.logits / v + edge.head_input) * tokens + edge.head_weight_copy / v
        loss = edge.loss_transient * tokens + edge.head_recompute
        if edge.head_grad:
            # Chunked loss: autograd sums the chunks' parts of the head's gradient out of place, so adding one
            # holds the sum so far, the chunk's part and the new sum at once (measured on CPU under MemTracker):
            # two gradients beyond the one the gradient term counts, and a third where that term is a shard.
            loss = max(loss, 2 * edge.head_grad) + (0.0 if whole_grads else edge.head_grad)
        loss /= v
    act += edge.rope_tables * seq_len * in_flight
    return act, loss


def _head_linear(m: ModelFacts) -> Linear:
    return Linear("lm_head", m.h, m.vocab)


# -- parameters, gradients, optimizer -------------------------------------------------------------------------


def optimizer_state_bytes(optimizer: str, param_bytes: int) -> float:
    """Bytes of optimizer state per trainable parameter, without master weights."""
    if optimizer == "adamw":
        return 2.0 * param_bytes  # exp_avg and exp_avg_sq, created like the parameter
    if optimizer == "adamw8bit":
        return ADAMW8BIT_BYTES  # torchao: uint8 codes with an fp32 scale per block of 256
    if optimizer == "sgd":
        return float(param_bytes)  # momentum buffer
    raise UserError(f"unknown optimizer {optimizer!r}; use adamw, adamw8bit or sgd")


def base_weight_bytes(m: ModelFacts, *, half_bytes: int, bits: int = 16, double_quant: bool = True) -> float:
    """Bytes of the model weights as loaded: all at `half_bytes`, or the block linears quantized.

    bitsandbytes quantizes only the linears inside the blocks; embeddings, norms
    and the output layer stay at the compute dtype.
    """
    if bits == 16:
        return float(m.params * half_bytes)
    quantized = m.quantizable_params()
    per = INT8_BYTES if bits == 8 else (NF4_BYTES_DQ if double_quant else NF4_BYTES)
    return quantized * per + (m.params - quantized) * float(half_bytes)


def predict_components(
    spec: ModelSpec,
    *,
    precision: str,
    method: str,
    optimizer: str,
    checkpointing: str,
    micro_batch: int,
    seq_len: int,
    lora_rank: int = 16,
    lora_targets: list[str] | str | None = None,
    double_quant: bool = True,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, int]:
    """Bytes PyTorch allocates on one GPU training `spec` unsharded (or split `tp` ways), by component.

    "params": weights as allocated (fp32 under autocast mixed precision; for LoRA
    the half base plus fp32 adapters; for QLoRA NF4 linears with their absmax).
    "grads": one gradient per trainable parameter, in its dtype.
    "optimizer": AdamW's exp_avg and exp_avg_sq in the parameter dtype (8-bit
    AdamW: uint8 with block absmax; SGD: momentum), plus fp32 master weights only
    when trainable parameters are held in bf16/fp16 ("bf16-true").
    "activations_saved": what autograd keeps for backward after the forward pass
    with the attention transformers runs the family with, the loss included, for
    `micro_batch` × `seq_len` tokens.

    `tp` > 1: one rank of the engine's tensor parallelism (`apply_tensor_parallel`
    with the vocabulary-parallel head a training job asks for), with `sequence_parallel`.

    `precision`: "bf16"/"fp16" (autocast, fp32 weights), "bf16-true"/"fp16-true"
    (weights in half), or "fp32".
    """
    m = model_facts(spec)
    dtype, pure = parse_precision(precision)
    tr = _trainable(m, method, lora_rank, lora_targets)
    reg = training_regime(method, precision, half_weights=False)
    tokens = micro_batch * seq_len
    if tr.full:
        p_bytes = 4 if (dtype == "fp32" or not pure) else 2
        trainable = m.params
        if tp > 1:
            # As apply_tensor_parallel splits them: attention and dense MLP linears by tp, experts, norms and
            # the embedding whole, an untied head by vocabulary.
            dense = m.layer_linear_params - m.layer_expert_params
            per_layer = dense / tp + m.layer_expert_params + m.layer_other_params
            trainable = int(m.layers * per_layer + m.embedding_params + m.head_params / tp)
        params = trainable * p_bytes
        t_bytes = p_bytes
    else:
        lora = lora_params_per_rank(m, lora_rank, tr.targets, tp) * m.layers
        bits = 4 if method == "qlora" else 16
        base = base_weight_bytes(m, half_bytes=dtype_bytes(dtype), bits=bits, double_quant=double_quant)
        if tp > 1:
            # The frozen base is split as the full model's weights are (LoRA under TP runs in half, unquantised).
            dense = m.layer_linear_params - m.layer_expert_params
            per_layer = dense / tp + m.layer_expert_params + m.layer_other_params
            base = int(m.layers * per_layer + m.embedding_params + m.head_params / tp) * dtype_bytes(dtype)
        params = base + lora * 4
        trainable = lora
        t_bytes = 4  # peft keeps adapters in fp32
    grads = trainable * t_bytes
    opt = trainable * optimizer_state_bytes(optimizer, t_bytes)
    if t_bytes == 2:
        opt += trainable * 4  # fp32 master weights
    layer = layer_activations(m, reg, tr, checkpointing, seq_len)
    edge = edge_activations(m, reg, tr, checkpointing)
    act, _ = stage_activations(
        m, layer, layer, edge, n_layers=m.layers, tokens=tokens, seq_len=seq_len, tp=tp, sp=sequence_parallel,
        in_flight=1, first=True, last=True, checkpointing=checkpointing, recompute=False,
    )  # fmt: skip
    if not tr.full and checkpointing == "none":
        # The frozen embedding's output needs no gradient, so the first block's norm keeps nothing.
        act -= _norm_saved(m, reg, False)[0] * tokens / (tp if sequence_parallel else 1)
    return {"params": int(params), "grads": int(grads), "optimizer": int(opt), "activations_saved": int(act)}


def predict_kv_cache(spec: ModelSpec, batch: int, tokens: int, dtype_bytes: int) -> int:
    """KV cache bytes: 2 (k and v) × layers × kv_heads × head_dim × tokens × batch × bytes.

    GQA/MQA models cache only their kv heads; encoders cache nothing; MLA caches its latent instead.
    """
    if not spec.is_decoder:
        return 0
    per_token_layer = spec.kv_latent or 2 * spec.num_kv_heads * spec.head_dim
    return spec.num_layers * per_token_layer * tokens * batch * dtype_bytes


def overhead_bytes(allocated: float, *, architecture: str | None, groups: int, reserve: float | None = None) -> int:
    """CUDA context, NCCL communicators and the caching allocator's reserve on top of `allocated`.

    `reserve`: the allocator's rounding and fragmentation as modelled for the plan (MemoryModel.allocator_reserve);
    None: a share of `allocated`.
    """
    large = (architecture or "").lower() in ("hopper", "blackwell")
    context = CUDA_CONTEXT_BYTES_LARGE if large else CUDA_CONTEXT_BYTES
    reserve = max(ALLOCATOR_RESERVE * allocated if reserve is None else reserve, ALLOCATOR_MIN_BYTES)
    return int(context + groups * NCCL_BYTES_PER_GROUP + reserve)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def gib(n: float) -> float:
    return n / GIB


# -- per-GPU memory of a plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    """Bytes on each GPU of one pipeline stage (floats: the search evaluates thousands)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    kv_cache: float
    buffers: float
    overhead: float
    host_offloaded: float  # bytes this GPU's rank keeps in host RAM instead

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache + self.buffers + self.overhead


class MemoryModel:
    """Memory of training or inference plans for one model and workload; caches per-layer formulas."""

    def __init__(self, m: ModelFacts, w: Workload) -> None:
        self.m = m
        self.w = w
        self.dtype, self.pure = parse_precision(w.precision)
        self.c = dtype_bytes(self.dtype)
        self.mixed = self.dtype != "fp32"
        self.recipe = recipe_of(w) if w.training else Recipe()
        # bf16 master weights: trainable weights, their gradients and AdamW's moments are 2 bytes, not 4.
        self.half_master = self.mixed and w.training and self.recipe.master_weights == "bf16"
        self.master = 2 if self.half_master else 4
        if w.training:
            lora = w.lora or LoraSettings()
            self.tr = _trainable(m, w.method, lora.rank, lora.targets if w.method != "full" else None)
            self.lora_per_layer = m.lora_params(lora.rank, sorted(self.tr.targets)) / m.layers if not self.tr.full else 0.0
            self.double_quant = lora.double_quant
        else:
            self.tr = Trainable(True, frozenset(), 0)
            self.lora_per_layer = 0.0
            self.double_quant = True
        self.state_bytes = optimizer_state_bytes(self.recipe.optimizer, self.master) if w.training else 0.0
        self._layers: dict[tuple[bool, str], LayerActivations] = {}
        self._edges: dict[tuple[bool, str], EdgeActivations] = {}

    # -- formulas, cached ------------------------------------------------------------------------------
    def regime(self, backend: str) -> Regime:
        half = backend in ("fsdp", "deepspeed") or self.half_master
        return training_regime(self.w.method, self.w.precision, half_weights=half)

    def layer(self, backend: str, checkpointing: str) -> LayerActivations:
        key = (backend in ("fsdp", "deepspeed"), checkpointing)
        found = self._layers.get(key)
        if found is None:
            reg = self.regime(backend)
            found = self._layers[key] = layer_activations(self.m, reg, self.tr, checkpointing, self.w.seq_len)
        return found

    def edge(self, backend: str, checkpointing: str) -> EdgeActivations:
        key = (backend in ("fsdp", "deepspeed"), checkpointing)
        found = self._edges.get(key)
        if found is None:
            found = self._edges[key] = edge_activations(
                self.m, self.regime(backend), self.tr, checkpointing, self.recipe.loss_chunks
            )
        return found

    def stage_params(self, par: Parallelism, stage: int) -> tuple[float, float]:
        """(parameters on one GPU of `stage`, of which block linears), after TP and PP splits."""
        m, t = self.m, par.tp
        first_layer, end_layer = stage_range(par, stage, m.layers)
        n = end_layer - first_layer
        # As the engine splits them (engine/workers/parallelize.py): attention and dense MLP linears by t;
        # MoE experts, the embedding and a tied head whole on every rank; an untied head by vocabulary
        # in training (inference keeps it whole to sample from).
        experts = m.layer_expert_params
        lin = n * ((m.layer_linear_params - experts) / t + experts)
        p = lin + n * m.layer_other_params
        if stage == 0:
            p += m.embedding_params
        if stage == par.pp - 1:
            p += m.head_params / (t if self.w.training else 1)
            if par.pp > 1 and m.spec.tied_embeddings and m.is_decoder:
                p += m.embedding_params  # the last stage keeps its own copy of a tied output matrix
        return p, lin

    # -- training --------------------------------------------------------------------------------------
    def train_stage(self, par: Parallelism, stage: int, architecture: str | None) -> StageMemory:
        m, w, t = self.m, self.w, par.tp
        c = self.c
        p, lin = self.stage_params(par, stage)
        z = par.shard_degree if par.zero_stage >= 1 else 1
        z3 = par.zero_stage == 3
        first_layer, end_layer = stage_range(par, stage, m.layers)
        n_layers = end_layer - first_layer
        if self.tr.full:
            trainable = p
            frozen = 0.0
        else:
            trainable = n_layers * lora_params_per_rank(m, self.tr.rank, self.tr.targets, t)
            bits = 4 if w.method == "qlora" else 16
            if bits == 16:
                frozen = p * c
            else:
                per = NF4_BYTES_DQ if self.double_quant else NF4_BYTES
                frozen = lin * per + (p - lin) * c
        state = self.state_bytes
        host = 0.0
        if par.backend == "deepspeed":
            pb = 2 if self.mixed else 4
            weights = (trainable * pb + frozen) / (z if z3 else 1)
            grads = trainable * pb / (z if par.zero_stage >= 2 else 1)
            # An fp32 master copy beside the optimizer, unless DeepSpeed keeps bf16 model states (pure bf16).
            opt = trainable * (state + (4 if self.mixed and not self.half_master else 0)) / z
            if par.offload_optimizer:
                host += opt + trainable * 4 / z  # DeepSpeed keeps an fp32 gradient partition next to the optimizer
                opt = 0.0
            if par.offload_params:
                host += weights
                weights = 0.0
        elif par.backend == "fsdp":
            weights = (trainable * self.master + frozen) / z  # FSDP2 shards the master parameters, gathers bf16
            grads = trainable * self.master / z
            opt = trainable * state / z
            if par.offload:
                # CPUOffloadPolicy: the sharded parameters, their gradients and the optimizer state all live in
                # pinned host memory, and the optimizer steps there; nothing of them stays on the GPU.
                host += weights + grads + opt
                weights = grads = opt = 0.0
        else:  # ddp / single: torch autocast over fp32 weights (or bf16 master weights, no cast)
            weights = trainable * self.master + frozen
            grads = trainable * self.master
            opt = trainable * state
        host_optimizer = self.host_optimizer(par)
        small = 0.0
        if host_optimizer:
            # engine.workers.optimizer_offload: every tensor but the small ones (norms) has its master copy, its
            # gradient and AdamW's state pinned in host RAM (and, accumulating, the staging buffers);
            # the GPU keeps the weights, the small tensors' gradients and state, and one gradient on its way out.
            big = self.host_optimizer_params(par, stage)
            small = trainable - big
            staging = STAGING_BUFFERS * self.largest_trainable(par, stage) if par.grad_accum > 1 else 0.0
            host += big * (2 * self.master + state) + staging * self.master
            grads = (small + self.largest_trainable(par, stage)) * self.master
            opt = small * state
        in_backward = self.recipe.optimizer_in_backward and par.backend != "deepspeed" and not par.offload
        largest = 0.0
        if in_backward:
            # Each gradient is freed by its parameter's step, in the hook that runs as it is accumulated; DDP's
            # buckets hold every gradient whatever the optimizer does, so only one GPU or FSDP2 gains.
            largest = self.largest_trainable(par, stage) / (z if par.backend == "fsdp" else 1)
            if par.backend != "ddp" or par.dp == 1:
                grads = min(grads, largest * self.master)

        # Communication and gathering buffers.
        gathered = 0.0  # units held whole from forward through backward (FSDP2 without resharding)
        unit_params = m.layer_linear_params / t + m.layer_other_params
        unit_bytes = unit_params * c if self.tr.full else (frozen / max(n_layers, 1) if n_layers else 0.0)
        comm = 0.0
        if par.dp > 1 and par.backend == "ddp":
            comm += 2 * DDP_BUCKET_BYTES
        elif par.backend == "deepspeed" and par.dp > 1:
            comm += 2 * DEEPSPEED_BUCKET_ELEMENTS * (2 if self.mixed else 4)
            if z3:
                comm += 2 * unit_bytes
        elif par.backend == "fsdp":
            unit_grads = unit_params * c if self.tr.full else 0.0  # one unit's unsharded gradients before reduction
            if _sharding_form(par)[0]:
                comm += 2 * unit_bytes + unit_grads  # this and the prefetched unit
            else:
                # ZeRO-2 form: a unit gathered in forward stays gathered until its backward is done, so at the end
                # of forward every block of the stage is held whole, in the compute dtype, beside the activations.
                gathered = n_layers * unit_bytes
                comm += unit_grads
            if par.offload:
                # Each unit's fp32 shard is copied to the GPU before its all-gather, and its fp32 gradient shard
                # waits there for the copy back: two shards of this and the prefetched unit.
                comm += 2 * 2 * (unit_params * 4 if self.tr.full else unit_bytes) / z
            # The root unit (embeddings, head) stays gathered through the step; TP keeps the embedding whole
            # on every rank and splits an untied head by vocabulary (as stage_params counts them).
            root = m.embedding_params if stage == 0 else 0.0
            if stage == par.pp - 1:
                root += m.head_params / t
                if par.pp > 1 and m.spec.tied_embeddings and m.is_decoder:
                    root += m.embedding_params
            comm += root * c
        tokens = par.micro_batch * w.seq_len
        if par.pp > 1:
            comm += 2 * tokens * m.h * c  # stages pass whole sequences on, sequence parallel or not

        # Activations.
        la = self.layer(par.backend, par.checkpointing)
        edge = self.edge(par.backend, par.checkpointing)
        if par.pp == 1:
            in_flight = 1
        elif par.pipeline_schedule == "gpipe":
            in_flight = par.grad_accum
        else:
            in_flight = min(par.pp - stage, par.grad_accum)
        act, loss = stage_activations(
            m, la, self.layer(par.backend, "none"), edge,
            n_layers=n_layers, tokens=tokens, seq_len=w.seq_len, tp=t, sp=par.sequence_parallel,
            in_flight=in_flight, first=stage == 0, last=stage == par.pp - 1, checkpointing=par.checkpointing,
            whole_grads=not (z > 1 and (par.backend == "fsdp" or (par.backend == "deepspeed" and par.zero_stage >= 2)))
            and not (par.backend == "fsdp" and par.offload),
        )  # fmt: skip
        moved = self.offloaded_activations(par, stage)
        act -= moved
        host += moved

        opt_temp = 0.0
        if host_optimizer:
            opt_temp = small * self.master  # the small tensors' for-each AdamW; the rest steps on the CPU
        elif par.backend in ("ddp", "fsdp", "single") and self.recipe.optimizer == "adamw" and not par.offload:
            # foreach AdamW's sqrt(v) temporary, in the moments' dtype; stepping one parameter at a time in
            # backward, one parameter's.
            opt_temp = (largest if in_backward else trainable / (z if par.backend == "fsdp" else 1)) * self.master
        dynamic = max(act + loss + gathered + comm, opt_temp + comm)
        if w.method == "qlora" and n_layers:
            # bitsandbytes dequantizes a layer's NF4 weight into a fresh compute-dtype tensor for each matmul
            # (forward and backward), freed after it: the largest one is alive on top of the activations.
            dynamic += max(u.lin.in_features * u.lin.out_features / (1 if u.copies > 1 else t) for u in m.linears()) * c
        allocated = weights + grads + opt + dynamic
        groups = (par.dp > 1) + (par.tp > 1) + (par.pp > 1) + _sharding_form(par)[1]
        # Measured for one GPU (benchmarks/allocator_replay.py); sharded and replicated plans keep the share of
        # what is allocated: their replays (FSDP2's gathers between activations, other streams) are not modelled.
        single = par.backend == "single"
        reserve = self.allocator_reserve(par, stage, loss=loss, optimizer_temporaries=opt_temp > 0) if single else None
        over = overhead_bytes(allocated, architecture=architecture, groups=groups, reserve=reserve)
        return StageMemory(weights, grads, opt, act, 0.0, dynamic - act, over, host)

    def host_optimizer(self, par: Parallelism) -> bool:
        """Whether the plan keeps the optimizer state in host memory (the recipe's optimizer_offload, on the one
        GPU the engine runs it on)."""
        return bool(self.w.training and self.recipe.optimizer_offload and par.backend in ("single", "ddp")
                    and not par.offload)  # fmt: skip

    def host_optimizer_params(self, par: Parallelism, stage: int) -> float:
        """Parameters of one GPU of `stage` whose master copy, gradient and state live in host memory under the
        optimizer state in host memory: the trainable ones but the small tensors (norms)."""
        if not self.host_optimizer(par):
            return 0.0
        first, end = stage_range(par, stage, self.m.layers)
        p, _ = self.stage_params(par, stage)
        trainable = p if self.tr.full else (end - first) * lora_params_per_rank(self.m, self.tr.rank, self.tr.targets, par.tp)
        small = min((end - first) * self.m.layer_other_params, trainable) if self.tr.full else 0.0
        return trainable - small

    def largest_trainable(self, par: Parallelism, stage: int) -> float:
        """Parameters of the largest trainable tensor on one GPU of `stage` (before FSDP sharding): what one
        step in backward updates at once."""
        m, t = self.m, par.tp
        if not self.tr.full:
            return max((self.tr.rank * max(u.lin.in_features, u.lin.out_features) * u.copies for u in m.linears()
                        if u.lin.name in self.tr.targets), default=0)  # fmt: skip
        first, end = stage_range(par, stage, m.layers)
        sizes = [u.weight_params / (1 if u.copies > 1 else t) for u in m.linears()] if end > first else []
        if stage == 0:
            sizes.append(m.embedding_params)
        if stage == par.pp - 1:
            sizes.append(m.head_params / t)
        return float(max(sizes, default=0.0))

    def offloaded_activations(self, par: Parallelism, stage: int) -> float:
        """Bytes of saved activations one GPU of `stage` moves to host RAM per micro-batch under activation
        offloading: every block's but the window's (0 without it)."""
        if not (self.w.training and self.recipe.activation_offload):
            return 0.0
        first, end = stage_range(par, stage, self.m.layers)
        moved_layers = max(end - first - OFFLOAD_WINDOW_LAYERS, 0)
        if not moved_layers:
            return 0.0
        la = self.layer(par.backend, par.checkpointing)
        tokens = par.micro_batch * self.w.seq_len
        if par.pp == 1:
            in_flight = 1
        elif par.pipeline_schedule == "gpipe":
            in_flight = par.grad_accum
        else:
            in_flight = min(par.pp - stage, par.grad_accum)
        per_layer = la.per_gpu(par.tp, par.sequence_parallel) * tokens * in_flight
        if par.checkpointing == "none":
            per_layer += la.weight_copies / par.tp
        return moved_layers * per_layer

    def persistent_tensors(self, par: Parallelism, stage: int) -> list[tuple[float, float]]:
        """(bytes, count) of each kind of tensor one GPU of `stage` keeps through a training step: weights, and
        for trainable ones their gradients and optimizer state, as the allocator sees them (one request each;
        FSDP2 shards each parameter along its first dimension)."""
        m, t = self.m, par.tp
        z = par.shard_degree if par.zero_stage >= 1 and par.backend in ("fsdp", "deepspeed") else 1
        first_layer, end_layer = stage_range(par, stage, m.layers)
        n = end_layer - first_layer
        full = self.tr.full
        on_gpu = not par.offload
        state = self.state_bytes / 2  # AdamW's two moments, one tensor each
        out: list[tuple[float, float]] = []

        def param(elements: float, count: float, frozen_bytes: float) -> None:
            if full:
                if on_gpu:
                    out.append((elements * self.master / z, count * 2))  # the weight and its gradient
                    if state:
                        out.append((elements * state / z, count * 2))
            else:
                out.append((elements * frozen_bytes / z, count))

        quant = NF4_BYTES if self.w.method == "qlora" else self.c
        for u in m.linears():
            split = 1 if m.spec.is_moe and u in (*m.mlp_in, *m.mlp_out) else t
            param(u.lin.in_features * u.lin.out_features / split, n * u.copies, quant)
        if stage == 0:
            param(m.embedding_params, 1, self.c)
        if stage == par.pp - 1 and m.head_params:
            param(m.head_params / t, 1, self.c)
        if not full and self.lora_per_layer:
            # LoRA's adapters (fp32, trainable: weight, gradient, two moments) are small: the small pool's 2 MiB
            # segments hold them; counted as one kind of tensor per targeted linear.
            k = max(len(self.tr.targets), 1)
            out.append((self.lora_per_layer / k / 2 * 4, n * k * 2 * (2 + (2 if state else 0))))
        return out

    def allocator_reserve(self, par: Parallelism, stage: int, *, loss: float, optimizer_temporaries: bool) -> float:
        """Bytes the caching allocator reserves beyond the tensors of a training step (see LOSS_FRAGMENTATION):
        its rounding of the persistent tensors (engine.planner.allocator.reserved_for), the fragmentation the
        loss leaves, and the optimizer's temporaries of parameters too large for any block freed before."""
        persistent = self.persistent_tensors(par, stage)
        rounding = reserved_for(persistent) - sum(size * count for size, count in persistent)
        outsized = 0.0
        if optimizer_temporaries and self.tr.full:
            m, t = self.m, par.tp
            z = par.shard_degree if par.zero_stage >= 1 else 1
            tokens = par.micro_batch * self.w.seq_len
            largest = max(tokens * m.vocab * 4 / t if m.is_decoder else 0.0, tokens * max(m.inter_per_token, m.h) * 4 / t)
            big = [m.embedding_params if stage == 0 else 0, m.head_params / t if stage == par.pp - 1 else 0]
            outsized = sum(p * 4 / z for p in big if p * 4 / z > largest)
        return rounding + LOSS_FRAGMENTATION * loss + outsized

    # -- inference -------------------------------------------------------------------------------------
    def infer_stage(self, par: Parallelism, stage: int, architecture: str | None) -> StageMemory:
        m, w, t, c = self.m, self.w, par.tp, self.c
        p, lin = self.stage_params(par, stage)
        bits = w.weight_bits
        per = c if bits == 16 else (INT8_BYTES if bits == 8 else NF4_BYTES_DQ)
        weights = lin * per + (p - lin) * c
        first_layer, end_layer = stage_range(par, stage, m.layers)
        n_layers = end_layer - first_layer
        batch = ceil_div(w.global_batch, par.dp)
        # TP splits the cache by KV head; a latent shared by all heads is whole on every rank.
        kv_per_gpu = 1.0 if m.spec.kv_latent else ceil_div(m.spec.num_kv_heads, t) / max(m.spec.num_kv_heads, 1)
        kv = predict_kv_cache(m.spec, batch, w.seq_len, c) * n_layers / m.layers * kv_per_gpu
        prompt = batch * w.prompt_tokens
        # Prefill runs one layer at a time without grad: the residual, norm output, attention and MLP tensors.
        act = prompt * c * (3 * m.h + (m.q_dim + 2 * m.kv_dim) / t + 3 * m.inter_per_token / t) if n_layers else 0.0
        if n_layers and m.spec.attn_eager:
            # Eager attention materialises the layer's scores: fp32 softmax output and its compute-dtype cast.
            act += prompt * w.prompt_tokens * m.spec.num_heads / t * (4 + c)
        if stage == par.pp - 1 and m.is_decoder:
            # The worker keeps only the last position's logits: the head's output in the compute dtype is
            # alive while its fp32 copy is made. Inference keeps the head whole on every TP rank
            # (apply_tensor_parallel without vocab_parallel), so each holds all of them.
            act += batch * m.vocab * (4.0 + c)
        buffers = 0.0
        if bits != 16:
            buffers = max((u.lin.in_features * u.lin.out_features for u in m.linears()), default=0) / t * c
        allocated = weights + kv + act + buffers
        groups = (par.tp > 1) + (par.pp > 1)
        over = overhead_bytes(allocated, architecture=architecture, groups=groups)
        return StageMemory(weights, 0.0, 0.0, act, kv, buffers, over, 0.0)

    def stage(self, par: Parallelism, stage: int, architecture: str | None) -> StageMemory:
        if self.w.training:
            return self.train_stage(par, stage, architecture)
        return self.infer_stage(par, stage, architecture)

    # -- host ------------------------------------------------------------------------------------------
    def host_memory(self, par: Parallelism, stages: list[StageMemory], available: int | None) -> HostMemory:
        ranks = par.world_size
        per_stage = par.dp * par.tp
        offloaded = sum(s.host_offloaded for s in stages) * per_stage
        if self.w.training and self.tr.full and par.backend in ("ddp", "single"):
            load_copy = self.m.params * 4.0  # from_pretrained materializes fp32 weights in RAM before .to(cuda)
        elif self.w.method == "qlora" or not self.w.training:
            # Quantized as shards load, or loaded straight onto the GPUs (device_map): one shard at a time.
            load_copy = min(self.m.params * 2.0, LOAD_SHARD_BYTES)
        else:
            load_copy = self.m.params * 2.0
        copies = par.dp if (par.backend in ("ddp", "single") or (par.backend == "deepspeed" and par.zero_stage < 3)) else 1
        if par.tp > 1 or par.pp > 1 or not self.w.training:
            copies = 1
        needed = ranks * HOST_BYTES_PER_RANK + max(load_copy * copies, offloaded)
        return HostMemory(needed=int(needed), available=available, offloaded=int(offloaded))


_FORMS: dict[tuple, tuple[bool, bool]] = {}


def _sharding_form(par: Parallelism) -> tuple[bool, bool]:
    """(reshard_after_forward, hsdp) of `par`, as engine.layout maps it: remembered by the fields they depend on,
    since the search asks for thousands of candidates (and each recipe) and building a Layout checks every degree."""
    key = (par.backend, par.dp, par.tp, par.pp, par.zero_stage, par.shard_degree, par.offload_params,
           par.offload_optimizer, par.nodes)  # fmt: skip
    found = _FORMS.get(key)
    if found is None:
        found = _FORMS[key] = (par.reshard_after_forward, par.hsdp)
    return found


def stage_range(par: Parallelism, stage: int, layers: int) -> tuple[int, int]:
    if par.stage_layers:
        a, b = par.stage_layers[stage]
        return a, b
    return 0, layers


def plan_memory(mm: MemoryModel, par: Parallelism, topo: Topology) -> tuple[list[MemoryBreakdown], HostMemory]:
    """Per-GPU breakdowns (in rank order) and the host RAM a plan needs."""
    per_stage = par.dp * par.tp
    stages: list[StageMemory] = []
    out: list[MemoryBreakdown] = []
    for s in range(par.pp):
        gpus = par.gpu_indices[s * per_stage : (s + 1) * per_stage]
        arch = topo.gpus[gpus[0]].architecture
        sm = mm.stage(par, s, arch)
        stages.append(sm)
        for g in gpus:
            cap = topo.gpus[g].memory
            weights, grads, optim, acts, kv, buffers, overhead = (
                round(x)
                for x in (sm.weights, sm.gradients, sm.optimizer, sm.activations, sm.kv_cache, sm.buffers, sm.overhead)
            )
            total = weights + grads + optim + acts + kv + buffers + overhead
            out.append(MemoryBreakdown(
                g, s, weights, grads, optim, acts, kv, buffers, overhead, total=total, capacity=cap, headroom=cap - total
            ))  # fmt: skip
    host = mm.host_memory(par, stages, topo.machine.host.memory_total)
    return out, host
