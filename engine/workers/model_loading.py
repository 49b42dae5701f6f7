"""What model a job runs: resolve JobSpec.model, load config, tokenizer and weights, add LoRA.

`JobSpec.model` may be a local folder (config.json + weights), a config.json
file (train from scratch), a Rigpilot preset name, or a Hugging Face repo id,
which is read only from the local cache when HF_HUB_OFFLINE is set (the
service pre-fetches; a worker never downloads on N ranks at once).

Decoder families (anything with a causal-LM head) train on next-token
prediction. Encoders (BERT and friends: their model type has a masked-LM head
in transformers and their checkpoint is not a causal LM) train on masked-LM, so
an encoder such as all-MiniLM-L6-v2 can be fine-tuned as well.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rigpilot.engine.capability import TRAIN_METHODS
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.models.config_file import read_config
from rigpilot.engine.models.presets import find_preset
from rigpilot.engine.schema import ADAPTER_METHODS

Objective = Literal["causal", "masked"]
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
LORA_LINEAR_TYPES = ("Linear", "Conv1D")  # nn.Linear, and GPT-2's transposed Conv1D that peft also wraps


@dataclass
class ModelSource:
    ref: str
    kind: Literal["folder", "config", "preset", "hub"]
    location: str  # folder path, config.json path, or hub repo id
    has_weights: bool
    preset_config: dict[str, Any] | None = None


@dataclass
class LoadedModel:
    model: nn.Module  # the HF model, or the PeftModel around it
    tokenizer: Any
    config: Any  # transformers PreTrainedConfig
    objective: Objective
    source: ModelSource
    lora: bool = False
    new_modules: list[str] = field(default_factory=list)  # modules the checkpoint lacked (freshly initialised)
    saved_dtype: torch.dtype = torch.float32  # the dtype the weights came in, used again when saving
    # Loaded by rank 0 only (see load_model): `model` is a skeleton with its parameters on the meta
    # device until `materialize()`; rank 0 keeps the whole state here to hand out, the others {}.
    rank0_state: dict[str, torch.Tensor] | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the skeleton's (real) buffers
    nf4_linears: int = 0  # QLoRA: adapted linears whose frozen base weight is a 4-bit NF4 tensor


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def resolve_source(ref: str | None) -> ModelSource:
    if not ref or not ref.strip():
        raise UserError("no model given: name a folder, a config.json, a preset or a Hugging Face repo id")
    ref = ref.strip()
    path = Path(ref).expanduser()
    if path.is_file():
        if path.name != "config.json" and path.suffix != ".json":
            raise UserError(f"model {ref} is a file but not a config.json")
        read_config(path)  # one clear line for a corrupt file, before transformers sees it
        return ModelSource(ref, "config", str(path), has_weights=False)
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise UserError(f"model folder {ref} has no config.json")
        read_config(cfg)
        has_weights = any(any(path.glob(p)) for p in WEIGHT_PATTERNS)
        return ModelSource(ref, "folder", str(path), has_weights=has_weights)
    if ref.startswith(("/", "./", "../", "~")):
        raise UserError(f"model folder {ref} not found")
    preset = find_preset(ref)
    if preset is not None:
        return ModelSource(ref, "preset", preset.repo_id, has_weights=True, preset_config=dict(preset.config))
    return ModelSource(ref, "hub", ref, has_weights=True)


def _hub_kwargs(spec: JobSpec) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if offline():
        kwargs["local_files_only"] = True
    return kwargs


def _not_found(source: ModelSource, what: str, e: Exception) -> UserError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = "offline: only the local Hugging Face cache is read" if offline() else "local cache or hub"
    return UserError(f"model {source.ref}: cannot load its {what} ({where}): {first}")


def load_config(source: ModelSource, spec: JobSpec) -> Any:
    from transformers import AutoConfig

    location = str(Path(source.location).parent) if source.kind == "config" else source.location
    try:
        return AutoConfig.from_pretrained(location, **_hub_kwargs(spec))
    except (OSError, ValueError, KeyError) as e:
        if source.preset_config is not None:  # the preset ships its config: enough to train from scratch
            cfg = dict(source.preset_config)
            return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        raise _not_found(source, "config", e) from e


def load_tokenizer(source: ModelSource, spec: JobSpec) -> Any:
    from transformers import AutoTokenizer

    where = str(Path(source.location).parent) if source.kind == "config" else source.location
    try:
        tok = AutoTokenizer.from_pretrained(where, **_hub_kwargs(spec))
    except (OSError, ValueError, KeyError) as e:
        if source.kind == "config":
            raise UserError(
                f"model {source.ref}: no tokenizer next to the config.json (put tokenizer.json beside it)"
            ) from e
        raise _not_found(source, "tokenizer", e) from e
    if tok.pad_token_id is None:
        # Batched generation pads; the end-of-sequence token is the usual stand-in.
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


def detect_objective(config: Any) -> Objective:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    archs = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    if any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        return "causal"
    auto_map = getattr(config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map:
        return "causal"
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or "AutoModelForMaskedLM" in auto_map:
        return "masked"
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal"
    raise UserError(f"model type {config.model_type!r} has neither a causal-LM nor a masked-LM head in transformers")


def auto_class(objective: Objective) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForCausalLM if objective == "causal" else AutoModelForMaskedLM


def config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def training_load_dtype(method: str, compute: torch.dtype, master_weights: str = "fp32") -> torch.dtype:
    """The dtype a training job loads its weights in, given the compute dtype of its precision plan.

    Full and scratch training keep fp32 master weights (autocast or FSDP's policy casts them for
    compute), unless the job asks for bf16 ones (`master_weights`, torchtune's recipe): then the
    weights, their gradients and AdamW's state are all bf16. LoRA and QLoRA load the frozen base in
    the compute dtype, as peft users do: nothing updates it, so fp32 would only double its memory.
    The adapters (and modules_to_save) are trainable and follow `master_weights` (`apply_lora`).
    """
    if method in ADAPTER_METHODS or master_weights == "bf16":
        return compute
    return torch.float32


def trainable_dtype(master_weights: str) -> torch.dtype:
    """The dtype of trainable parameters: what AdamW updates and keeps its state in."""
    return torch.bfloat16 if master_weights == "bf16" else torch.float32


def load_model(
    spec: JobSpec, *, dtype: torch.dtype, for_training: bool, seed: int, rank0_loads: bool = False
) -> LoadedModel:
    """Config, tokenizer and weights of the job's model, on the CPU (the parallelizer moves them).

    `seed` is set before any random initialisation (scratch weights, missing
    heads, LoRA matrices), so every rank builds bit-identical weights: FSDP and
    tensor parallelism shard each rank's own copy and rely on that.

    With `rank0_loads` (torch.distributed initialised) only rank 0 reads the
    weights, into host memory once; every rank, rank 0 included, gets a
    skeleton of the model with its parameters on the meta device, which the
    parallelizer shards as usual and `materialize()` then fills from rank 0.
    Host memory then holds one copy of the model instead of one per rank: on
    8 GPUs, a 70B model is 280 GB of fp32 instead of 2.2 TB. QLoRA too: rank 0
    quantises its copy, the skeletons hold NF4 tensors on the meta device, and
    `materialize()` sends the 4-bit weights, each rank keeping its FSDP shard.
    """
    method = spec.train.method if (for_training and spec.train is not None) else "full"
    if rank0_loads:
        return _load_on_rank0(spec, dtype=dtype, for_training=for_training, seed=seed)
    if method not in TRAIN_METHODS:
        raise UserError(f"train method {method!r}: use 'full', 'lora', 'qlora' or 'scratch'")
    source = resolve_source(spec.model)
    config = load_config(source, spec)
    objective = detect_objective(config)
    tokenizer = load_tokenizer(source, spec)
    cls = auto_class(objective)
    scratch = method == "scratch" or (source.kind == "config" and for_training)
    if scratch and method in ADAPTER_METHODS:
        raise UserError(f"model {source.ref} has no weights: LoRA needs pretrained weights (use method 'scratch')")
    if not scratch and not source.has_weights:
        raise UserError(f"model {source.ref} has no weights (only config.json): train it with method 'scratch' first")
    torch.manual_seed(seed)
    new_modules: list[str] = []
    saved_dtype = config_dtype(config)
    if scratch:
        model = cls.from_config(config, trust_remote_code=spec.trust_remote_code, dtype=dtype)
        saved_dtype = torch.float32
    else:
        try:
            model, info = cls.from_pretrained(
                source.location, dtype=dtype, output_loading_info=True, **_hub_kwargs(spec)
            )
        except (OSError, ValueError) as e:
            raise _not_found(source, "weights", e) from e
        new_modules = fresh_modules(model, set(info.get("missing_keys", ())))
    if objective == "masked" and tokenizer.mask_token_id is None:
        raise UserError(f"model {source.ref} is an encoder but its tokenizer has no mask token for masked-LM training")
    loaded = LoadedModel(
        model, tokenizer, model.config, objective, source, new_modules=new_modules, saved_dtype=saved_dtype
    )
    if method in ADAPTER_METHODS:
        apply_lora(loaded, spec)
    if method == "qlora":
        loaded.nf4_linears = quantize_lora_bases_nf4(loaded.model)
    return loaded


def _load_on_rank0(spec: JobSpec, *, dtype: torch.dtype, for_training: bool, seed: int) -> LoadedModel:
    import torch.distributed as dist
    from accelerate import init_empty_weights

    full: LoadedModel | None = None
    # Rank 0 loads first and says what it found (a bad model fails there, and then on every rank).
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            full = load_model(spec, dtype=dtype, for_training=for_training, seed=seed)
            answer[0] = ("ok", full.new_modules, full.saved_dtype)
        except UserError as e:
            answer[0] = ("error", str(e), None)
    dist.broadcast_object_list(answer, src=0)
    outcome, detail, saved_dtype = answer[0]
    if outcome == "error":
        raise UserError(detail)
    source = resolve_source(spec.model)
    config = load_config(source, spec) if full is None else full.config
    tokenizer = load_tokenizer(source, spec) if full is None else full.tokenizer
    objective = detect_objective(config)
    # Parameters on the meta device; buffers (rotary tables and such, often not in the checkpoint) real.
    with init_empty_weights(include_buffers=False):
        skeleton = auto_class(objective).from_config(config, trust_remote_code=spec.trust_remote_code, dtype=dtype)
    if hasattr(skeleton, "tie_weights"):
        skeleton.tie_weights()  # creating parameters on meta unties them
    loaded = LoadedModel(skeleton, tokenizer, config, objective, source, new_modules=detail, saved_dtype=saved_dtype)
    method = spec.train.method if (for_training and spec.train is not None) else "full"
    if method in ADAPTER_METHODS:  # as load_model decides
        apply_lora(loaded, spec)
    if method == "qlora":
        # NF4 tensors on the meta device: the skeleton's shapes, block sizes and split points are the
        # real ones, so FSDP2 shards it as it will the quantised weights that rank 0 hands out.
        loaded.nf4_linears = quantize_lora_bases_nf4(loaded.model)
    # The skeleton must be the loaded model's twin, tied weights included; where a model class builds
    # differently from its config, every rank falls back to loading the whole model itself.
    mine = _signature(loaded.model)
    signatures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(signatures, _signature(full.model) if full is not None else mine)
    if any(sig != signatures[0] for sig in signatures) or mine != signatures[0]:
        return full if full is not None else load_model(spec, dtype=dtype, for_training=for_training, seed=seed)
    loaded.buffers = {_plain_name(n): b.detach().clone() for n, b in loaded.model.named_buffers()}
    loaded.rank0_state = full.model.state_dict() if full is not None else {}
    return loaded


def _signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], bool]]:
    """Names, shapes and trainability of the unique parameters (a tied pair counts once)."""
    return [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]


def _plain_name(name: str) -> str:
    # Activation checkpointing wraps blocks; their parameters and buffers keep their names inside.
    return name.replace("_checkpoint_wrapped_module.", "")


def materialize(model: nn.Module, loaded: LoadedModel, device: torch.device) -> None:
    """Give a skeleton's (sharded) parameters memory on `device` and rank 0's values; restore its buffers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    assert loaded.rank0_state is not None
    tied = _tied_groups(model)
    model.to_empty(device=device)
    # to_empty gives each module its own new tensor, so a parameter two modules share (BERT's decoder
    # bias, tied embeddings) would come back as two: share it again.
    for group in tied:
        first = getattr(group[0][0], group[0][1])
        for module, name in group[1:]:
            if getattr(module, name) is not first:
                setattr(module, name, first)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            saved = loaded.buffers.get(_plain_name(name))
            if saved is not None:
                buf.copy_(saved)
    nf4 = _broadcast_nf4(model, loaded.rank0_state)
    # Not strict under QLoRA: the NF4 weights, already in place, have left rank 0's state.
    set_model_state_dict(
        model,
        loaded.rank0_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not nf4),
    )
    loaded.rank0_state, loaded.buffers = {}, {}  # rank 0's whole copy is no longer needed


