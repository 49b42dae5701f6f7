"""`python -m rigpilot.engine.workers.memtrace`: the memory of one training step of a plan, traced, not estimated.

The planner's formula is fast but sees only what it was told about. This
builds the engine's own model for a plan the way a training rank does (the
same transformers class and attention implementation, `apply_tensor_parallel`,
`apply_activation_checkpointing`, `apply_data_parallel`, the same loss) on
fake tensors (`FakeTensorMode`: shapes and dtypes, no memory, no weights) in
a fake process group of the plan's world size as rank 0, runs one steady-state
step (the optimizer state already exists, as from the second step on: forward
and backward of up to two micro-batches, then the optimizer step) and reads
the peak of every tensor alive at once from PyTorch's memory trackers
(`MemTracker`, `FSDPMemTracker`).

The plan's recipe (engine.recipe, `trace_plan`'s `recipe` or the workload's fields) runs through the
worker's own code: the loss in chunks (chunked_loss.TokenLoss) and activation offloading
(activation_offload, whose offloaded tensors leave the traced device as they leave a GPU), the optimizer step
in backward (optimizers.OptimizerInBackward: each gradient freed in its hook, so the trace never holds them all)
and 8-bit AdamW (torchao's own quantized state; its compiled update stood in for by the buffers it allocates:
`_traced_adamw8bit`).

A model with many blocks is traced twice with a few of them and the per-block
difference scaled to its layer count, per phase (forward/backward and
optimizer step): block memory is linear in the block count once there is a
middle block under FSDP (with 2, no block's backward has a neighbour's all-gather
prefetched and another's reduce-scatter in flight, as every deeper FSDP
model's peak has). Blocks all alike (Llama, Mistral, Qwen) are traced with 3 and 4
under FSDP, 2 and 3 without; others with 3 and 5, a difference of 2 keeping
alternating layer patterns (Gemma's sliding and global layers) whole.

What it does not see: the CUDA context, NCCL and the allocator's reserve
(the plan's `overhead`, added back by the caller), and collectives' own
buffers. Under FSDP2's CPU offload the host-resident shards, gradients and
optimizer state are left out of the GPU's peak. Inference plans are traced as
`infer.Generator` runs them, through its own `next_token_logits`: the prefill
of the prompt (the head on its last position only), then the last decode step
with the KV cache at its final length. Pipelined inference, quantised
inference and QLoRA are refused with a reason (engine.planner.traceable). No GPU, no weights
(config.json only), no network when offline.

Wire: one JSON object on stdin, `{"plans": [Plan.to_dict(), ...], "trust_remote_code": false}`; one
JSON line on stdout per plan as soon as it is traced, `{"index": i, "ok": true, "peak": bytes, "phases":
{...}, "method": "...", ...}` or `{"index": i, "ok": false, "reason": "one line"}`. The older request
`{"plan": Plan.to_dict()}` gets its one answer without `index`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from rigpilot.engine.layout import Layout
from rigpilot.engine.planner.plan import parallelism_from_dict
from rigpilot.engine.planner.traceable import why_not_traced
from rigpilot.engine.recipe import Recipe

WHOLE_MODEL_LAYERS = 4  # up to this many blocks the whole model is traced
SCALE_FROM = (3, 5)  # else traced with this many blocks and scaled to the layer count
# Model types whose blocks are all alike unless their config's layer_types says otherwise: one block's
# difference is the per-block memory, so these are traced with fewer blocks (`_block_counts`).
UNIFORM_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class NotTraced(Exception):
    """A plan the tracer cannot verify; the message is the one-line reason."""


@dataclass
class Phases:
    """Peak bytes of one traced step: during forward/backward, during the optimizer step, and by category."""

    forward_backward: int
    optimizer: int
    categories: dict[str, int]  # at the step's peak: Parameter, Gradient, Activation, Optstate, Temp, ...
    snapshots: dict[str, dict[str, int]] = field(default_factory=dict)  # categories after forward, backward, step
    labels: tuple[str, str] = ("forward_backward", "optimizer")  # inference: ("prefill", "last_decode")

    @property
    def peak(self) -> int:
        return max(self.forward_backward, self.optimizer)


def trace_plan(plan: dict[str, Any], trust_remote_code: bool = False, recipe: Recipe | None = None) -> dict[str, Any]:
    """The traced peak bytes per GPU of `plan` (Plan.to_dict), or NotTraced saying why not.

    `recipe`: the training recipe the step runs (chunked loss, activation offloading: the worker's own code
    for them); None: the one the plan's workload names, field by field (the plain recipe where it names none).
    """
    started = time.perf_counter()
    workload, par = plan["workload"], plan["parallelism"]
    if recipe is not None:
        workload = {**workload, **recipe.to_dict()}
    _check_supported(workload, par)
    layout = Layout.from_plan(parallelism_from_dict(par))
    config = _load_config(workload["model"], trust_remote_code)
    layers = _num_layers(config)
    counts = _block_counts(config, layout)
    if layout.pp > 1:
        return _trace_pipeline(config, layers, workload, par, layout, trust_remote_code, started, counts)
    if layers <= WHOLE_MODEL_LAYERS:
        phases = _trace_step(config, layers, workload, par, layout, trust_remote_code)
        method = f"whole model ({layers} blocks)"
    else:
        low, high = (_trace_step(config, n, workload, par, layout, trust_remote_code) for n in counts)
        phases = _extrapolate(low, high, counts, layers)
        method = f"{counts[0]} and {counts[1]} of {layers} blocks traced, scaled to {layers}"
    return {
        "ok": True,
        "peak": phases.peak,
        "phases": dict(zip(phases.labels, (phases.forward_backward, phases.optimizer), strict=True)),
        "categories": phases.categories,
        "method": method,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _trace_pipeline(
    config: Any,
    layers: int,
    workload: dict[str, Any],
    par: dict[str, Any],
    layout: Layout,
    trust_remote_code: bool,
    started: float,
    counts: tuple[int, int] = SCALE_FROM,
) -> dict[str, Any]:
    """Each kind of stage traced on its own: the first (embedding, the most micro-batches in flight),
    the last (head and loss), and the second as the fullest of the middle ones; `counts` blocks per stage."""
    from rigpilot.engine.workers.pipeline import stage_layer_ranges

    pp = layout.pp
    ranges = stage_layer_ranges(layers, pp)
    traced = sorted({0, pp - 1} | ({1} if pp > 2 else set()))
    peaks: dict[int, Phases] = {}
    whole = max(end - first for first, end in ranges) <= WHOLE_MODEL_LAYERS
    for s in traced:
        stage_par = {**par, "_stage": s}
        if whole:
            peaks[s] = _trace_step(config, layers, workload, stage_par, layout, trust_remote_code)
            continue
        # n blocks on every stage: a model of n × stages blocks, evenly split as DecoderStage splits it.
        low, high = (_trace_step(config, n * pp, workload, stage_par, layout, trust_remote_code) for n in counts)
        first, end = ranges[s]
        peaks[s] = _extrapolate(low, high, counts, end - first)
    per_stage = {s: peaks[s if s in peaks else 1].peak for s in range(pp)}
    worst = max(peaks.values(), key=lambda ph: ph.peak)
    how = "whole stages" if whole else f"{counts[0]} and {counts[1]} blocks per stage, scaled"
    return {
        "ok": True,
        "peak": worst.peak,
        "stages": {str(s): v for s, v in per_stage.items()},
        "phases": dict(zip(worst.labels, (worst.forward_backward, worst.optimizer), strict=True)),
        "categories": worst.categories,
        "method": f"pipeline stages {', '.join(map(str, traced))} of {pp} traced ({how}); middle stages as stage 1",
        "seconds": round(time.perf_counter() - started, 3),
    }


def _check_supported(workload: dict[str, Any], par: dict[str, Any]) -> None:
    reason = why_not_traced(workload, par)
    if reason is not None:
        raise NotTraced(reason)


def _load_config(model: str, trust_remote_code: bool) -> Any:
    """The model's config; read once per request of `main` (each trace deep-copies it before changing it)."""
    if _CONFIGS is None:
        return _read_config(model, trust_remote_code)
    key = (model, trust_remote_code)
    if key not in _CONFIGS:
        _CONFIGS[key] = _read_config(model, trust_remote_code)
    return _CONFIGS[key]


