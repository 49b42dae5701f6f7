"""How a model is spread over the ranks, with PyTorch's own APIs, in torchtitan's order:
tensor parallel, then activation checkpointing, then data parallel (FSDP2 / HSDP / DDP).

Nothing here knows about the training loop; `train.py` and `infer.py` call
these on the module (or pipeline stage) they run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rigpilot.engine.capability import TENSOR_PARALLEL_TYPES
from rigpilot.engine.errors import UserError
from rigpilot.engine.workers.model_loading import is_nf4, nf4_unshardable, transformer_blocks
from rigpilot.engine.workers.parallel_dims import Runtime
from rigpilot.engine.workers.pipeline import ATTENTION_PROJECTIONS, MLP_PROJECTIONS, decoder_parts

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_dtype(name: str) -> torch.dtype:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise UserError(f"precision {name!r}: use one of {', '.join(PRECISIONS)}") from None


@dataclass(frozen=True)
class PrecisionPlan:
    """Where low precision comes from: FSDP's mixed-precision policy on GPUs, autocast otherwise.

    Trainable parameters and optimizer state are fp32 master weights, or bf16 where the job asks for bf16
    master weights; LoRA's frozen base is held in `compute` itself (model_loading.training_load_dtype).
    """

    compute: torch.dtype
    fsdp_params: bool  # FSDP casts parameters for compute (MixedPrecisionPolicy); no autocast needed
    autocast: bool
    device_type: str

    def autocast_context(self) -> Any:
        if not self.autocast:
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(self.device_type, dtype=self.compute)


def precision_plan(name: str, runtime: Runtime) -> PrecisionPlan:
    dtype = precision_dtype(name)
    on_gpu = runtime.device.type == "cuda"
    if dtype == torch.float32:
        return PrecisionPlan(dtype, False, False, runtime.device.type)
    if not on_gpu and dtype == torch.float16:
        # CPU kernels for fp16 are few and slow; bf16 has the same memory cost and fp32's range.
        dtype = torch.bfloat16
    fsdp = on_gpu and runtime.dims.dp_shard > 1
    return PrecisionPlan(dtype, fsdp, not fsdp, runtime.device.type)


# --- tensor parallel -------------------------------------------------------------------------------


def apply_tensor_parallel(
    root: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> list[str]:
    """Megatron-style TP on every Llama-style block: q/k/v and gate/up column-wise, o and down row-wise.

    LoRA layers are split with their base layer (see `_column_plan` and
    `_row_plan`). Mixture-of-experts MLPs (experts, router, shared experts)
    stay replicated: every rank computes them whole. The embedding stays
    replicated. The LM head does too, unless `vocab_parallel`: then it is
    split column-wise by vocabulary and returns DTensor logits sharded on the
    last dim, for a cross-entropy computed under `loss_parallel()` (see
    `logits_split`), so no rank holds the whole logits; a head tied to the
    embedding stays whole (a note says so). With `sequence_parallel`
    (Korthikanti et al. 2022, as in torchtitan) the residual stream between the projections is split along
    the sequence: each rank keeps 1/tp of the norms' inputs and outputs, and
    the row-wise projections reduce-scatter instead of all-reducing. The
    block stack takes and returns whole sequences (the first block splits,
    the last gathers), so masks and rotary tables, which the decoder builds
    from the full sequence before the blocks, need no change, and a pipeline
    stage passes whole activations on. Returns notes for the log.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    parts = decoder_parts(root, "tensor parallel", TENSOR_PARALLEL_TYPES)
    notes: list[str] = []
    tp = tp_mesh.size()
    config = parts.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise UserError(f"tensor parallel {tp} must divide the attention heads ({heads}) and KV heads ({kv_heads})")
    layers = list(parts.inner.layers.values() if isinstance(parts.inner.layers, nn.ModuleDict) else parts.inner.layers)
    for layer in layers:
        if _dense_mlp(layer):
            inter = _out_features(layer.mlp.get_submodule(MLP_PROJECTIONS[0]))
            if inter % tp:
                raise UserError(f"tensor parallel {tp} must divide the MLP width ({inter})")
    if not all(_dense_mlp(layer) for layer in layers):
        notes.append(f"tensor parallel splits the attention {tp} ways; the mixture-of-experts MLPs are replicated")
    seq = Shard(1)
    plan: dict[str, Any] = {}
    if sequence_parallel:
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
        plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True)
        notes.append(f"sequence parallel: norms and the residual stream split {tp} ways along the sequence")
    # parallelize_module re-creates parameters as DTensors, and SequenceParallel's re-created norm
    # weights come back trainable: frozen weights (LoRA's base model) must stay frozen.
    frozen = {n for n, p in parts.root.named_parameters() if not p.requires_grad}
    for layer in layers:
        layer_plan = dict(plan)
        columns = [f"self_attn.{n}" for n in ATTENTION_PROJECTIONS[:3]]
        rows = ["self_attn.o_proj"]
        if _dense_mlp(layer):
            columns += [f"mlp.{n}" for n in MLP_PROJECTIONS[:2]]
            rows.append("mlp.down_proj")
        elif sequence_parallel:
            # A replicated MLP returns the whole sequence; the residual stream keeps this rank's part.
            layer_plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True,
            )  # fmt: skip
        if sequence_parallel:
            # Every norm of the block (Gemma 2 has four) sees the residual stream's sequence shard.
            # Local outputs: Gemma 2 adds its post-norms' outputs to the (plain) residual itself.
            for name, _ in layer.named_children():
                if name.endswith("layernorm") or name.endswith("_norm"):
                    layer_plan[name] = SequenceParallel(use_local_output=True)
        for name in ("q_norm", "k_norm"):
            if isinstance(getattr(layer.self_attn, name, None), nn.Module):
                # Qwen 3 normalises each head: a rank holds its heads only (dim 2 of batch, seq, heads,
                # head_dim), so the weight's gradient is partial; a replicated DTensor sums it over TP.
                layer_plan[f"self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        for path in columns:
            layer_plan.update(_column_plan(layer, path))
        for path in rows:
            layer_plan.update(_row_plan(layer, path, seq if sequence_parallel else Replicate()))
        parallelize_module(layer, tp_mesh, layer_plan)
        for path in rows:
            _shard_lora_dropout(layer.get_submodule(path), tp_mesh.get_local_rank())
        attn = layer.self_attn
        # transformers' attention reshapes with -1 heads, so only explicit head counts need shrinking.
        for attr in ("num_heads", "num_attention_heads", "num_key_value_heads"):
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, getattr(attn, attr) // tp)
    if sequence_parallel and layers:
        whole, split = Replicate(), Shard(1)
        # Whole -> split is a local slice (no communication); split -> whole is one all-gather.
        parallelize_module(layers[0], tp_mesh, PrepareModuleInput(
            input_layouts=(whole,), desired_input_layouts=(split,), use_local_output=True))  # fmt: skip
        parallelize_module(layers[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=split, desired_output_layouts=whole, use_local_output=True))  # fmt: skip
    head = getattr(parts.causal_lm, "lm_head", None)  # None on a pipeline stage before the last
    if vocab_parallel and head is not None:
        embed = getattr(parts.inner, "embed_tokens", None)
        tied = getattr(root, "tied_across_stages", False)  # the last stage's copy of a tied matrix (tied.py)
        if tied or (embed is not None and getattr(head, "weight", None) is embed.weight):
            # Splitting one of the pair would untie it (a different model); a vocabulary-parallel
            # embedding too would need a masked lookup. Whole logits on every rank instead.
            notes.append("the LM head is tied to the embedding: it stays whole on every rank, with the whole logits")
        else:
            plan = _column_plan(parts.causal_lm, "lm_head", output_layouts=Shard(-1), use_local_output=False)
            parallelize_module(parts.causal_lm, tp_mesh, plan)
            notes.append(f"the LM head and the loss split the vocabulary {tp} ways: no rank holds the whole logits")
    _refreeze(parts.root, frozen)
    return notes


def logits_split(module: nn.Module) -> bool:
    """Whether `module`'s LM head returns vocabulary-sharded DTensor logits (apply_tensor_parallel's vocab_parallel).

    Their cross-entropy, forward and backward, must then run under
    `torch.distributed.tensor.parallel.loss_parallel()`.
    """
    from torch.distributed.tensor import DTensor

    get_base = getattr(module, "get_base_model", None)
    lm = get_base() if callable(get_base) else module
    head = getattr(getattr(lm, "parts", None), "causal_lm", lm)
    head = getattr(head, "lm_head", None)
    head = getattr(head, "base_layer", head)
    weight = getattr(head, "weight", None)
    return isinstance(weight, DTensor) and weight.placements[0].is_shard(0)


def _dense_mlp(layer: nn.Module) -> bool:
    """Whether the block's MLP is Llama's gate/up/down (else a mixture of experts, replicated under TP)."""
    mlp = getattr(layer, "mlp", None)
    return mlp is not None and all(hasattr(mlp, n) for n in MLP_PROJECTIONS)


def _out_features(module: nn.Module) -> int:
    base = getattr(module, "base_layer", module)
    return int(base.weight.shape[0])


def _refreeze(root: nn.Module, frozen: set[str]) -> None:
    for name, param in root.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


class ShardDropout(nn.Module):
    """Dropout on this TP rank's slice of the features, with a mask of its own.

    A row-wise LoRA layer drops features of its input shard. nn.Dropout
    there would draw the same mask on every TP rank (they share the seed),
    so feature i of one shard and feature i of the next would always drop
    together. Here every rank takes one number from the shared generator (so
    the ranks' random streams stay together, and recomputation under
    activation checkpointing redraws the same mask) and seeds its own mask
    from it and its rank.
    """

    def __init__(self, p: float, rank: int) -> None:
        super().__init__()
        self.p, self.rank = p, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        seed = int(torch.randint(0, 2**62, (1,)))
        g = torch.Generator(device=x.device).manual_seed(seed + self.rank)
        keep = torch.empty_like(x).bernoulli_(1 - self.p, generator=g)
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, rank={self.rank}"


def _shard_lora_dropout(module: nn.Module, rank: int) -> None:
    dropouts = getattr(module, "lora_dropout", None) if _lora_adapters(module) else None
    for name, dropout in list((dropouts or {}).items()):
        if isinstance(dropout, nn.Dropout) and dropout.p > 0:
            dropouts[name] = ShardDropout(dropout.p, rank)


def _lora_adapters(module: nn.Module) -> list[str] | None:
    """The adapter names of a peft LoRA layer (a wrapper holding base_layer, lora_A, lora_B), else None."""
    lora_a = getattr(module, "lora_A", None)
    if isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(lora_a, nn.ModuleDict):
        if getattr(module, "lora_magnitude_vector", None):  # DoRA normalises by the whole weight's norm
            raise UserError("DoRA with tensor parallel is not supported: use plain LoRA, FSDP or pipeline parallel")
        return list(lora_a.keys())
    return None


def _column_plan(layer: nn.Module, path: str, **style: Any) -> dict[str, Any]:
    """A column-wise projection: its output features split over the TP ranks.

    Under LoRA, y = W x + B(A x): B is split like W (by output feature) and
    the small A stays whole on every rank. A's gradient is still whole, not
    partial: B's ColwiseParallel all-reduces the gradient of its replicated
    input A x in backward, as it does for x itself.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel

    adapters = _lora_adapters(layer.get_submodule(path))
    if adapters is None:
        return {path: ColwiseParallel(**style)}
    lora_b = {f"{path}.lora_B.{a}": ColwiseParallel(**style) for a in adapters}
    return {f"{path}.base_layer": ColwiseParallel(**style), **lora_b}


def _row_plan(layer: nn.Module, path: str, output: Any) -> dict[str, Any]:
    """A row-wise projection: input features split, the output reduced to `output` (whole, or split by sequence).

    Under LoRA, A is split like W (by input feature), so A x is reduced the
    same way as W x (a rank-r tensor: a small all-reduce), and B stays whole.
    With the output whole, every rank sees the same gradient for B. With
    sequence parallel each rank sees only its part of the sequence: B is then
    a replicated DTensor (SequenceParallel), whose partial gradients DTensor
    sums over the TP ranks, as it does for the norms' weights.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    adapters = _lora_adapters(layer.get_submodule(path))
    if adapters is None:
        return {path: RowwiseParallel(output_layouts=output)}
    plan: dict[str, Any] = {f"{path}.base_layer": RowwiseParallel(output_layouts=output)}
    for a in adapters:
        plan[f"{path}.lora_A.{a}"] = RowwiseParallel(output_layouts=output)
        if isinstance(output, Shard):
            plan[f"{path}.lora_B.{a}"] = SequenceParallel(sequence_dim=output.dim, use_local_output=True)
    return plan


# --- activation checkpointing ---------------------------------------------------------------------


def _matmul_ops() -> list[Any]:
    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ]
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Recompute activations in backward, block by block.

    "full" keeps only each block's input and recomputes the whole block.
    "selective" keeps the outputs of the matmuls and attention and recomputes
    only the cheap rest (norms, activations, elementwise ops): less memory than
    no checkpointing, much less recompute than full.
    """
    if mode == "none":
        return
    if mode not in {"full", "selective"}:
        raise UserError(f"activation_checkpointing {mode!r}: use 'none', 'selective' or 'full'")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs: dict[str, Any] = {"preserve_rng_state": True}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _matmul_ops())
    container = _blocks_container(model)
    for key, block in list(container.named_children()):
        container.register_module(key, checkpoint_wrapper(block, **kwargs))


def _blocks_container(model: nn.Module) -> nn.Module:
    """The ModuleList (or a pipeline stage's ModuleDict) holding the blocks."""
    stage_decoder = getattr(getattr(model, "parts", None), "inner", None)
    if stage_decoder is not None:
        return stage_decoder.layers
    return transformer_blocks(model)[1]


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(_blocks_container(model).children())


# --- data parallel --------------------------------------------------------------------------------


def uses_fsdp(dims: Any, cpu_offload: bool = False) -> bool:
    """Whether apply_data_parallel wraps with FSDP2 (else DDP, or nothing).

    CPU offload is FSDP2's CPUOffloadPolicy, so it always means FSDP2, on one rank too.
    """
    return cpu_offload or dims.dp_shard > 1 or (dims.dp_replicate > 1 and dims.non_dp > 1)


def offload_device(runtime: Runtime, cpu_offload: bool) -> torch.device:
    """Where the sharded parameters live: host memory under CPU offload, else the rank's device."""
    return torch.device("cpu") if cpu_offload else runtime.device


def apply_data_parallel(
    model: nn.Module,
    runtime: Runtime,
    precision: PrecisionPlan,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Wrap `model` for data parallelism over the dp dims of the mesh; returns the module to call.

    dp_shard > 1: FSDP2 per block then the root (HSDP over a 2-D mesh when
    dp_replicate > 1 too). Only dp_replicate > 1: DDP on a purely data-parallel
    mesh; next to tensor or pipeline parallelism DDP breaks (it cannot take
    DTensor parameters, and its reducer miscounts the several backward passes
    of a pipeline step), so FSDP2 over a (replicate, shard=1) mesh does plain
    replication instead. `reshard_after_forward=False` keeps each block's
    parameters gathered until its backward: ZeRO-2 rather than ZeRO-3.

    `cpu_offload`: FSDP2 with CPUOffloadPolicy whatever the layout, so the
    sharded parameters, their gradients and the optimizer step stay in host
    RAM and only the block being computed is copied to the GPU. A purely
    replicated layout is sharded over its replicate dim instead (offload is
    asked for to save memory, and sharding saves more; the math is the same),
    a single rank shards over a mesh of one. Host memory is pinned on CUDA
    only (pinning needs a CUDA context; on the CPU the copies are no-ops).
    """
    dims, mesh = runtime.dims, runtime.mesh
    if uses_fsdp(dims, cpu_offload):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if cpu_offload and dims.dp_shard == 1 and dims.dp_replicate > 1 and dims.non_dp == 1:
            dp_mesh = mesh["dp_replicate"]
        elif dims.dp_replicate > 1:
            dp_mesh = mesh["dp_replicate", "dp_shard"]
        else:
            dp_mesh = mesh["dp_shard"]
        # QLoRA: torchao's NF4Tensor implements FSDP2's all-gather hooks, so its frozen 4-bit weights shard
        # and gather in their packed form (a quarter of bf16's traffic), but only in equal parts.
        reason = nf4_unshardable(model, dp_mesh.size(dp_mesh.ndim - 1))
        if reason:
            raise UserError(reason)
        mp = MixedPrecisionPolicy()
        if precision.fsdp_params:
            mp = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=torch.float32)
        offload: OffloadPolicy = OffloadPolicy()
        if cpu_offload:
            offload = CPUOffloadPolicy(pin_memory=runtime.device.type == "cuda")
        block_list = blocks(model)
        for i, block in enumerate(block_list):
            # The last block is needed again right at the start of backward: keep it gathered. Under
            # pipeline parallelism every micro-batch's backward needs them all again: keep all gathered.
            reshard = dims.pp == 1 and i < len(block_list) - 1 and reshard_after_forward
            fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
        fully_shard(
            model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward
        )
        return model
    model.to(runtime.device)
    if dims.dp_replicate > 1:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        # QLoRA's NF4 base weights are frozen and identical on every rank (rank 0 handed out its
        # quantisation, or each rank quantised the same weights); DDP's start-up broadcast cannot send
        # a tensor subclass, and need not.
        frozen_nf4 = [n for n, p in model.named_parameters() if is_nf4(p)]
        if frozen_nf4:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen_nf4)
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            process_group=mesh["dp_replicate"].get_group(),
            broadcast_buffers=has_trained_buffers(model),
            # The gradients live in DDP's all-reduce buckets: no copy into them and back each step.
            gradient_as_bucket_view=True,
        )
    return model


def has_trained_buffers(model: nn.Module) -> bool:
    """Whether the model has buffers that training may change and a checkpoint keeps (BatchNorm's statistics).

    DDP re-sends rank 0's buffers before every forward pass unless told not to: a blocking collective
    per micro-batch (an eighth of a small model's step on CPU ranks). Buffers left out of the state
    dict (rotary tables, position ids) are constants every rank derives alike, and DDP's start-up
    broadcast makes them equal anyway; only saved buffers can carry what training changes.
    """
    buffers = {name for name, _ in model.named_buffers()}
    return bool(buffers & set(model.state_dict().keys()))


def offloaded_shards(model: nn.Module) -> tuple[int, int]:
    """(parameters FSDP2 manages under a CPUOffloadPolicy with their shard in host memory, all parameters).

    Read from FSDP2's own per-module state (a private attribute, hence the guard), so it tells an
    offloaded CPU run from a plain one, whose shards are on the CPU as well.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    on_host = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        if group is None or not isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
            continue
        on_host += sum(1 for fp in group.fsdp_params if fp.sharded_param.to_local().device.type == "cpu")
    return on_host, sum(1 for _ in model.parameters())


def set_gradient_sync(model: nn.Module, enabled: bool) -> Any:
    """What one micro-batch's backward reduces under gradient accumulation; `enabled` on the last one.

    DDP: nothing until the last (its no_sync; its gradients are whole either way). FSDP2: a
    reduce-scatter every micro-batch, accumulated into the sharded gradients, as torchtitan does:
    FSDP2's requires_gradient_sync(False) would instead keep every block's unsharded fp32 gradient
    between micro-batches, the whole model's gradients on every rank, which neither the planner's
    formula nor a ZeRO-3 memory budget allows for. HSDP: the all-reduce across replicas waits for
    the last micro-batch (FSDP2 sums the reduce-scattered shards until then, still sharded).
    Returns a context manager to hold around the micro-batch's forward and backward.
    """
    import contextlib

    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(enabled)
    return contextlib.nullcontext()
