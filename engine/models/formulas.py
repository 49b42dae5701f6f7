"""Exact parameter counts from a config.json alone, one formula per model family.

Each formula lists the modules that the family's transformers implementation
builds (linears with their biases, norms, embeddings, routers), so the count
is exact to the parameter and the same list gives the planner its LoRA
targets and tensor-parallel shapes. Tests check every formula against
instantiating the same config on the meta device.

Defaults for keys a config.json leaves out are the transformers defaults for
that family (`tie_word_embeddings`, Qwen3's and Gemma's `head_dim`, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.models.runtime import apply_runtime_facts
from rigpilot.engine.models.spec import Linear, ModelSpec

_MISSING = object()


class Config:
    """A config.json with the lookups every formula needs: aliases, defaults, clear errors."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = dict(raw)

    def get(self, *keys: str, default: Any = None) -> Any:
        """The first of `keys` that is present and not null (configs write null for "default")."""
        for k in keys:
            v = self.raw.get(k)
            if v is not None:
                return v
        return default

    def num(self, *keys: str, default: Any = _MISSING) -> int:
        v = self.get(*keys)
        if v is None:
            if default is _MISSING:
                raise UserError(f"config.json of a {self.model_type!r} model lacks {keys[0]!r}")
            return default
        try:
            return int(v)
        except (TypeError, ValueError) as e:
            raise UserError(f"config.json: {keys[0]!r} is {v!r}, not a whole number") from e

    def flag(self, key: str, default: bool) -> bool:
        return bool(self.get(key, default=default))

    @property
    def model_type(self) -> str:
        return str(self.raw.get("model_type", ""))

    @property
    def architecture(self) -> str:
        archs = self.raw.get("architectures") or []
        return str(archs[0]) if archs else ""


@dataclass
class _Block:
    """One transformer block: its linears (expert ones per expert) and every other parameter."""

    linears: list[Linear] = field(default_factory=list)
    other: int = 0  # norms, and routers that are bare weights rather than nn.Linear
    num_experts: int = 0
    experts_per_token: int = 0

    def add(self, name: str, in_features: int, out_features: int, bias: bool = False, expert: bool = False) -> None:
        self.linears.append(Linear(name, in_features, out_features, bias, expert))

    @property
    def params(self) -> int:
        return sum(_linear_params(lin) * (self.num_experts if lin.expert else 1) for lin in self.linears) + self.other

    @property
    def inactive_params(self) -> int:
        """Parameters of the routed experts a token does not visit."""
        per_expert = sum(_linear_params(lin) for lin in self.linears if lin.expert)
        return per_expert * max(self.num_experts - self.experts_per_token, 0)


def _linear_params(lin: Linear) -> int:
    return lin.in_features * lin.out_features + (lin.out_features if lin.bias else 0)