# Set by `main` for its plans, which all trace the same model; None elsewhere (a test may rewrite a config).
_CONFIGS: dict[tuple[str, bool], Any] | None = None


def _read_config(model: str, trust_remote_code: bool) -> Any:
    from rigpilot.engine.models.presets import preset_for_repo
    from rigpilot.engine.workers.model_loading import load_config, resolve_source

    source = resolve_source(model)
    if source.kind == "hub" and source.preset_config is None:
        # The planner answers for a repo it cannot reach from the preset made from that repo's config
        # (describe._describe_hub): load_config falls back to it only when the repo's own config cannot be read.
        preset = preset_for_repo(model)
        if preset is not None:
            source.preset_config = dict(preset.config)
    return load_config(source, SimpleNamespace(trust_remote_code=trust_remote_code))


def _num_layers(config: Any) -> int:
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise NotTraced(f"model type {config.model_type!r}: its config has no num_hidden_layers to trace")
    return n


def _block_counts(config: Any, layout: Layout) -> tuple[int, int]:
    """How many blocks the two scaled traces have: the fewest whose difference is exactly the per-block memory.

    Under FSDP the smaller needs a middle block (with 2, no block's backward has a neighbour's all-gather
    prefetched and another's reduce-scatter in flight); without it, nothing crosses blocks and 2 will do.
    Blocks all alike differ by one; others (Gemma's sliding and global layers, MoE models' dense first
    layers) keep SCALE_FROM, whose difference of 2 keeps an alternating pattern whole.
    """
    from rigpilot.engine.workers.parallel_dims import ParallelDims
    from rigpilot.engine.workers.parallelize import uses_fsdp

    types = getattr(config, "layer_types", None)
    alike = getattr(config, "model_type", None) in UNIFORM_MODEL_TYPES and (
        not isinstance(types, list) or len(set(types)) <= 1
    )
    if not alike:
        return SCALE_FROM
    low = 3 if uses_fsdp(ParallelDims.from_layout(layout, layout.world_size), layout.cpu_offload) else 2
    return low, low + 1


def _with_layers(config: Any, n: int) -> Any:
    config = copy.deepcopy(config)
    config.num_hidden_layers = n
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and len(types) > n:
        config.layer_types = types[:n]
    return config


def _extrapolate(low: Phases, high: Phases, counts: tuple[int, int], layers: int) -> Phases:
    a, b = counts

    def scale(x: int, y: int) -> int:
        return round(x + (y - x) * (layers - a) / (b - a))

    cats = {k: scale(low.categories.get(k, 0), high.categories.get(k, 0)) for k in high.categories}
    fb, opt = scale(low.forward_backward, high.forward_backward), scale(low.optimizer, high.optimizer)
    return Phases(fb, opt, cats, labels=high.labels)


# --- one traced step ------------------------------------------------------------------------------