def _broadcast_nf4(model: nn.Module, rank0_state: dict[str, torch.Tensor]) -> int:
    """QLoRA: hand rank 0's NF4 base weights out in their 4-bit form; each rank keeps its FSDP shard.

    The state-dict broadcast cannot send a tensor subclass, so the NF4 entries leave `rank0_state`
    and their inner tensors (codes, scales, second-level factors, the scales' mean, the NF4 levels)
    go out one weight at a time: the traffic and the transient memory are a quarter of bf16's, and
    every rank ends up with exactly the quantisation rank 0 made (quantising each shard on its own
    rank would scale the blocks differently). Returns how many weights were sent.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            # The very tensor FSDP2 gathers from (its own `_sharded_local_tensor`); to_local() of a
            # Parameter returns a view of it, and inner tensors set on a view would not reach FSDP2.
            local = param._local_tensor if isinstance(param, DTensor) else param
            if not is_nf4(local):
                continue
            count += 1
            key = _plain_name(name)
            whole = rank0_state.pop(key, None)
            if dist.get_rank() == 0 and (whole is None or not is_nf4(whole)):
                raise RuntimeError(f"QLoRA: rank 0 has no NF4 weight {key} to hand out")
            device = local.quantized_data.device
            if whole is None:  # the whole weight's block layout, as the skeleton's meta copy has it
                whole = to_nf4(torch.empty(param.shape, dtype=local.dtype, device="meta"))
            for inner in whole.__tensor_flatten__()[0]:
                tensor = getattr(whole, inner)
                received = tensor.to(device) if not tensor.is_meta else torch.empty_like(tensor, device=device)
                dist.broadcast(received, src=0)
                setattr(whole, inner, received)
            part = whole
            if isinstance(param, DTensor):
                for dim, placement in enumerate(param.placements):
                    if isinstance(placement, Shard):
                        n, i = param.device_mesh.size(dim), param.device_mesh.get_local_rank(dim)
                        part = part.split(part.size(0) // n)[i]
            # to_empty() gave the skeleton's codes and scales memory but left the scales' mean and the
            # level table (inner tensors torchao does not shard) on the meta device: take them over.
            for inner in part.__tensor_flatten__()[0]:
                if getattr(local, inner).is_meta:
                    setattr(local, inner, getattr(part, inner).clone())
                else:
                    getattr(local, inner).copy_(getattr(part, inner))
    return count


def _tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) places of each parameter that more than one place holds."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    return [group for group in places.values() if len(group) > 1]


def fresh_modules(model: nn.Module, missing: set[str]) -> list[str]:
    """Modules whose parameters all came out of random init because the checkpoint lacked them (new heads)."""
    fresh = []
    for name, module in model.named_modules():
        params = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=True)]
        if params and all(p in missing for p in params) and not any(name.startswith(f + ".") for f in fresh):
            fresh.append(name)
    return fresh


def transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The repeated blocks of a model: the ModuleList holding the most parameters."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            n = sum(p.numel() for p in module.parameters())
            if best is None or n > best[0]:
                best = (n, name, module)
    if best is None:
        raise UserError(f"{type(model).__name__} has no list of transformer blocks to shard or checkpoint")
    return best[1], best[2]


def default_lora_targets(model: nn.Module) -> str:
    """A peft regex matching every linear projection inside the blocks (attention and MLP), nothing outside."""
    prefix, blocks = transformer_blocks(model)
    names = sorted(
        {
            sub.rsplit(".", 1)[-1]
            for block in blocks
            for sub, m in block.named_modules()
            if sub and type(m).__name__ in LORA_LINEAR_TYPES
        }
    )
    if not names:
        raise UserError(f"{type(model).__name__}: no linear layers in its blocks for LoRA to adapt")
    alternatives = "|".join(re.escape(n) for n in names)
    return rf"(.*\.)?{re.escape(prefix)}\.\d+\.(.*\.)?({alternatives})"


def apply_lora(loaded: LoadedModel, spec: JobSpec) -> None:
    from peft import LoraConfig, get_peft_model

    settings = spec.train
    assert settings is not None
    targets: list[str] | str = settings.lora_targets or default_lora_targets(loaded.model)
    # A frozen, randomly initialised head (e.g. BERT's masked-LM transform) would cap what LoRA can
    # learn, so modules the checkpoint lacked are trained in full, as peft does for classifier heads.
    config = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=targets,
        modules_to_save=loaded.new_modules or None,
        task_type="CAUSAL_LM" if loaded.objective == "causal" else None,
    )
    try:
        loaded.model = get_peft_model(loaded.model, config)
    except ValueError as e:
        raise UserError(f"LoRA targets {targets}: {str(e).splitlines()[0]}") from e
    # peft casts its adapters to fp32 over a half base, but modules_to_save are copies of base modules,
    # in the base's dtype: every trainable parameter needs fp32 for AdamW's updates to land (and FSDP2
    # wants one dtype for the trainable parameters of a unit), or bf16 throughout where the job asks.
    wanted = trainable_dtype(getattr(settings, "master_weights", "fp32"))
    with torch.no_grad():
        for param in loaded.model.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != wanted:
                param.data = param.data.to(wanted)
    loaded.lora = True


# torchtune's QLoRA block sizes: 64 weights share an absmax scale, 256 scales share a second-level one.
NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256
# FSDP2 shards an NF4 weight by splitting each of its inner tensors (codes, scales, second-level
# factors) into equal parts, so a weight needs at least as many second-level blocks as shards.
# Real weights have thousands; a small one gets smaller second-level blocks, so that it still has
# this many, whatever the layout (DDP and FSDP runs then quantise identically).
NF4_MIN_SCALER_BLOCKS = 8


def nf4_scaler_block(blocks: int) -> int:
    """Scales per second-level block: 256, or the largest power of two that leaves >= 8 such blocks."""
    size = NF4_SCALER_BLOCK_SIZE
    while size > 1 and (blocks % size or blocks // size < NF4_MIN_SCALER_BLOCKS):
        size //= 2
    return size


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as torchao's NF4 tensor (4-bit NormalFloat, double-quantised scales, as in QLoRA)."""
    from torchao.quantization import to_nf4 as torchao_to_nf4

    if weight.numel() % NF4_BLOCK_SIZE:
        raise UserError(
            f"QLoRA: a {tuple(weight.shape)} weight does not split into {NF4_BLOCK_SIZE}-value NF4 blocks; "
            "adapt other layers (lora_targets) or use LoRA"
        )
    blocks = weight.numel() // NF4_BLOCK_SIZE
    return torchao_to_nf4(weight.detach(), NF4_BLOCK_SIZE, nf4_scaler_block(blocks))


