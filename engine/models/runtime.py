"""How transformers runs a family's attention, read from config.json: what its memory depends on beyond shapes.

Which attention implementation transformers picks (families whose modeling
code refuses SDPA run eager attention, which keeps s×s tensors), soft-capping
(Gemma 2), sliding windows (beyond the window SDPA is handed an explicit mask)
and dropout. Values follow transformers 5's config defaults where config.json
leaves a key out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rigpilot.engine.models.spec import ModelSpec

# Families whose transformers 5 modeling code sets `_supports_sdpa = False` (soft-capping, custom masks):
# without flash-attention installed and asked for, transformers runs them with eager attention.
EAGER_ATTENTION_TYPES = frozenset({"gemma2", "gpt_oss", "granite_swa", "granitemoe_swa", "vaultgemma"})
# config.json keys left out default to a window in these families (the config class's default).
_DEFAULT_WINDOW = {"mistral": 4096, "gemma2": 4096, "gemma3_text": 4096, "gemma3": 4096}
# Families whose sliding window is used only with use_sliding_window (and from max_window_layers on).
_OPT_IN_WINDOW = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
_HIDDEN_DROPOUT_KEYS = ("hidden_dropout", "resid_pdrop", "hidden_dropout_prob", "dropout")


def apply_runtime_facts(spec: ModelSpec, config: Mapping[str, Any]) -> ModelSpec:
    """Fill `spec`'s attention-implementation, soft-capping, window and dropout fields from `config`."""
    nested = config.get("text_config")  # a multimodal config keeps its language model's facts here
    text: Mapping[str, Any] = nested if isinstance(nested, dict) else config
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    spec.attn_eager = model_type in EAGER_ATTENTION_TYPES
    spec.attn_softcap = _positive(text.get("attn_logit_softcapping"))
    spec.final_softcap = _positive(text.get("final_logit_softcapping"))
    window, layers = _window(text, model_type, spec.num_layers)
    spec.sliding_window, spec.sliding_layers = window, layers
    spec.attention_dropout = _first_float(text, _ATTENTION_DROPOUT_KEYS)
    spec.hidden_dropout = _first_float(text, _HIDDEN_DROPOUT_KEYS)
    return spec


def _window(c: Mapping[str, Any], model_type: str, layers: int) -> tuple[int | None, int]:
    if "sliding_window" in c:
        window = c.get("sliding_window")
    else:
        window = _DEFAULT_WINDOW.get(model_type)
    if not isinstance(window, int | float) or isinstance(window, bool) or window <= 0:
        return None, 0
    types = c.get("layer_types")
    if isinstance(types, list) and types:
        n = sum(1 for t in types if t == "sliding_attention")
        return (int(window), n) if n else (None, 0)
    if model_type in _OPT_IN_WINDOW:
        if not c.get("use_sliding_window"):
            return None, 0
        first = c.get("max_window_layers")
        first = int(first) if isinstance(first, int) else layers
        return int(window), max(layers - first, 0)
    if model_type == "gemma2":
        return int(window), (layers + 1) // 2  # every other layer, the first included
    if model_type.startswith("gemma3"):
        pattern = c.get("sliding_window_pattern")
        pattern = int(pattern) if isinstance(pattern, int) and pattern > 0 else 6
        return int(window), layers - layers // pattern  # all but every pattern-th layer
    return int(window), layers


def _positive(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and v > 0 else None


def _first_float(c: Mapping[str, Any], keys: tuple[str, ...]) -> float:
    for k in keys:
        v = c.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return 0.0