def _trace_step(
    config: Any,
    n_layers: int,
    workload: dict[str, Any],
    par: dict[str, Any],
    layout: Layout,
    trust_remote_code: bool,
    real: bool = False,
) -> Phases:
    """One step of `layout` traced: `par` holds the step's own settings (the plan's micro_batch, grad_accum,
    checkpointing; `_stage`, the pipeline stage traced), `layout` how the ranks are arranged."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rigpilot.engine.workers.parallel_dims import MESH_DIMS, ParallelDims

    dims = ParallelDims.from_layout(layout, layout.world_size)
    # real=True inside an initialised process group (gloo ranks of a test) steps real tensors there;
    # otherwise this process is rank 0 of a fake group of the plan's size.
    own_group = not (real and dist.is_initialized())
    if own_group:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=MESH_DIMS)
        # Built and parallelised on the meta device, as a worker builds its skeleton (and device meshes
        # are sliced there: inside the fake mode their coordinates would be data-dependent); then
        # given fake storage, as `materialize` gives it real storage.
        inference = workload.get("task") == "infer"
        with torch.device("meta"):
            build = _build_inference if inference else _build
            built = build(_with_layers(config, n_layers), workload, par, layout, dims, mesh, trust_remote_code)
        # real=True runs the same step on real CPU tensors (for tests of the fake trace itself).
        fake = FakeTensorMode(allow_non_fake_inputs=True) if not real else contextlib.nullcontext()
        with (
            fake,
            _real_masks(),
            _untracked_sharding_propagation(),
            _fake_grouped_mm(),
            _host_rng_state(),
            _collector_paused(),
        ):
            _materialize(built.model)
            return _generation(built, workload, layout) if inference else _fake_step(built, workload, par)
    finally:
        if own_group:
            dist.destroy_process_group()


@contextlib.contextmanager
def _collector_paused() -> Any:
    """Python's collector runs only where the step says, as torchtitan's training loop has it.

    Autograd and FSDP's hooks leave reference cycles that hold tensors until the collector runs, and
    when it runs otherwise depends on every allocation before it: the same step traced twice would
    count a cycle's tensors once and not the other time.
    """
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _untracked_sharding_propagation() -> Any:
    """Keep DTensor's shape inference out of the tracker, as it is on real tensors.

    DTensor infers an op's output shape by running it on fake tensors, in the fake mode it finds
    active: inside the trace that is ours, under the tracker, which would count a global-size
    output for a moment (a transient whole-vocabulary logits tensor, say). With the modes set
    aside it gets a fake mode of its own, as it does beside real tensors.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _host_rng_state() -> Any:
    """Keep the CPU generator's state, which checkpointing saves per block, out of the GPU's count.

    Activation checkpointing keeps the CPU RNG state (5 KB) with every block; on a GPU run that is
    host memory, but the trace has one device. One state taken before the step stands in for all.
    """
    import torch

    original = torch.get_rng_state
    state = original()
    torch.get_rng_state = lambda: state  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.get_rng_state = original