def nf4_unshardable(model: nn.Module, shards: int) -> str | None:
    """Why FSDP2 cannot split `model`'s NF4 weights `shards` ways (one line), or None when it can.

    torchao splits an NF4 weight's rows and each inner tensor into equal parts, without
    padding: its rows and its second-level scale blocks must divide by the shard count.
    """
    for name, p in model.named_parameters():
        if not is_nf4(p):
            continue
        factors = p.quantization_factor.numel()
        if p.size(0) % shards or factors % shards:  # then the codes and first-level scales split evenly too
            return (
                f"QLoRA: the 4-bit weight {name} {tuple(p.shape)} does not split evenly into {shards} FSDP shards "
                f"({factors} second-level scale blocks); use fewer dp_shard ranks, or dp_replicate"
            )
    return None


def quantize_lora_bases_nf4(model: nn.Module) -> int:
    """Replace the frozen base weight of every LoRA-adapted linear by its NF4 form; returns how many.

    torchao's NF4Tensor dequantises block by block inside F.linear (forward and
    backward), so peft's LoRA layers run unchanged around it, and the adapter
    stays in full precision. Embeddings, norms and heads keep their weights, as in QLoRA.
    """
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        if type(base).__name__ != "Linear" or base.weight.dim() != 2:
            raise UserError(f"QLoRA quantises nn.Linear weights only; {type(base).__name__} cannot be: use LoRA")
        base.weight = nn.Parameter(to_nf4(base.weight), requires_grad=False)
        count += 1
    if count == 0:
        raise UserError("QLoRA: no linear layer was adapted, so nothing was quantised")
    return count


def is_nf4(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def count_params(model: nn.Module) -> dict[str, int]:
    """Total, trainable and per-token-compute (the 6N of MFU) parameter counts, tied weights once."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    compute = total
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    out = get_out() if callable(get_out) else None
    # A lookup table costs no FLOPs, unless the same matrix is also the output projection.
    if emb is not None and (out is None or out.weight is not emb.weight):
        compute -= emb.weight.numel()
    return {"total": total, "trainable": trainable, "compute": compute}
