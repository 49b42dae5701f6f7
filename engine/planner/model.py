"""What the planner needs to know about a model, derived once from its `ModelSpec`.

The spec lists one block's linears by the names peft targets; from their order
and shapes we recover the dataflow of a block (which linears read the
attention norm's output, which one writes the attention result, which read the
MLP norm's output, which write the MLP result). The memory and FLOP formulas
walk that dataflow, so one formula serves Llama, GPT-2, BERT, Falcon and MoE
models alike, with the exact shapes of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rigpilot.engine.errors import UserError
from rigpilot.engine.models.spec import Linear, ModelSpec

# Linears that read the attention norm's output (or, for multi-head latent attention, a latent made from it).
_ATTN_IN = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "query",
        "key",
        "value",
        "c_attn",
        "qkv_proj",
        "query_key_value",
        "Wqkv",
        "q_lin",
        "k_lin",
        "v_lin",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "qkv",
    }
)
_GATED = frozenset({"gate_proj", "up_proj", "w1", "w3", "gate_up_proj"})
# Families whose blocks use LayerNorm (input, mean and rstd saved) rather than RMSNorm.
_LAYERNORM_TYPES = frozenset(
    {"gpt2", "bert", "distilbert", "gpt_neox", "falcon", "phi", "opt", "gptj", "bloom", "roberta"}
)
# GPT-2 and Phi use "gelu_new", written in Python: autograd keeps about four intermediates of the MLP width.
_COMPOSITE_GELU_TYPES = frozenset({"gpt2", "phi", "gptj"})
# Gemma's RMSNorm multiplies by (1 + weight) in fp32, so it keeps the normalized input in fp32.
_FP32_NORM_TYPES = frozenset({"gemma", "gemma2", "gemma3_text", "gemma3"})
# Gemma 2 and 3 wrap attention and MLP in "sandwich" norms: four RMSNorms a block instead of two.
_SANDWICH_NORM_TYPES = frozenset({"gemma2", "gemma3_text", "gemma3"})
# Families that normalise queries and keys (per head, or OLMoE's over the whole projection); Gemma 3's q/k norms
# are its fp32 RMSNorm (see _FP32_NORM_TYPES).
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "olmo2", "olmoe", "gemma3_text", "gemma3"})
# Families whose rotary embedding concatenates the rotated and passed-through parts (torch.cat): q comes out
# contiguous per head, so does SDPA's output, and o_proj's input is a fresh copy of it.
_CAT_ROPE_TYPES = frozenset({"phi3"})
# MLP linears that write the block's output, whatever their shapes (an expert's width may equal h).
_MLP_OUT = frozenset({"down_proj", "w2"})
# Families that apply rotary position embeddings from cos/sin tables shared by all layers.
_ABSOLUTE_POSITION_TYPES = frozenset({"gpt2", "bert", "distilbert", "opt", "bloom", "roberta"})
_ALL_LINEAR = "all-linear"
# peft's default LoRA targets when a LoraConfig names none (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
_PEFT_DEFAULT_TARGETS = {
    "gpt2": ["c_attn"],
    "bert": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
    "gpt_neox": ["query_key_value"],
    "falcon": ["query_key_value"],
    "phi3": ["qkv_proj"],
    "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa"],
    "deepseek_v3": ["q_proj", "kv_a_proj_with_mqa"],
}


@dataclass(frozen=True)
class LinearUse:
    """One linear of a block, with how many copies a token passes through (experts)."""

    lin: Linear
    per_token: int  # top-k experts a token visits (1 for dense linears)
    copies: int  # copies held per layer (num_experts for expert linears)

    @property
    def weight_params(self) -> int:
        return self.lin.in_features * self.lin.out_features * self.copies

    @property
    def params(self) -> int:
        return (
            self.lin.in_features * self.lin.out_features + (self.lin.out_features if self.lin.bias else 0)
        ) * self.copies


@dataclass(frozen=True)
class ModelFacts:
    spec: ModelSpec
    attn_in: tuple[LinearUse, ...]
    attn_out: tuple[LinearUse, ...]
    mlp_in: tuple[LinearUse, ...]  # includes the MoE router
    mlp_out: tuple[LinearUse, ...]
    q_dim: int  # heads × head_dim
    kv_dim: int  # kv_heads × head_dim
    inter_per_token: int  # MLP width a token passes through (k experts × expert width + shared)
    gated: bool
    layernorm: bool
    fp32_norm: bool  # the norm keeps its normalized input in fp32 whatever the input dtype
    act_saves: int  # tensors of MLP width an activation function saves
    rope: bool
    qk_norm: bool
    norms_per_layer: int  # RMSNorm/LayerNorm modules on a block's residual path
    fused_qkv: bool  # one linear makes q, k and v (its output stays alive while a view of it is saved)
    cat_rope: bool  # o_proj's input is a copy of SDPA's output (see _CAT_ROPE_TYPES)
    head_params: int  # untied output matrix (0 when tied or absent)
    layer_linear_params: int  # weights + biases of one block's linears
    # of which the MoE MLP (experts, router, shared experts): whole on every tensor-parallel rank (engine.capability)
    layer_expert_params: int
    layer_other_params: float  # norms, router tables: what TP does not split
    matmul_params_per_token: int  # parameters a token multiplies by (active, embedding lookup excluded, head included)
    notes: tuple[str, ...] = field(default=())

    @property
    def h(self) -> int:
        return self.spec.hidden_size

    @property
    def layers(self) -> int:
        return self.spec.num_layers

    @property
    def vocab(self) -> int:
        return self.spec.vocab_size

    @property
    def params(self) -> int:
        return self.spec.params_total

    @property
    def is_decoder(self) -> bool:
        return self.spec.is_decoder

    @property
    def layer_params(self) -> float:
        return self.spec.params_per_layer

    @property
    def embedding_params(self) -> int:
        return self.spec.params_embedding

    def linears(self) -> tuple[LinearUse, ...]:
        return self.attn_in + self.attn_out + self.mlp_in + self.mlp_out

    def resolve_targets(self, targets: list[str] | str | None) -> list[str]:
        """LoRA target names as peft would match them in this model; `None` means peft's default."""
        names = [u.lin.name for u in self.linears()]
        if targets is None:
            wanted = _PEFT_DEFAULT_TARGETS.get(self.spec.model_type, ["q_proj", "v_proj"])
        elif isinstance(targets, str):
            wanted = [t.strip() for t in targets.split(",") if t.strip()]
        else:
            wanted = list(targets)
        if _ALL_LINEAR in wanted:
            # peft's "all-linear" takes every linear except the output layer.
            return list(dict.fromkeys(names))
        unknown = [t for t in wanted if t not in names]
        if unknown:
            raise UserError(
                f"LoRA target {', '.join(unknown)} is not a linear of {self.spec.id or self.spec.model_type}; "
                f"its linears are {', '.join(dict.fromkeys(names))} (or use all-linear)"
            )
        return list(dict.fromkeys(wanted))

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: rank × (in + out) for every targeted linear (and every expert copy) of every layer."""
        per_layer = sum(
            rank * (u.lin.in_features + u.lin.out_features) * u.copies for u in self.linears() if u.lin.name in targets
        )
        return per_layer * self.layers

    def quantizable_params(self) -> int:
        """Weights bitsandbytes quantizes: every linear inside the blocks (not embeddings, norms or the head)."""
        return sum(u.weight_params for u in self.linears()) * self.layers


def model_facts(spec: ModelSpec) -> ModelFacts:
    if spec.num_layers <= 0 or spec.hidden_size <= 0:
        raise UserError(f"model {spec.id or spec.model_type!r} has no transformer layers to plan for")
    h = spec.hidden_size
    k = max(spec.experts_per_token, 1)
    attn_in: list[LinearUse] = []
    attn_out: list[LinearUse] = []
    mlp_in: list[LinearUse] = []
    mlp_out: list[LinearUse] = []
    stage = "attn_in"
    for lin in spec.layer_linears:
        use = LinearUse(lin, k if lin.expert else 1, max(spec.num_experts, 1) if lin.expert else 1)
        if stage == "attn_in":
            if lin.name in _ATTN_IN:
                attn_in.append(use)
                continue
            attn_out.append(use)
            stage = "mlp"
        elif lin.name in _MLP_OUT or (lin.out_features == h and lin.in_features != h):
            mlp_out.append(use)
        else:
            mlp_in.append(use)
    notes: list[str] = []
    q_dim = spec.num_heads * spec.head_dim
    kv_dim = spec.num_kv_heads * spec.head_dim
    if not spec.layer_linears:
        # No structure known: assume a Llama-style block so the formulas still have shapes.
        notes.append("the model's layer structure is unknown; assumed a Llama-style block")
        inter = spec.intermediate_size
        attn_in = [
            LinearUse(Linear(n, h, d), 1, 1) for n, d in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim))
        ]
        attn_out = [LinearUse(Linear("o_proj", q_dim, h), 1, 1)]
        mlp_in = [LinearUse(Linear(n, h, inter), 1, 1) for n in ("gate_proj", "up_proj")]
        mlp_out = [LinearUse(Linear("down_proj", inter, h), 1, 1)]
    inter_tok = sum(u.lin.in_features * u.per_token for u in mlp_out) or spec.intermediate_size
    linear_params = sum(u.params for u in (*attn_in, *attn_out, *mlp_in, *mlp_out))
    head = 0 if spec.tied_embeddings or not spec.is_decoder else spec.vocab_size * h
    per_token_linear = sum(
        (u.lin.in_features * u.lin.out_features) * u.per_token for u in (*attn_in, *attn_out, *mlp_in, *mlp_out)
    )
    if spec.is_moe:
        matmul = per_token_linear * spec.num_layers
    else:
        matmul = spec.params_active - spec.params_embedding - head
    if spec.is_decoder:
        matmul += spec.vocab_size * h
    return ModelFacts(
        spec=spec,
        attn_in=tuple(attn_in),
        attn_out=tuple(attn_out),
        mlp_in=tuple(mlp_in),
        mlp_out=tuple(mlp_out),
        q_dim=q_dim,
        kv_dim=kv_dim,
        inter_per_token=inter_tok,
        gated=any(u.lin.name in _GATED for u in mlp_in),
        layernorm=spec.model_type in _LAYERNORM_TYPES,
        fp32_norm=spec.model_type in _FP32_NORM_TYPES,
        act_saves=4 if spec.model_type in _COMPOSITE_GELU_TYPES else 1,
        rope=spec.model_type not in _ABSOLUTE_POSITION_TYPES,
        qk_norm=spec.model_type in _QK_NORM_TYPES,
        norms_per_layer=4 if spec.model_type in _SANDWICH_NORM_TYPES else 2,
        fused_qkv=len([u for u in attn_in if u.lin.in_features == h]) == 1,
        cat_rope=spec.model_type in _CAT_ROPE_TYPES,
        head_params=head,
        layer_linear_params=linear_params,
        # Tensor parallel keeps a mixture-of-experts MLP whole: experts, router and shared experts alike.
        layer_expert_params=sum(u.params for u in (*mlp_in, *mlp_out)) if spec.is_moe else 0,
        layer_other_params=max(spec.params_per_layer - linear_params, 0.0),
        matmul_params_per_token=int(matmul),
        notes=tuple(notes),
    )


def train_flops_per_token(m: ModelFacts, seq_len: int, *, frozen_base: bool = False) -> float:
    """Model FLOPs per trained token: 6N + 12·L·h·s (PaLM appendix B), 4N when base weights are frozen.

    Frozen weights (LoRA, QLoRA) skip their weight-gradient matmul, so a token costs
    forward 2N + input-gradient 2N. The attention term counts the score and value
    matmuls (forward 4·s·h per layer, backward twice that) for the full s×s square,
    the convention MFU figures use even though causal kernels skip half of it.
    """
    dense = (4.0 if frozen_base else 6.0) * m.matmul_params_per_token
    return dense + 12.0 * m.layers * m.q_dim * seq_len


def forward_flops_per_token(m: ModelFacts, seq_len: int) -> float:
    """One forward pass: 2N + 4·L·h·s (what activation recomputation repeats)."""
    return 2.0 * m.matmul_params_per_token + 4.0 * m.layers * m.q_dim * seq_len