@contextlib.contextmanager
def _fake_grouped_mm() -> Any:
    """Mixture-of-experts layers on fake tensors in any dtype.

    transformers runs the experts through `torch._grouped_mm`, whose CPU kernel takes fp32 but whose
    shape function (all fake tensors have) accepts bf16 only. For other dtypes transformers' own
    fallback custom op stands in: the same inputs saved for backward, the same output.
    """
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return

    def can_use(input: Any, weight: Any, offs: Any) -> bool:
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(weight, FakeTensor) and weight.dtype != torch.bfloat16:
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def _real_masks() -> Any:
    """Let transformers skip the causal mask as it does for a worker's real tensors.

    Its `_ignore_causal_mask_sdpa` takes a fake tensor for a graph being traced and then builds an
    explicit s×s mask instead of SDPA's `is_causal`. A training step has no cache, so its query
    offset is 0: the check gets that 0 (data-dependent checks elsewhere still fail loudly).
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if original is None:
        yield
        return

    def ignore_causal_mask(
        padding_mask: Any, q_length: int, kv_length: int, q_offset: Any, kv_offset: Any, *args: Any, **kwargs: Any
    ) -> bool:
        from torch._subclasses.fake_tensor import FakeTensor

        # The planner's prompts are whole (no padding): a fake all-ones mask is as good as none.
        padding_mask = None if isinstance(padding_mask, FakeTensor) else padding_mask
        q_offset = 0 if isinstance(q_offset, FakeTensor) else q_offset
        kv_offset = 0 if isinstance(kv_offset, FakeTensor) else kv_offset
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, *args, **kwargs)

    packed = getattr(masking_utils, "find_packed_sequence_indices", None)

    def find_packed(position_ids: Any) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        # The worker's batches are whole sequences with positions 0..s-1: never packed.
        return None if isinstance(position_ids, FakeTensor) else packed(position_ids)

    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask
    if packed is not None:
        masking_utils.find_packed_sequence_indices = find_packed
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original
        if packed is not None:
            masking_utils.find_packed_sequence_indices = packed


@dataclass
class _Built:
    model: Any  # the module whose parameters the optimizer steps
    wrapped: Any  # the module called (FSDP2-wrapped model, or the model)
    fsdp: bool
    precision: Any  # parallelize.PrecisionPlan
    loss_parallel: bool
    ddp_buckets: int
    vocab: int
    offload: bool = False  # FSDP2's CPUOffloadPolicy: shards, their gradients and the optimizer in host memory
    stage: Any = None  # pipeline.DecoderStage when the plan is pipelined: this trace's stage
    in_flight: int = 1  # micro-batches whose activations a pipeline stage holds at once


def _build(
    config: Any,
    workload: dict[str, Any],
    par: dict[str, Any],
    layout: Layout,
    dims: Any,
    mesh: Any,
    trust_remote_code: bool,
) -> _Built:
    import torch

    from rigpilot.engine.workers.model_loading import (
        LoadedModel,
        ModelSource,
        apply_lora,
        auto_class,
        detect_objective,
        training_load_dtype,
    )
    from rigpilot.engine.workers.parallel_dims import Runtime
    from rigpilot.engine.workers.parallelize import (
        PrecisionPlan,
        apply_activation_checkpointing,
        apply_data_parallel,
        apply_tensor_parallel,
        logits_split,
        precision_dtype,
        uses_fsdp,
    )

    objective = detect_objective(config)
    if objective != "causal":
        raise NotTraced(f"model type {config.model_type!r} is an encoder: traced verification covers decoders")
    torch.manual_seed(0)
    # As the worker loads it: fp32 master weights, or a LoRA base in the compute dtype (training_load_dtype).
    compute = precision_dtype(workload.get("precision", "bf16"))
    master = str(workload.get("master_weights") or "fp32")
    load_dtype = training_load_dtype(str(workload.get("method", "full")), compute, master)
    model = auto_class(objective).from_config(config, trust_remote_code=trust_remote_code, dtype=load_dtype)
    loaded = LoadedModel(model, None, model.config, objective, ModelSource("", "config", "", False))
    # Two settings of the accuracy harness's own step (trace_compare), never in a plan: a LoRA base in
    # half precision, and transformers' reentrant checkpointing, whose saved tensors the harness can see.
    harness_checkpointing = bool(workload.get("harness_checkpointing")) and par.get("checkpointing") == "full"
    if harness_checkpointing:
        from rigpilot.engine.accuracy.measure import _enable_checkpointing

        _enable_checkpointing(model)
    if workload.get("base_dtype"):
        model.to(precision_dtype(workload["base_dtype"]))
    lora = workload.get("lora") or {}
    if workload.get("method") == "lora":
        targets = [t for t in lora.get("targets") or [] if t != "all-linear"] or None
        train = SimpleNamespace(lora_rank=lora.get("rank", 16), lora_alpha=lora.get("alpha", 32),
                                lora_dropout=lora.get("dropout", 0.0), lora_targets=targets,
                                master_weights=master)  # fmt: skip
        apply_lora(loaded, SimpleNamespace(train=train))
    model = loaded.model
    stage, in_flight = None, 1
    if dims.pp > 1:
        from rigpilot.engine.workers.pipeline import DecoderStage, decoder_parts

        index = int(par["_stage"])
        model = stage = DecoderStage(decoder_parts(model, "pipeline parallel"), index, dims.pp)
        # 1F1B runs at most (stages - index) forwards before this stage's first backward; GPipe all of them.
        micro_batches = layout.pp_microbatches
        gpipe = layout.pp_schedule == "GPipe"
        in_flight = micro_batches if gpipe else min(dims.pp - index, micro_batches)
    runtime = Runtime(mesh.get_rank(), 0, dims.world_size, torch.device("cpu"), "fake", dims, mesh)
    # The plan is for GPUs: the precision the worker picks there (precision_plan with a CUDA device).
    if compute == torch.float32:
        precision = PrecisionPlan(compute, False, False, "cpu")
    else:
        fsdp = dims.dp_shard > 1
        precision = PrecisionPlan(compute, fsdp, not fsdp, "cpu")
    loss_parallel = False
    if dims.tp > 1:
        sp = layout.sequence_parallel and workload["seq_len"] % dims.tp == 0
        apply_tensor_parallel(model, mesh["tp"], sp, vocab_parallel=True)
        loss_parallel = logits_split(model)
    if not harness_checkpointing:
        apply_activation_checkpointing(model, par.get("checkpointing", "none"))
    offload = layout.cpu_offload
    fsdp = uses_fsdp(dims, offload)
    ddp_buckets = 0
    if fsdp:
        reshard = layout.reshard_after_forward
        wrapped = apply_data_parallel(model, runtime, precision, reshard, cpu_offload=offload)
    else:
        # DDP checks and broadcasts real parameter storage in C++, which fake tensors lack: the trace runs
        # the model unwrapped and adds what DDP holds besides, its gradient buckets (without
        # gradient_as_bucket_view, as the engine runs it, a flat copy of every trainable gradient, kept
        # from construction on). A single rank is not wrapped at all.
        wrapped = model
        if dims.dp_replicate > 1:
            ddp_buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return _Built(
        model, wrapped, fsdp, precision, loss_parallel, ddp_buckets, int(config.vocab_size), offload, stage, in_flight
    )


def _build_inference(
    config: Any,
    workload: dict[str, Any],
    par: dict[str, Any],
    layout: Layout,
    dims: Any,
    mesh: Any,
    trust_remote_code: bool,
) -> _Built:
    """The model as `infer.build_replica_model` builds it: weights in the plan's dtype, tensor parallel, eval."""

    from rigpilot.engine.workers.model_loading import auto_class, detect_objective
    from rigpilot.engine.workers.parallelize import PrecisionPlan, apply_tensor_parallel, precision_dtype

    objective = detect_objective(config)
    if objective != "causal":
        raise NotTraced(f"model type {config.model_type!r} is an encoder: it does not generate text")
    dtype = precision_dtype(workload.get("precision", "bf16"))
    model = auto_class(objective).from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    model.eval()
    precision = PrecisionPlan(dtype, False, False, "cpu")
    return _Built(model, model, False, precision, False, 0, int(config.vocab_size))


