"""`describe_model`: a preset name, a local folder or a hub repo id in, an exact `ModelSpec` out.

Where the counts come from, best first:
  1. safetensors headers (local files, the HF cache or HTTP range requests): every tensor, per dtype;
  2. a formula over config.json for the families in `formulas.SUPPORTED_MODEL_TYPES`;
  3. any other architecture: transformers builds it on the meta device in a child process.
The structure (layer linears, heads, experts) comes from the formula when there is one.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import EITHER, MISSING, PathRefused, check_given_path, shown
from rigpilot.engine.models.config_file import read_config
from rigpilot.engine.models.formulas import Config, has_formula, is_decoder, spec_from_config
from rigpilot.engine.models.meta_count import MetaCount, count_on_meta
from rigpilot.engine.models.presets import Preset, find_preset, preset_for_repo
from rigpilot.engine.models.repo_id import repo_id_problem
from rigpilot.engine.models.runtime import apply_runtime_facts
from rigpilot.engine.models.safetensors_meta import (
    TensorCount,
    TensorHeader,
    checkpoint_files,
    count_tensors,
    read_checkpoint,
    stored_elements_by_dtype,
)
from rigpilot.engine.models.spec import Linear, ModelSpec


def describe_model(ref: str, *, token: str | None = None, trust_remote_code: bool = False) -> ModelSpec:
    """Describe a model named by preset (`list_presets()`), local folder or Hugging Face repo id.

    Never downloads weights: a hub model costs its config.json and the
    safetensors headers. Raises `UserError` with one line saying what to fix.
    """
    ref = ref.strip()
    if not ref:
        raise UserError("no model given: name a preset, a folder with config.json or a Hugging Face repo id")
    preset = find_preset(ref)
    if preset is not None:
        return describe_preset(preset)
    path = check_given_path(ref, "model", expect=EITHER, missing_ok=True)
    if path.is_dir():
        return _describe_folder(path, token=token, trust_remote_code=trust_remote_code)
    if path.is_file():
        raise UserError(f"{ref} is a file: give the folder that holds config.json")
    if ref.startswith(("/", "./", "../", "~")) or ref.count("/") > 1:
        raise PathRefused(f"{shown(ref)}: no such folder", path=ref, problem=MISSING)
    problem = repo_id_problem(ref)
    if problem:
        raise UserError(f"{ref!r} is neither a preset, a folder nor a Hugging Face repo id: {problem}")
    return _describe_hub(ref, token=token, trust_remote_code=trust_remote_code)


def describe_preset(preset: Preset) -> ModelSpec:
    spec = spec_from_config(preset.config)
    spec.id = preset.name
    spec.count_source = "preset"
    spec.notes.insert(0, f"config.json of {preset.repo_id}, shipped with Rigpilot")
    return spec


def describe_config(
    config: Mapping[str, Any],
    *,
    id: str = "config.json",
    tensors: Mapping[str, TensorHeader] | None = None,
    meta_source: str | None = None,
    trust_remote_code: bool = False,
    token: str | None = None,
) -> ModelSpec:
    """Describe a model from its config.json and, when at hand, its safetensors headers.

    `meta_source` is what the meta-device fallback hands to `AutoConfig`: the
    folder holding config.json, or the repo id when its own code must be fetched.
    """
    if not config.get("model_type"):
        raise UserError(f"{id}: config.json has no model_type, so no transformers model can be built from it")
    quantized = config.get("quantization_config")
    # Quantised checkpoints pack several weights per stored element: their headers do not count parameters.
    count = count_tensors(tensors, tied_embeddings=_tied(config)) if tensors and not quantized else None
    if has_formula(config):
        spec = spec_from_config(config)
        if count is not None:
            _take_checkpoint_count(spec, count)
    elif count is not None:
        spec = _spec_from_tensors(config, tensors or {}, count)
    else:
        meta = _count_on_meta(config, meta_source, trust_remote_code=trust_remote_code, token=token)
        spec = _spec_from_meta(config, meta)
    if quantized and tensors:
        spec.params_by_dtype = stored_elements_by_dtype(tensors.values())
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        spec.notes.append(f"quantised checkpoint ({method}): params_by_dtype lists stored elements, not parameters")
    spec.id = id
    return spec


# --- Where a ref points -------------------------------------------------------------------------------------------


def _describe_folder(folder: Path, *, token: str | None, trust_remote_code: bool) -> ModelSpec:
    config_path = check_given_path(folder / "config.json", "model config", missing_ok=True)
    if not config_path.exists():
        raise UserError(f"{folder}: no config.json (a model folder needs the config.json of its Hugging Face repo)")
    config = read_config(config_path)
    tensors = read_checkpoint(folder) if checkpoint_files(folder) else None
    spec = describe_config(
        config,
        id=str(folder),
        tensors=tensors,
        meta_source=str(folder),
        trust_remote_code=trust_remote_code,
        token=token,
    )
    if tensors is None:
        spec.notes.append("no safetensors weights in the folder: counts from config.json")
    return spec


def _describe_hub(repo_id: str, *, token: str | None, trust_remote_code: bool) -> ModelSpec:
    # huggingface_hub is imported only when a repo is asked for
    from rigpilot.engine.models.hub import HubUnreachable, fetch

    try:
        model = fetch(repo_id, token=token)
    except HubUnreachable:
        preset = preset_for_repo(repo_id)
        if preset is None:
            raise
        spec = describe_preset(preset)
        spec.notes.append(f"{repo_id} is not cached and the hub cannot be reached: answered from preset {preset.name}")
        return spec
    remote_code = trust_remote_code and "auto_map" in model.config
    spec = describe_config(
        model.config,
        id=repo_id,
        tensors=model.tensors,
        meta_source=repo_id if remote_code else str(model.snapshot),
        trust_remote_code=trust_remote_code,
        token=token,
    )
    spec.notes.extend(model.notes)
    return spec


# --- Counts from the checkpoint -----------------------------------------------------------------------------------


def _take_checkpoint_count(spec: ModelSpec, count: TensorCount) -> None:
    """Make the checkpoint's own count the answer, keeping the formula's structure and MoE split."""
    inactive = spec.params_total - spec.params_active
    if count.total != spec.params_total:
        spec.notes.append(
            f"the checkpoint holds {count.total:,} parameters where config.json's formula gives "
            f"{spec.params_total:,} (extra heads or tensors): counts from the checkpoint"
        )
    spec.params_total = count.total
    spec.params_active = count.total - inactive
    spec.params_embedding = count.embedding or spec.params_embedding
    spec.params_by_dtype = count.by_dtype
    spec.count_source = "safetensors"


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks|block)\.(\d+)\.")
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def _spec_from_tensors(config: Mapping[str, Any], tensors: Mapping[str, TensorHeader], count: TensorCount) -> ModelSpec:
    """An architecture without a formula: its structure read off the tensor names of layer 0."""
    dims = _dims(config)
    k = dims["experts_per_token"] or 0
    by_layer: dict[int, list[str]] = defaultdict(list)
    for name in tensors:
        m = _LAYER.search(name)
        if m:
            by_layer[int(m.group(1))].append(name)
    inactive, moe_layers, num_experts = 0, 0, 0
    for names in by_layer.values():
        experts = {int(m.group(1)) for n in names if (m := _EXPERT.search(n))}
        if experts:
            moe_layers += 1
            num_experts = max(num_experts, len(experts))
            expert_params = sum(tensors[n].numel for n in names if _EXPERT.search(n))
            inactive += expert_params * max(len(experts) - k, 0) // len(experts)
    linears = _linears_from_headers(tensors, sorted(by_layer.get(0, [])))
    spec = _generic_spec(config, dims, count.total, count.total - inactive, count.embedding, linears)
    spec.num_experts, spec.num_moe_layers = num_experts, moe_layers
    spec.params_by_dtype = count.by_dtype
    spec.count_source = "safetensors"
    spec.notes.append(f"no formula for {config.get('model_type')!r}: structure read from the checkpoint's tensor names")
    return spec


def _linears_from_headers(tensors: Mapping[str, TensorHeader], layer0: list[str]) -> list[Linear]:
    """2-D weights of layer 0 as linears (PyTorch stores them (out, in)); one expert stands for all."""
    names = set(layer0)
    out = []
    for name in layer0:
        t = tensors[name]
        m = _EXPERT.search(name)
        if not name.endswith(".weight") or len(t.shape) != 2 or (m and m.group(1) != "0"):
            continue
        module = name.removesuffix(".weight")
        out.append(Linear(module.rsplit(".", 1)[-1], t.shape[1], t.shape[0], f"{module}.bias" in names, m is not None))
    return out


# --- Counts from the meta device ----------------------------------------------------------------------------------


def _count_on_meta(
    config: Mapping[str, Any], source: str | None, *, trust_remote_code: bool, token: str | None
) -> MetaCount:
    if source is not None:
        return count_on_meta(source, trust_remote_code=trust_remote_code, token=token)
    # A bare config (no folder): the child reads it from a temporary one.
    with tempfile.TemporaryDirectory(prefix="rigpilot-config-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(dict(config)))
        return count_on_meta(tmp, trust_remote_code=trust_remote_code, token=token)


def _spec_from_meta(config: Mapping[str, Any], meta: MetaCount) -> ModelSpec:
    dims = _dims(config, fallback=meta.dims)
    experts = dims["num_experts"] or meta.num_experts
    k = dims["experts_per_token"] or 0
    # Experts are uniform, so the unvisited share of the first block's expert weights is exact per MoE layer;
    # assuming every block has experts is the approximation (noted).
    inactive = meta.block_expert_params * max(experts - k, 0) // experts * meta.num_blocks if experts else 0
    spec = _generic_spec(
        config,
        dims,
        meta.params_total,
        meta.params_total - inactive,
        meta.params_embedding,
        meta.linears,
        tied=meta.tied,
    )
    spec.architecture = meta.architecture
    spec.count_source = "meta-device"
    spec.notes.append(
        f"no formula for {config.get('model_type')!r}: counted by building {meta.architecture} on the meta device"
    )
    if experts:
        spec.num_experts, spec.num_moe_layers = experts, meta.num_blocks
        spec.notes.append("active parameters assume every layer has experts")
    return spec


# --- Structure without a formula ----------------------------------------------------------------------------------

_DIM_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "experts_per_token": ("num_experts_per_tok", "moe_top_k", "top_k", "num_experts_per_token"),
}


def _dims(config: Mapping[str, Any], fallback: Mapping[str, int | None] | None = None) -> dict[str, int | None]:
    nested = config.get("text_config")  # a multimodal config keeps its language model's facts here
    text: Mapping[str, Any] = nested if isinstance(nested, dict) else config
    c = Config(text)
    dims: dict[str, int | None] = {}
    for key, aliases in _DIM_KEYS.items():
        value = c.get(*aliases)
        if value is None and fallback:
            value = fallback.get(key)
        dims[key] = int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    return dims


def _generic_spec(
    config: Mapping[str, Any],
    dims: dict[str, int | None],
    total: int,
    active: int,
    embedding: int,
    linears: list[Linear],
    *,
    tied: bool | None = None,
) -> ModelSpec:
    missing = [k for k in ("hidden_size", "num_layers", "num_heads") if not dims[k]]
    if missing:
        raise UserError(f"config.json of {config.get('model_type')!r} gives no {', '.join(missing)}: cannot size it")
    hidden, heads = int(dims["hidden_size"] or 0), int(dims["num_heads"] or 0)
    arch = Config(config).architecture
    spec = ModelSpec(
        id="",
        architecture=arch,
        model_type=str(config.get("model_type")),
        params_total=total,
        params_active=active,
        params_embedding=embedding,
        hidden_size=hidden,
        num_layers=int(dims["num_layers"] or 0),
        num_heads=heads,
        num_kv_heads=dims["num_kv_heads"] or (1 if config.get("multi_query") else heads),
        head_dim=dims["head_dim"] or hidden // heads,
        intermediate_size=dims["intermediate_size"] or 4 * hidden,
        vocab_size=dims["vocab_size"] or 0,
        max_position_embeddings=dims["max_position_embeddings"],
        tied_embeddings=_tied(config) if tied is None else tied,
        is_decoder=is_decoder(config),
        experts_per_token=dims["experts_per_token"] or 0,
        layer_linears=linears,
    )
    return apply_runtime_facts(spec, config)


def _tied(config: Mapping[str, Any]) -> bool:
    if has_formula(config):
        return spec_from_config(config).tied_embeddings  # the family's default when the key is absent
    return bool(config.get("tie_word_embeddings", True))  # transformers' PretrainedConfig default
