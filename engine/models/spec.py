"""`ModelSpec`: the shape of a transformer, as exact as its config and weights allow.

Built from a Hugging Face config.json (by formula), from safetensors headers
(counted tensor by tensor), from a preset, or by instantiating the config on
the meta device in a subprocess. The planner reads only this dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Linear:
    """One linear layer repeated in every transformer block (per expert for MoE experts)."""

    name: str  # module name as peft targets it: "q_proj", "gate_proj", "c_attn", "query", ...
    in_features: int
    out_features: int
    bias: bool = False
    expert: bool = False  # inside an MoE expert (repeated num_experts times per layer)


@dataclass
class ModelSpec:
    id: str  # repo id, folder path or preset name
    architecture: str  # "LlamaForCausalLM", "BertModel", ...
    model_type: str  # config.json's model_type: "llama", "qwen2", "mixtral", "bert", ...
    params_total: int  # exact count of unique parameters (tied weights once)
    params_active: int  # parameters used per token (== total unless MoE)
    params_embedding: int  # input embedding (+ position embeddings) parameters
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key width per head
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None
    tied_embeddings: bool
    is_decoder: bool = True  # causal LM (has a KV cache) vs encoder
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int | None = None
    num_moe_layers: int = 0
    layer_linears: list[Linear] = field(default_factory=list)  # linears of one block (LoRA targets, TP shapes)
    params_by_dtype: dict[str, int] = field(default_factory=dict)  # from safetensors: {"BF16": n, "F32": m}
    count_source: str = "config"  # "safetensors" | "config" | "meta-device" | "preset"
    notes: list[str] = field(default_factory=list)
    # Elements one layer caches per token where that is one compressed latent shared by all heads instead
    # of keys and values per KV head: DeepSeek's MLA (kv_lora_rank + qk_rope_head_dim), as transformers runs it.
    kv_latent: int | None = None
    # How transformers runs attention and what it keeps besides the linears' tensors (see runtime.py):
    attn_eager: bool = False  # eager attention (the family refuses SDPA): s×s scores and probabilities kept
    attn_softcap: float | None = None  # tanh soft-capping of the scores (Gemma 2)
    final_softcap: float | None = None  # tanh soft-capping of the final logits (Gemma 2)
    sliding_window: int | None = None  # tokens a sliding-window layer attends to
    sliding_layers: int = 0  # layers that use it (beyond the window SDPA gets an explicit s×s mask)
    attention_dropout: float = 0.0  # dropout on the attention probabilities
    hidden_dropout: float = 0.0  # dropout on the attention and MLP outputs (and the embedding)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def params_per_layer(self) -> float:
        """Average non-embedding parameters per block (for pipeline stage splits)."""
        return (self.params_total - self.params_embedding - self._head_params) / max(self.num_layers, 1)

    @property
    def _head_params(self) -> int:
        return 0 if self.tied_embeddings or not self.is_decoder else self.vocab_size * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        d["layer_linears"] = [Linear(**x) for x in d.get("layer_linears", [])]
        return cls(**{k: v for k, v in d.items() if k in _FIELDS})


_FIELDS = {f.name for f in dataclasses.fields(ModelSpec)}