def _generation(built: _Built, workload: dict[str, Any], layout: Layout) -> Phases:
    """`infer.Generator.generate`'s memory: the prefill, then the last decode step with the cache full.

    Decoding token by token only grows the cache, so the steps between are not run: before the
    last one each layer's cache is given its final length (prompt + new tokens - 1, at most the
    window of a sliding layer), and that step's peak is the decode phase's.
    """
    import math

    import torch
    from transformers import DynamicCache

    from rigpilot.engine.workers.infer import next_token_logits

    model = built.model
    batch = math.ceil(int(workload.get("global_batch", 1)) / layout.dp)
    new_tokens = max(int(workload.get("new_tokens", 0)), 1)
    prompt = max(int(workload["seq_len"]) - new_tokens, 1)
    final = prompt + new_tokens - 1
    tracker = _tracker(model, None, False)
    gpu = _GpuPeak(tracker, frozenset())
    snapshots: dict[str, dict[str, int]] = {}
    with tracker, torch.no_grad():
        ids = torch.randint(built.vocab, (batch, prompt))
        mask = torch.ones_like(ids)
        positions = torch.arange(prompt).expand(batch, prompt)
        cache = DynamicCache(config=model.config)
        logits = next_token_logits(model, ids, mask, positions, cache)
        snapshots["after_prefill"] = _categories(tracker, "current")
        prefill = gpu.take()
        for layer in getattr(cache, "layers", []):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.dim() != 4:
                continue
            window = getattr(layer, "sliding_window", None)
            length = min(final - 1, window - 1) if isinstance(window, int) and window > 0 else final - 1
            layer.keys = keys.new_empty((*keys.shape[:2], length, keys.shape[3]))
            layer.values = values.new_empty((*values.shape[:2], length, values.shape[3]))
        del logits
        tracker.reset_mod_stats()  # the trackers' per-module records take one call at a time
        token = torch.randint(built.vocab, (batch, 1))
        mask = torch.ones((batch, final), dtype=torch.long)
        logits = next_token_logits(model, token, mask, torch.full((batch, 1), final - 1), cache)
        snapshots["after_last_decode"] = _categories(tracker, "current")
        decode = gpu.take()
        del logits
    return Phases(prefill, decode, dict(gpu.at_peak), snapshots, labels=("prefill", "last_decode"))


def _materialize(model: Any) -> None:
    from rigpilot.engine.workers.model_loading import _tied_groups

    tied = _tied_groups(model)
    model.to_empty(device="cpu")
    for group in tied:  # to_empty gives every module its own tensor: share tied weights again
        first = getattr(group[0][0], group[0][1])
        for module, name in group[1:]:
            setattr(module, name, first)


def _fake_step(built: _Built, workload: dict[str, Any], par: dict[str, Any]) -> Phases:
    import torch

    from rigpilot.engine.accuracy.cuda_autocast import CudaAutocastOnCpu, CudaDropoutOnCpu
    from rigpilot.engine.workers.parallelize import set_gradient_sync

    model, wrapped, fsdp, precision = built.model, built.wrapped, built.fsdp, built.precision
    token_loss, offload = _recipe_step(built, workload)
    loss_parallel, ddp_buckets, vocab = built.loss_parallel, built.ddp_buckets, built.vocab
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    host_optimizer = bool(workload.get("optimizer_offload")) and not built.offload
    optimizer: Any
    in_backward = None
    if host_optimizer:
        from rigpilot.engine.workers.optimizer_offload import HostOffloadedOptimizer

        # The worker's: each gradient leaves the GPU in the hook that made it, and the step runs on the host.
        optimizer = HostOffloadedOptimizer(params, lr=1e-4, betas=(0.9, 0.95), device=torch.device("cpu"), rounding=False)
    else:
        optimizer, in_backward = _recipe_optimizer(params, workload)
    _steady_state(optimizer, params)
    if in_backward is not None:
        in_backward.hook()  # from here on each weight steps in its gradient's hook, as the worker's do

    micro, seq = int(par.get("micro_batch", 1)), int(workload["seq_len"])
    accum = min(int(par.get("grad_accum", 1)), 2)  # the second micro-batch sees the first one's gradients
    batches = [(torch.randint(vocab, (micro, seq)), torch.randint(vocab, (micro, seq))) for _ in range(accum)]
    # The chunked loss calls the head once per chunk, and again to recompute each: as a pipeline's passes.
    again = built.in_flight > 1 or token_loss.head is not None
    if in_backward is None:
        tracker = _tracker(wrapped if fsdp else model, optimizer, fsdp, built.in_flight, again, offload=built.offload)
    else:
        # FSDPMemTracker follows one optimizer; the plain tracker takes every weight's own.
        tracker = _tracker(wrapped if fsdp else model, None, fsdp, built.in_flight, again=True)
        tracker.track_external(*in_backward.optimizers)
    host = HOST_CATEGORIES if built.offload else frozenset()
    if host_optimizer:
        # On the trace's one device the host tensors would count as the GPU's: its master copies and gradient
        # buffers (written in backward, which the trackers would take for temporaries) are filed with the state.
        from torch.distributed._tools.mem_tracker import _MemRefType

        for t in optimizer.host_tensors():
            tracker._update_and_maybe_create_winfos(t, _MemRefType.OPT)
        host = HOST_OPTIMIZER
        # The trackers' gradient hooks run after the optimizer's, which has sent the gradient away already.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
    if in_backward is not None:
        # As above: the step's hook has freed the gradient before the trackers' own hook looks for it.
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
    gpu = _GpuPeak(tracker, host)
    autocast_on = precision.autocast
    snapshots: dict[str, dict[str, int]] = {}
    if built.stage is not None:
        batches = batches[:1]  # the stage's own micro-batches are run below
    with tracker:
        if built.stage is not None:
            _stage_passes(built, tracker, micro, seq, snapshots, token_loss, offload)
            batches = []
        for i, (ids, labels) in enumerate(batches):
            if i:
                tracker.reset_mod_stats()  # FSDPMemTracker's per-module records take one pass at a time
            with contextlib.ExitStack() as stack:
                stack.enter_context(set_gradient_sync(wrapped, i == len(batches) - 1))
                if loss_parallel:
                    from torch.distributed.tensor.parallel import loss_parallel as lp

                    stack.enter_context(lp())
                # The GPU's ops on the CPU: CUDA's autocast policy and its bool dropout masks.
                autocast = CudaAutocastOnCpu() if autocast_on else contextlib.nullcontext()
                with precision.autocast_context(), autocast, CudaDropoutOnCpu(), token_loss.model_output():
                    with offload.saving():
                        logits = wrapped(input_ids=ids, use_cache=False).logits  # hidden states if chunked
                loss = token_loss(logits, labels)
                del logits
                snapshots["after_forward"] = _categories(tracker, "current")
                loss.backward()
                del loss
        gc.collect()  # the cycles backward left, at one fixed point (see _collector_paused)
        snapshots["after_backward"] = _categories(tracker, "current")
        cats_fb = gpu.at_peak
        fb = gpu.take()
        if in_backward is not None:
            in_backward.finish_step()  # the weights were stepped in backward: only their norm is left
        else:
            optimizer.step()
        cats_opt = gpu.at_peak
        opt = gpu.take()
        snapshots["after_step"] = _categories(tracker, "current")
        optimizer.zero_grad(set_to_none=True)
    cats = cats_fb if fb >= opt else cats_opt
    if ddp_buckets:
        cats["DDP gradient buckets"] = ddp_buckets
    return Phases(fb + ddp_buckets, opt + ddp_buckets, cats, snapshots)