@dataclass(frozen=True)
class _Dims:
    """The shape numbers every family reports."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    tied: bool


@dataclass
class _Model:
    """What a formula returns: the blocks plus everything outside them. `_finish` makes it a ModelSpec."""

    c: Config
    d: _Dims
    blocks: list[_Block]
    embedding: int  # token (+ position, token-type) embedding tables
    other: int  # final norm, embedding norm, pooler, head bias
    architecture: str = ""
    num_shared_experts: int = 0
    moe_intermediate_size: int | None = None
    notes: list[str] = field(default_factory=list)
    kv_latent: int | None = None

    @property
    def is_decoder(self) -> bool:
        return is_decoder(self.c.raw)

    @property
    def head(self) -> int:
        """The untied output matrix (0 when tied, and for encoders, which have none)."""
        return 0 if self.d.tied or not self.is_decoder else self.d.vocab * self.d.hidden


def _decoder(c: Config, d: _Dims, blocks: list[_Block], *, final_norm: int, **extra: Any) -> _Model:
    """The common frame: token embedding, blocks, final norm, lm_head unless tied."""
    return _Model(c, d, blocks, embedding=d.vocab * d.hidden, other=final_norm, **extra)


def _finish(m: _Model) -> ModelSpec:
    total = m.embedding + m.other + m.head + sum(b.params for b in m.blocks)
    moe_blocks = [b for b in m.blocks if b.num_experts]
    # The planner reads one block's linears; for MoE models the routed-expert block is the typical one.
    typical = moe_blocks[0] if moe_blocks else m.blocks[0]
    if moe_blocks and len(moe_blocks) < len(m.blocks):
        m.notes.append(f"{len(m.blocks) - len(moe_blocks)} of {len(m.blocks)} layers are dense (no experts)")
    return ModelSpec(
        id="",
        architecture=m.architecture or m.c.architecture,
        model_type=m.c.model_type,
        params_total=total,
        params_active=total - sum(b.inactive_params for b in moe_blocks),
        params_embedding=m.embedding,
        hidden_size=m.d.hidden,
        num_layers=len(m.blocks),
        num_heads=m.d.heads,
        num_kv_heads=m.d.kv_heads,
        head_dim=m.d.head_dim,
        intermediate_size=m.d.inter,
        vocab_size=m.d.vocab,
        max_position_embeddings=m.c.get("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"),
        tied_embeddings=m.d.tied,
        is_decoder=m.is_decoder,
        num_experts=typical.num_experts,
        experts_per_token=typical.experts_per_token,
        num_shared_experts=m.num_shared_experts,
        moe_intermediate_size=m.moe_intermediate_size,
        num_moe_layers=len(moe_blocks),
        layer_linears=list(typical.linears),
        count_source="config",
        notes=m.notes,
        kv_latent=m.kv_latent,
    )


def _attention(b: _Block, d: _Dims, qkv_bias: bool, o_bias: bool) -> None:
    b.add("q_proj", d.hidden, d.heads * d.head_dim, qkv_bias)
    b.add("k_proj", d.hidden, d.kv_heads * d.head_dim, qkv_bias)
    b.add("v_proj", d.hidden, d.kv_heads * d.head_dim, qkv_bias)
    b.add("o_proj", d.heads * d.head_dim, d.hidden, o_bias)


def _gated_mlp(b: _Block, hidden: int, inter: int, bias: bool = False, expert: bool = False) -> None:
    b.add("gate_proj", hidden, inter, bias, expert)
    b.add("up_proj", hidden, inter, bias, expert)
    b.add("down_proj", inter, hidden, bias, expert)


def _gqa_dims(c: Config, *, tied_default: bool, head_dim_default: int | None = None) -> _Dims:
    """Dims of the Llama-style families: grouped KV heads, head_dim overridable in the config."""
    hidden, heads = c.num("hidden_size"), c.num("num_attention_heads")
    return _Dims(
        hidden=hidden,
        heads=heads,
        kv_heads=c.num("num_key_value_heads", default=heads),
        head_dim=c.num("head_dim", default=head_dim_default or hidden // heads),
        inter=c.num("intermediate_size"),
        vocab=c.num("vocab_size"),
        tied=c.flag("tie_word_embeddings", tied_default),
    )


# --- Llama and its close relatives: RMSNorm, rotary, SwiGLU -------------------------------------------------------


@dataclass(frozen=True)
class _LlamaFlavour:
    qkv_bias: str | bool  # a config key, or a fixed answer
    o_bias: str | bool
    mlp_bias: str | bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys
    norms_per_layer: int = 2  # Gemma 2 adds pre/post feed-forward norms
    tied_default: bool = False
    head_dim_default: int | None = None  # None: hidden_size // num_heads


_LLAMA_FLAVOURS = {
    "llama": _LlamaFlavour(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": _LlamaFlavour(qkv_bias=False, o_bias=False),
    "qwen2": _LlamaFlavour(qkv_bias=True, o_bias=False),
    "qwen3": _LlamaFlavour(qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, head_dim_default=128),
    "gemma": _LlamaFlavour(qkv_bias="attention_bias", o_bias="attention_bias", tied_default=True, head_dim_default=256),
    "gemma2": _LlamaFlavour(
        qkv_bias="attention_bias", o_bias="attention_bias", norms_per_layer=4, tied_default=True, head_dim_default=256
    ),
}


def _llama_like(c: Config) -> _Model:
    f = _LLAMA_FLAVOURS[c.model_type]

    def bias(spec: str | bool) -> bool:
        return c.flag(spec, False) if isinstance(spec, str) else spec

    d = _gqa_dims(c, tied_default=f.tied_default, head_dim_default=f.head_dim_default)
    blocks = []
    for _ in range(c.num("num_hidden_layers")):
        b = _Block(other=f.norms_per_layer * d.hidden + (2 * d.head_dim if f.qk_norm else 0))
        _attention(b, d, bias(f.qkv_bias), bias(f.o_bias))
        _gated_mlp(b, d.hidden, d.inter, bias(f.mlp_bias))
        blocks.append(b)
    return _decoder(c, d, blocks, final_norm=d.hidden)


def _mixtral(c: Config) -> _Model:
    d = _gqa_dims(c, tied_default=False)
    experts, top_k = c.num("num_local_experts"), c.num("num_experts_per_tok")
    blocks = []
    for _ in range(c.num("num_hidden_layers")):
        b = _Block(other=2 * d.hidden, num_experts=experts, experts_per_token=top_k)
        _attention(b, d, False, False)
        b.add("gate", d.hidden, experts)  # the router
        # Checkpoint names of the expert SwiGLU (transformers 5 fuses them into 3-D parameters on load).
        b.add("w1", d.hidden, d.inter, expert=True)
        b.add("w3", d.hidden, d.inter, expert=True)
        b.add("w2", d.inter, d.hidden, expert=True)
        blocks.append(b)
    return _decoder(c, d, blocks, final_norm=d.hidden, moe_intermediate_size=d.inter)


def _qwen_moe(c: Config) -> _Model:
    """Qwen2-MoE (a shared expert behind a sigmoid gate) and Qwen3-MoE (q/k norms, no shared expert)."""
    qwen3 = c.model_type == "qwen3_moe"
    d = _gqa_dims(c, tied_default=False, head_dim_default=128 if qwen3 else None)
    experts, top_k = c.num("num_experts"), c.num("num_experts_per_tok")
    moe_inter = c.num("moe_intermediate_size")
    shared_inter = 0 if qwen3 else c.num("shared_expert_intermediate_size", default=0)
    sparse_step = c.num("decoder_sparse_step", default=1)
    dense_layers = set(c.get("mlp_only_layers", default=[]))
    attn_bias = c.flag("attention_bias", False)
    blocks = []
    for i in range(c.num("num_hidden_layers")):
        b = _Block(other=2 * d.hidden + (2 * d.head_dim if qwen3 else 0))
        if qwen3:
            _attention(b, d, attn_bias, attn_bias)
        else:
            _attention(b, d, c.flag("qkv_bias", True), False)
        if i not in dense_layers and experts > 0 and (i + 1) % sparse_step == 0:
            b.num_experts, b.experts_per_token = experts, top_k
            b.add("gate", d.hidden, experts)
            _gated_mlp(b, d.hidden, moe_inter, expert=True)
            if shared_inter:
                _gated_mlp(b, d.hidden, shared_inter)
                b.add("shared_expert_gate", d.hidden, 1)
        else:
            _gated_mlp(b, d.hidden, d.inter)
        blocks.append(b)
    return _decoder(
        c, d, blocks, final_norm=d.hidden, num_shared_experts=1 if shared_inter else 0, moe_intermediate_size=moe_inter
    )


def _deepseek(c: Config) -> _Model:
    """DeepSeek-MoE ("deepseek", plain attention) and DeepSeek-V2/V3 (multi-head latent attention, MLA)."""
    mla = c.model_type in ("deepseek_v2", "deepseek_v3")
    d = _gqa_dims(c, tied_default=False)
    experts = c.num("n_routed_experts", default=0)
    top_k = c.num("num_experts_per_tok", default=0)
    moe_inter = c.num("moe_intermediate_size", default=d.inter)
    shared = c.num("n_shared_experts", default=0)
    first_dense = c.num("first_k_dense_replace", default=0)
    freq = c.num("moe_layer_freq", default=1)
    attn_bias = c.flag("attention_bias", False)
    notes: list[str] = []
    if mla:
        q_lora, kv_lora = c.get("q_lora_rank"), c.num("kv_lora_rank")
        rope, nope, v_dim = c.num("qk_rope_head_dim"), c.num("qk_nope_head_dim"), c.num("v_head_dim")
        # Every head has its own decompressed key; head_dim is the query/key width.
        d = dataclasses.replace(d, kv_heads=d.heads, head_dim=nope + rope)
        notes.append(
            f"multi-head latent attention: the KV cache holds one {kv_lora}+{rope} latent per token and layer "
            f"(not {d.heads} heads of keys and values), whole on every tensor-parallel rank"
        )
    blocks = []
    for i in range(c.num("num_hidden_layers")):
        b = _Block(other=2 * d.hidden)
        if mla:
            if q_lora is None:
                b.add("q_proj", d.hidden, d.heads * d.head_dim)
            else:
                b.add("q_a_proj", d.hidden, int(q_lora), attn_bias)
                b.other += int(q_lora)  # q_a_layernorm
                b.add("q_b_proj", int(q_lora), d.heads * d.head_dim)
            b.add("kv_a_proj_with_mqa", d.hidden, kv_lora + rope, attn_bias)
            b.other += kv_lora  # kv_a_layernorm
            b.add("kv_b_proj", kv_lora, d.heads * (nope + v_dim))
            b.add("o_proj", d.heads * v_dim, d.hidden, attn_bias)
        else:
            _attention(b, d, attn_bias, attn_bias)
        if experts and i >= first_dense and i % freq == 0:
            b.num_experts, b.experts_per_token = experts, top_k
            # The router is a bare weight (MoEGate), not an nn.Linear. V3's per-expert score-correction bias
            # is a buffer in transformers, though checkpoints store it.
            b.other += experts * d.hidden
            _gated_mlp(b, d.hidden, moe_inter, expert=True)
            if shared:
                _gated_mlp(b, d.hidden, moe_inter * shared)
        else:
            _gated_mlp(b, d.hidden, d.inter)
        blocks.append(b)
    model = _decoder(
        c, d, blocks, final_norm=d.hidden, num_shared_experts=shared, moe_intermediate_size=moe_inter, notes=notes
    )
    if mla:
        model.kv_latent = kv_lora + rope
    return model


# --- Families with their own layouts ------------------------------------------------------------------------------


def _phi(c: Config) -> _Model:
    """Phi-1/1.5/2: LayerNorms with biases, parallel attention and MLP, partial rotary, a biased lm_head."""
    d = _gqa_dims(c, tied_default=False)
    d = dataclasses.replace(d, head_dim=d.hidden // d.heads)  # Phi ignores a head_dim key
    qk_norm = c.flag("qk_layernorm", False)
    blocks = []
    for _ in range(c.num("num_hidden_layers")):
        # One input LayerNorm (weight + bias); optional LayerNorms over head_dim on queries and keys.
        b = _Block(other=2 * d.hidden + (4 * d.head_dim if qk_norm else 0))
        b.add("q_proj", d.hidden, d.heads * d.head_dim, True)
        b.add("k_proj", d.hidden, d.kv_heads * d.head_dim, True)
        b.add("v_proj", d.hidden, d.kv_heads * d.head_dim, True)
        b.add("dense", d.heads * d.head_dim, d.hidden, True)
        b.add("fc1", d.hidden, d.inter, True)
        b.add("fc2", d.inter, d.hidden, True)
        blocks.append(b)
    return _decoder(c, d, blocks, final_norm=2 * d.hidden + d.vocab)  # final LayerNorm + lm_head bias


def _phi3(c: Config) -> _Model:
    """Phi-3/3.5/4-mini: fused qkv_proj and gate_up_proj."""
    d = _gqa_dims(c, tied_default=False)
    blocks = []
    for _ in range(c.num("num_hidden_layers")):
        b = _Block(other=2 * d.hidden)
        b.add("qkv_proj", d.hidden, (d.heads + 2 * d.kv_heads) * d.head_dim)
        b.add("o_proj", d.heads * d.head_dim, d.hidden)
        b.add("gate_up_proj", d.hidden, 2 * d.inter)
        b.add("down_proj", d.inter, d.hidden)
        blocks.append(b)
    return _decoder(c, d, blocks, final_norm=d.hidden)


def _gpt2(c: Config) -> _Model:
    """GPT-2: Conv1D layers (c_attn, c_proj, c_fc), learned positions, a tied head."""
    hidden, heads = c.num("n_embd", "hidden_size"), c.num("n_head", "num_attention_heads")
    inter = c.num("n_inner", default=4 * hidden)
    d = _Dims(hidden, heads, heads, hidden // heads, inter, c.num("vocab_size"), c.flag("tie_word_embeddings", True))
    blocks = []
    for _ in range(c.num("n_layer", "num_hidden_layers")):
        b = _Block(other=4 * hidden)  # ln_1, ln_2
        b.add("c_attn", hidden, 3 * hidden, True)
        b.add("c_proj", hidden, hidden, True)  # attention output
        b.add("c_fc", hidden, inter, True)
        b.add("c_proj", inter, hidden, True)  # MLP output: peft's "c_proj" targets both
        blocks.append(b)
    positions = c.num("n_positions", "max_position_embeddings")
    return _Model(c, d, blocks, embedding=(d.vocab + positions) * hidden, other=2 * hidden)


def _gpt_neox(c: Config) -> _Model:
    """GPT-NeoX / Pythia: fused query_key_value, biases, an untied embed_out."""
    d = _gqa_dims(c, tied_default=False)
    d = dataclasses.replace(d, kv_heads=d.heads, head_dim=d.hidden // d.heads)
    bias = c.flag("attention_bias", True)
    blocks = []
    for _ in range(c.num("num_hidden_layers")):
        b = _Block(other=4 * d.hidden)
        b.add("query_key_value", d.hidden, 3 * d.hidden, bias)
        b.add("dense", d.hidden, d.hidden, bias)
        b.add("dense_h_to_4h", d.hidden, d.inter, True)
        b.add("dense_4h_to_h", d.inter, d.hidden, True)
        blocks.append(b)
    return _decoder(c, d, blocks, final_norm=2 * d.hidden)


def _falcon(c: Config) -> _Model:
    """Falcon: 7B (multi-query, parallel attention) and 40B/180B (new decoder architecture, grouped KV)."""
    hidden, heads = c.num("hidden_size"), c.num("num_attention_heads", "n_head")
    head_dim = hidden // heads
    new_arch = c.flag("new_decoder_architecture", False)
    parallel = c.flag("parallel_attn", True)
    bias = c.flag("bias", False)
    if new_arch:
        kv_heads = c.num("num_kv_heads", default=heads)
        qkv_out = (heads + 2 * kv_heads) * head_dim
    elif c.flag("multi_query", True):
        kv_heads, qkv_out = 1, hidden + 2 * head_dim
    else:
        kv_heads, qkv_out = heads, 3 * hidden
    if not parallel:
        layer_norms = 2
    elif new_arch:
        layer_norms = c.num("num_ln_in_parallel_attn", default=2)
    else:
        layer_norms = 1
    inter = c.num("ffn_hidden_size", default=4 * hidden)
    d = _Dims(hidden, heads, kv_heads, head_dim, inter, c.num("vocab_size"), c.flag("tie_word_embeddings", True))
    blocks = []
    for _ in range(c.num("num_hidden_layers", "n_layer")):
        b = _Block(other=layer_norms * 2 * hidden)
        b.add("query_key_value", hidden, qkv_out, bias)
        b.add("dense", hidden, hidden, bias)
        b.add("dense_h_to_4h", hidden, inter, bias)
        b.add("dense_4h_to_h", inter, hidden, bias)
        blocks.append(b)
    return _decoder(c, d, blocks, final_norm=2 * hidden)


_ENCODER_CLASSES = {
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "camembert": "CamembertModel",
    "distilbert": "DistilBertModel",
}


def _bert(c: Config) -> _Model:
    """BERT, RoBERTa, XLM-R: the bare encoder AutoModel builds, pooler included, task heads not."""
    hidden, heads = c.num("hidden_size"), c.num("num_attention_heads")
    d = _Dims(hidden, heads, heads, hidden // heads, c.num("intermediate_size"), c.num("vocab_size"), tied=True)
    blocks = []
    for _ in range(c.num("num_hidden_layers")):
        b = _Block(other=4 * hidden)  # two LayerNorms
        b.add("query", hidden, hidden, True)
        b.add("key", hidden, hidden, True)
        b.add("value", hidden, hidden, True)
        b.add("dense", hidden, hidden, True)  # attention.output.dense
        b.add("dense", hidden, d.inter, True)  # intermediate.dense
        b.add("dense", d.inter, hidden, True)  # output.dense
        blocks.append(b)
    tables = d.vocab + c.num("max_position_embeddings") + c.num("type_vocab_size", default=2)
    pooler = hidden * hidden + hidden
    return _encoder(c, d, blocks, embedding=tables * hidden, other=2 * hidden + pooler)


def _distilbert(c: Config) -> _Model:
    hidden, heads = c.num("dim", "hidden_size"), c.num("n_heads", "num_attention_heads")
    inter = c.num("hidden_dim", "intermediate_size")
    d = _Dims(hidden, heads, heads, hidden // heads, inter, c.num("vocab_size"), tied=True)
    blocks = []
    for _ in range(c.num("n_layers", "num_hidden_layers")):
        b = _Block(other=4 * hidden)  # sa_layer_norm, output_layer_norm
        for name in ("q_lin", "k_lin", "v_lin", "out_lin"):
            b.add(name, hidden, hidden, True)
        b.add("lin1", hidden, inter, True)
        b.add("lin2", inter, hidden, True)
        blocks.append(b)
    embedding = (d.vocab + c.num("max_position_embeddings")) * hidden
    return _encoder(c, d, blocks, embedding=embedding, other=2 * hidden)


def _encoder(c: Config, d: _Dims, blocks: list[_Block], *, embedding: int, other: int) -> _Model:
    arch = _ENCODER_CLASSES[c.model_type]
    m = _Model(c, d, blocks, embedding=embedding, other=other, architecture=arch)
    if c.architecture and c.architecture != arch:
        m.notes.append(f"counted as the bare encoder {arch} (AutoModel), without {c.architecture}'s task head")
    return m


_FORMULAS: dict[str, Callable[[Config], _Model]] = {
    **dict.fromkeys(_LLAMA_FLAVOURS, _llama_like),
    "mixtral": _mixtral,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "deepseek": _deepseek,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "phi": _phi,
    "phi3": _phi3,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "falcon": _falcon,
    "RefinedWeb": _falcon,  # Falcon's names before it joined transformers
    "RefinedWebModel": _falcon,
    "bert": _bert,
    "roberta": _bert,
    "xlm-roberta": _bert,
    "camembert": _bert,
    "distilbert": _distilbert,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FORMULAS))


def is_decoder(config: Mapping[str, Any]) -> bool:
    """Whether a config.json's model is a causal LM with an output head (lm_head): what loss chunks split and the
    KV cache belongs to. The planner's ModelSpec and the submission's recipe check both read it here."""
    c = Config(config)
    if c.model_type in _FORMULAS:
        return c.model_type not in _ENCODER_CLASSES  # counted as the bare encoder, whatever head the config names
    arch = c.architecture
    return any(s in arch for s in ("CausalLM", "LMHead", "ConditionalGeneration")) or not arch


def has_formula(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") in _FORMULAS


def spec_from_config(config: Mapping[str, Any]) -> ModelSpec:
    """The exact ModelSpec of a supported config (see `SUPPORTED_MODEL_TYPES`), with `id` left empty."""
    c = Config(config)
    formula = _FORMULAS.get(c.model_type)
    if formula is None:
        raise UserError(f"no parameter formula for model_type {c.model_type!r}")
    if c.model_type.startswith("RefinedWeb"):
        # Old Falcon configs: multi_query unless the new decoder layout says otherwise, n_head_kv for grouped KV.
        c.raw.setdefault("new_decoder_architecture", c.model_type == "RefinedWeb")
        c.raw.setdefault("num_kv_heads", c.raw.get("n_head_kv"))
    return apply_runtime_facts(_finish(formula(c)), c.raw)