def _steady_state(optimizer: Any, params: list[Any]) -> None:
    """The optimizer's state as it is from the second step on, before the traced step begins.

    torch's AdamW gets its state as its first step makes it (`_init_group`: a step count and two moments
    per parameter) without that step's arithmetic, a third of a trace's optimizer ops; any other optimizer
    takes a step on zero gradients.
    """
    import torch
    from torch.optim.optimizer import _get_scalar_dtype

    plain = type(optimizer) is torch.optim.AdamW and not any(
        group.get(k) for group in optimizer.param_groups for k in ("amsgrad", "capturable", "fused", "differentiable")
    )
    if plain:
        for p in params:
            optimizer.state[p] = {
                "step": torch.tensor(1.0, dtype=_get_scalar_dtype(), device="cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _stage_passes(
    built: _Built, tracker: Any, micro: int, seq: int, snapshots: dict[str, Any], token_loss: Any, offload: Any
) -> None:
    """A pipeline stage's forwards of its micro-batches in flight, then their backwards, as a schedule runs them.

    The first stage takes token ids, the others the previous stage's hidden states (with a gradient
    to send back); the last computes the loss, the others receive their output's gradient.
    """
    import torch

    from rigpilot.engine.accuracy.cuda_autocast import CudaAutocastOnCpu, CudaDropoutOnCpu

    stage, wrapped, precision = built.stage, built.wrapped, built.precision
    hidden_size = int(stage.parts.config.hidden_size)
    # Half hidden states where the weights the stage computes with are half: FSDP's policy, or a LoRA base.
    half = precision.fsdp_params or any(p.dtype == precision.compute for p in stage.parameters())
    hidden_dtype = precision.compute if half else torch.float32
    pending = []
    for _ in range(built.in_flight):
        if stage.is_first:
            x = torch.randint(built.vocab, (micro, seq))
        else:
            x = torch.empty((micro, seq, hidden_size), dtype=hidden_dtype, requires_grad=True)
        autocast = CudaAutocastOnCpu() if precision.autocast else contextlib.nullcontext()
        # As the worker's schedule runs them: forward and loss under offloading, the loss's tensors kept.
        with precision.autocast_context(), autocast, CudaDropoutOnCpu(), offload.saving():
            out = wrapped(x)
            if stage.is_last:
                with offload.keep_on_device():
                    out = token_loss(out, torch.randint(built.vocab, (micro, seq)))
        pending.append((x, out))
    snapshots["after_forward"] = _categories(tracker, "current")
    # As torch's schedule runs them (PipelineStage.backward_maybe_with_nosync), unlike the worker's
    # gradient accumulation: FSDP2 keeps the unsharded gradients until the last micro-batch's backward.
    sync = getattr(wrapped, "set_requires_gradient_sync", None)
    for i, (x, out) in enumerate(pending):
        if callable(sync):
            sync(i == len(pending) - 1)
        if stage.is_last:
            out.backward()
        else:
            out.backward(torch.empty_like(out))
        pending[i] = (None, None)
        del x, out


def _recipe_step(built: _Built, workload: dict[str, Any]) -> tuple[Any, Any]:
    """The worker's loss (whole or chunked) and activation offloading for the plan's recipe, built as the worker
    builds them (train.Trainer._loss_and_offload); offloaded tensors leave the traced device's count."""
    import torch
    from torch._guards import detect_fake_mode

    from rigpilot.engine.accuracy.cuda_autocast import CudaAutocastOnCpu
    from rigpilot.engine.workers.activation_offload import TracedStore, offload_activations
    from rigpilot.engine.workers.chunked_loss import TokenLoss

    recipe = Recipe.of(SimpleNamespace(**workload))
    precision = built.precision
    module = built.stage if built.stage is not None else built.model

    @contextlib.contextmanager
    def compute() -> Any:
        with precision.autocast_context(), CudaAutocastOnCpu() if precision.autocast else contextlib.nullcontext():
            yield

    token_loss = TokenLoss(module, recipe.loss_chunks, compute)
    token_loss.hold_head(built.wrapped)
    offload = offload_activations(
        module, recipe.activation_offload, torch.device("cpu"), head_in_loss=token_loss.head is not None
    )
    if offload.enabled:
        offload.store = TracedStore() if detect_fake_mode() is not None else _UntrackedHost()
    return token_loss, offload


def _recipe_optimizer(params: list[Any], workload: dict[str, Any]) -> tuple[Any, Any]:
    """The recipe's optimizer as the worker builds it (train.Trainer._new_optimizer), and the worker's
    OptimizerInBackward when each weight steps in its gradient's hook (else None).

    The contract refuses the step in backward under DDP (its buckets hold every gradient anyway). 8-bit AdamW is `_TracedAdamW8bit`: torchao's
    state, made by torchao's own rule, and its compiled update's buffers (see there).
    """
    import torch

    from rigpilot.engine.workers.optimizers import BETAS, OptimizerInBackward

    recipe = Recipe.of(SimpleNamespace(**workload))

    def make(group: list[Any]) -> Any:
        if recipe.optimizer == "adamw8bit":
            return _traced_adamw8bit()(group, lr=1e-4, betas=BETAS)
        return torch.optim.AdamW(group, lr=1e-4, betas=BETAS)

    if not recipe.optimizer_in_backward:
        return make(params), None
    in_backward = OptimizerInBackward(params, make, seed=0, rounding=False, device=torch.device("cpu"))
    return _AllWeights(in_backward.optimizers), in_backward


class _AllWeights:
    """Every weight's own optimizer stepped and zeroed together: the steady state's set-up step."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


# torchao's compiled 8-bit update (`single_param_adam`, torch.compile'd per weight), as inductor writes it for
# a quantized moment pair: two fp32 buffers the size of the weight (the new moments, before they are
# re-quantized) and two of its block scales (their absolute maxima); the rest is fused and in place.
EIGHT_BIT_STEP_BUFFERS = (("weight", 2), ("blocks", 2))


@functools.cache
def _traced_adamw8bit() -> type:
    """The worker's torchao AdamW8bit whose step the trace can run.

    torchao compiles its update per weight, which neither fake tensors nor the memory trackers (dispatch modes)
    can run. The state is torchao's own: `_new_buffer`, the very call its step makes (OptimState8bit's uint8
    codes, fp32 block scales and 256-entry code table for a weight of 4096+ values that the block divides; a
    plain zero tensor else), on fake storage here. The update is stood in for by the buffers the compiled one
    allocates (EIGHT_BIT_STEP_BUFFERS), one weight at a time as torchao steps them; the moments' values are
    not computed (a trace has none).
    """
    import torch
    from torch.utils._python_dispatch import _disable_current_modes
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    from rigpilot.engine.workers.optimizers import _adamw8bit

    # torchao computes its code tables once (cached) with real tensor arithmetic, which fake tensors cannot do.
    with _disable_current_modes():
        get_qmap_signed(), get_qmap_unsigned()
    base = _adamw8bit()

    class TracedAdamW8bit(base):  # type: ignore[misc, valid-type]
        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    _eight_bit_update_buffers(state["exp_avg"])

    return TracedAdamW8bit


def _eight_bit_update_buffers(moment: Any) -> None:
    """Allocate, then free, what the compiled update of one weight holds beside its state."""
    import torch
    from torch.distributed.tensor import DTensor

    local: Any = moment.to_local() if isinstance(moment, DTensor) else moment
    if not hasattr(local, "codes"):
        return  # a plain moment's update fuses into in-place kernels
    sizes = {"weight": local.codes.numel(), "blocks": local.scale.numel()}
    device = local.codes.device
    held = [torch.empty(sizes[what], dtype=torch.float32, device=device) for what, n in EIGHT_BIT_STEP_BUFFERS
            for _ in range(n)]  # fmt: skip
    del held


class _UntrackedHost:
    """Real tensors (the trace's own tests): host copies made out of the trackers' sight, as host memory is
    out of a GPU's; what backward brings back is a device tensor again, and counted."""

    def put(self, t: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return t.detach().clone()

    def get(self, item: Any) -> Any:
        return item.host.clone()

    def finish(self) -> None:
        pass


def _tracker(
    module: Any, optimizer: Any, fsdp: bool, in_flight: int = 1, again: bool = False, offload: bool = False
) -> Any:
    # With micro-batches in flight (or a module called again) the FSDP tracker's per-module records refuse a
    # second forward; the plain tracker counts the same storages (it follows FSDP2's resize_ of unsharded
    # parameters too).
    again = again or in_flight > 1
    if fsdp and (not again or offload):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        # Under CPU offload only the FSDP tracker tells the host-resident shards (its "Sharded" categories)
        # from the GPU's unsharded copies; a module called again (the chunked loss's head) only lapses its records.
        return (_tolerant(_lean(FSDPMemTracker)) if again else _lean(FSDPMemTracker))(module, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    base: Any = _lean(MemTracker)
    if again:
        base = _tolerant(base)

    class Tracker(base):
        # MemTracker hooks every parameter's gradient, and a frozen one (LoRA's base) refuses hooks:
        # mark those as hooked already, with handles that remove nothing.
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    tracker = Tracker()
    tracker.track_external(module, optimizer)
    return tracker


def _lean(base: type) -> type:
    """A tracker that keeps the whole device's peak after each op, and not every module's.

    The trackers' per-module peaks walk every module the tracker has seen after every op (a LoRA model's
    hundreds of adapter modules: most of a trace's time), and the trace reads none of them: its figures are
    the device's totals (`_GpuPeak`, `_categories`), which this keeps as the tracker keeps them.
    """

    def update_peak_stats(self: Any, peak_state: Any) -> None:
        from copy import deepcopy

        from torch.distributed._tools.mem_tracker import _TOTAL_KEY

        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)

    return type(f"Lean{base.__name__}", (base,), {"_update_peak_stats": update_peak_stats})


def _tolerant(base: type) -> type:
    """A tracker that lets a module run forward again before its backward (a pipeline's micro-batches).

    The trackers' per-module records take one pass at a time and refuse a second; the bytes of
    every tensor are followed below the modules (`_GpuPeak`), so those records may just lapse.
    """

    def tolerant(name: str) -> Any:
        hook = getattr(base, name)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return hook(self, *args, **kwargs)
            except (NotImplementedError, KeyError):
                return None

        return call

    hooks = ("_pre_fw_hook", "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook")
    return type(f"Tolerant{base.__name__}", (base,), {name: tolerant(name) for name in hooks})


class _NoHook:
    def remove(self) -> None:
        pass


# Under CPU offload these live in host memory: the GPU holds the rest.
HOST_CATEGORIES = frozenset({"Sharded Param", "Sharded Grad", "OptState"})
# With the optimizer state in host memory: its state, master copies and gradient buffers (filed as optimizer state).
HOST_OPTIMIZER = frozenset({"Optstate"})  # MemTracker's spelling (one GPU: never FSDPMemTracker)


class _GpuPeak:
    """The largest sum of the tracker's categories, host-resident ones left out, over every update.

    The trackers' own peak counts every device's tensors; under CPU offload the trace's one device
    holds both, so the GPU's peak is followed here, at each of the tracker's snapshot updates.
    """

    def __init__(self, tracker: Any, host: frozenset[str]) -> None:
        self.tracker, self.host, self.peak = tracker, host, 0
        self.at_peak: dict[str, int] = {}
        original = tracker._update_snap

        def update(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            self._observe()

        tracker._update_snap = update

    def _observe(self) -> None:
        total = 0
        for snap in self.tracker._curr_mem_snap.values():
            for key, value in snap.items():
                name = str(getattr(key, "value", key))
                if name != "Total" and name not in self.host:
                    total += value
        if total > self.peak:
            self.peak = total
            self.at_peak = _categories(self.tracker, "current")

    def take(self) -> int:
        """The peak since the last take; the next one starts from the current bytes."""
        peak, self.peak = self.peak, 0
        self._observe()
        return peak


def _categories(tracker: Any, which: str = "peak") -> dict[str, int]:
    out: dict[str, int] = {}
    for snap in tracker.get_tracker_snapshot(which).values():
        for k, v in snap.items():
            if k != "Total":
                out[str(getattr(k, "value", k))] = out.get(str(getattr(k, "value", k)), 0) + int(v)
    return out


# --- the subprocess -------------------------------------------------------------------------------


def main() -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the answer
    if "--serve" in sys.argv[1:]:
        return _serve(out)
    try:
        request = json.loads(sys.stdin.read())
    except ValueError:
        request = None
    _quiet()
    _die_with_parent()
    if isinstance(request, dict):
        _warm_imports()
    _request(out, request)
    return 0


def _serve(out: Any) -> int:
    """A warm tracer: torch and the model code imported before the first request, then one request per stdin
    line, each answered as `main` answers one, until stdin closes (the planner process that keeps it is gone)."""
    _quiet()
    _die_with_parent()
    _warm_imports()
    for line in sys.stdin:
        if line.strip():
            try:
                request = json.loads(line)
            except ValueError:
                request = None
            _request(out, request)
    return 0


def _request(out: Any, request: Any) -> None:
    plans = request.get("plans") if isinstance(request, dict) else None
    if isinstance(request, dict) and isinstance(request.get("plan"), dict):
        plans = [request["plan"]]
    if not isinstance(plans, list) or not plans or not all(isinstance(p, dict) for p in plans):
        _answer(out, None, {"ok": False, "reason": 'the tracer takes {"plans": [Plan.to_dict(), ...]} on stdin'})
        return
    global _CONFIGS
    _CONFIGS = {}
    trust = bool(request.get("trust_remote_code", False))
    # One process for every plan asked: torch and transformers are imported once, and each answer is
    # written as soon as it is known, so the planner shows it while the next plan is traced.
    for i, plan in enumerate(plans):
        _answer(out, i if "plans" in request else None, _one(plan, trust))


def _warm_imports() -> None:
    """What every trace imports, imported now: a warm tracer's first trace pays none of it."""
    import torch
    import torch.distributed.fsdp  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: F401
    from transformers import AutoConfig  # noqa: F401

    from rigpilot.engine.workers import parallelize, train  # noqa: F401

    # What stays from here on is never garbage: the step's own collections skip it (see _collector_paused).
    _freeze_new_code()


def _one(plan: dict[str, Any], trust_remote_code: bool) -> dict[str, Any]:
    try:
        return trace_plan(plan, trust_remote_code)
    except NotTraced as e:
        return {"ok": False, "reason": str(e)}
    except Exception as e:
        import traceback

        traceback.print_exc()
        return {"ok": False, "reason": _one_line(e)}
    finally:
        _settle()


def _settle() -> None:
    """After a trace: its garbage collected; and where it imported model code, what stays is frozen as
    `_warm_imports` freezes torch, so that each later trace's collections (see _collector_paused) scan only
    its own objects."""
    gc.collect()
    if len(sys.modules) > _frozen_at_modules:
        _freeze_new_code()


# How many modules were loaded at the last freeze. A frozen object is never collected, even once it is garbage
# (a cache entry evicted later, in a cycle): freezing after every trace would let a warm tracer grow for as long
# as it lives. Freezing only when a trace imported code (a model family's first trace) bounds that by the code
# there is to import, and still keeps that code out of every later collection.
_frozen_at_modules = 0


def _freeze_new_code() -> None:
    global _frozen_at_modules
    gc.collect()
    gc.freeze()
    _frozen_at_modules = len(sys.modules)


def _die_with_parent() -> None:
    """Stop when the planner that asked is gone (killed at its deadline, its client hung up): nobody reads on."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="memtrace-parent", daemon=True).start()


def _answer(out: Any, index: int | None, answer: dict[str, Any]) -> None:
    out.write(json.dumps(answer if index is None else {"index": index, **answer}) + "\n")
    out.flush()


def _one_line(e: Exception) -> str:
    from rigpilot.engine.errors import UserError

    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, UserError):
        return text
    return f"the trace failed: {type(e).__name__}" + (f": {text[:200]}" if text else "")


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    with contextlib.suppress(ImportError):
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
