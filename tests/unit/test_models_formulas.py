"""Parameter formulas: exact against known counts and against transformers building the same config.

The published configs are the real config.json values of public models. The
tiny configs keep each family's structure (biases, GQA, tied heads, MoE
layouts) at 2-4 layers so the same check runs on every variant.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.models import list_presets
from rigpilot.engine.models.formulas import SUPPORTED_MODEL_TYPES, spec_from_config

# --- Real config.json values, with the parameter counts the models publish -------------------------------------

LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 32000,
}  # fmt: skip
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
}  # fmt: skip
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "vocab_size": 32000,
}  # fmt: skip
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064,
}  # fmt: skip
GEMMA_7B = {
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "head_dim": 256, "hidden_act": "gelu",
    "hidden_size": 3072, "intermediate_size": 24576, "max_position_embeddings": 8192, "model_type": "gemma",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "vocab_size": 256000,
}  # fmt: skip
PHI_2 = {
    "architectures": ["PhiForCausalLM"], "hidden_act": "gelu_new", "hidden_size": 2560, "intermediate_size": 10240,
    "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "phi", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "partial_rotary_factor": 0.4, "qk_layernorm": False,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 51200,
}  # fmt: skip
GPT2 = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "vocab_size": 50257,
}  # fmt: skip
PYTHIA_1B = {
    "architectures": ["GPTNeoXForCausalLM"], "hidden_act": "gelu", "hidden_size": 2048, "intermediate_size": 8192,
    "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8,
    "num_hidden_layers": 16, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
    "use_parallel_residual": True, "vocab_size": 50304,
}  # fmt: skip
FALCON_7B = {
    "alibi": False, "architectures": ["FalconForCausalLM"], "bias": False, "hidden_size": 4544,
    "layer_norm_epsilon": 1e-05, "model_type": "falcon", "multi_query": True, "new_decoder_architecture": False,
    "num_attention_heads": 71, "num_hidden_layers": 32, "parallel_attn": True, "vocab_size": 65024,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
}  # fmt: skip
BERT_BASE_UNCASED = {
    "architectures": ["BertForMaskedLM"], "hidden_act": "gelu", "hidden_size": 768, "intermediate_size": 3072,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
    "num_hidden_layers": 12, "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": 30522,
}  # fmt: skip
QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632,
    "tie_word_embeddings": False, "vocab_size": 151936,
}  # fmt: skip
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 1,
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip
DEEPSEEK_MOE_16B = {  # trust_remote_code only: checked against the count, not built
    "architectures": ["DeepseekForCausalLM"], "attention_bias": False, "first_k_dense_replace": 1,
    "hidden_size": 2048, "intermediate_size": 10944, "model_type": "deepseek", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_routed_experts": 64, "n_shared_experts": 2, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 28, "num_key_value_heads": 16, "tie_word_embeddings": False,
    "vocab_size": 102400,
}  # fmt: skip

PUBLISHED: dict[str, tuple[dict[str, Any], int]] = {
    "Llama-2-7B": (LLAMA_2_7B, 6_738_415_616),
    "Llama-3-8B": (LLAMA_3_8B, 8_030_261_248),
    "Mistral-7B-v0.1": (MISTRAL_7B_V01, 7_241_732_096),
    "Qwen2.5-7B": (QWEN2_5_7B, 7_615_616_512),
    "Gemma-7B": (GEMMA_7B, 8_537_680_896),
    "Phi-2": (PHI_2, 2_779_683_840),
    "GPT-2": (GPT2, 124_439_808),
    "Pythia-1B": (PYTHIA_1B, 1_011_781_632),
    "Falcon-7B": (FALCON_7B, 6_921_720_704),
    "Mixtral-8x7B": (MIXTRAL_8X7B, 46_702_792_704),
    "bert-base-uncased": (BERT_BASE_UNCASED, 109_482_240),  # BertModel with pooler
    "Qwen1.5-MoE-A2.7B": (QWEN1_5_MOE_A2_7B, 14_315_784_192),
    "DeepSeek-V2-Lite": (DEEPSEEK_V2_LITE, 15_706_484_224),
    "deepseek-moe-16b": (DEEPSEEK_MOE_16B, 16_375_728_128),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_formula_matches_the_published_count(name: str) -> None:
    config, expected = PUBLISHED[name]
    assert spec_from_config(config).params_total == expected


def test_active_parameters_of_moe_models() -> None:
    mixtral = spec_from_config(MIXTRAL_8X7B)
    # 6 of 8 experts idle per token: 32 layers x 6 x 3 x 4096 x 14336
    assert mixtral.params_active == 46_702_792_704 - 32 * 6 * 3 * 4096 * 14336 == 12_879_925_248
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.num_moe_layers) == (8, 2, 32)
    ds = spec_from_config(DEEPSEEK_V2_LITE)
    assert ds.num_moe_layers == 26 and ds.num_shared_experts == 2
    assert ds.params_active == 15_706_484_224 - 26 * (64 - 6) * 3 * 2048 * 1408
    qwen = spec_from_config(QWEN1_5_MOE_A2_7B)
    assert qwen.params_active == 14_315_784_192 - 24 * (60 - 4) * 3 * 2048 * 1408


def test_structure_the_planner_reads() -> None:
    llama3 = spec_from_config(LLAMA_3_8B)
    assert (llama3.num_kv_heads, llama3.head_dim, llama3.tied_embeddings) == (8, 128, False)
    assert [lin.name for lin in llama3.layer_linears] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    ]  # fmt: skip
    assert llama3.params_embedding == 128256 * 4096
    assert llama3.params_per_layer == (8_030_261_248 - 2 * 128256 * 4096) / 32  # final norm spread over layers
    falcon = spec_from_config(FALCON_7B)
    assert (falcon.num_kv_heads, falcon.head_dim, falcon.tied_embeddings) == (1, 64, True)
    gpt2 = spec_from_config(GPT2)
    assert [(lin.name, lin.in_features, lin.out_features) for lin in gpt2.layer_linears] == [
        ("c_attn", 768, 2304), ("c_proj", 768, 768), ("c_fc", 768, 3072), ("c_proj", 3072, 768)
    ]  # fmt: skip
    assert gpt2.params_embedding == (50257 + 1024) * 768
    bert = spec_from_config(BERT_BASE_UNCASED)
    assert not bert.is_decoder and bert.architecture == "BertModel" and "BertForMaskedLM" in bert.notes[0]
    assert spec_from_config(GEMMA_7B).tied_embeddings  # Gemma's default when the key is absent


def test_presets_hold_their_counts() -> None:
    presets = list_presets()
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-72b", "mixtral-8x7b", "deepseek-v2-lite"} <= {
        p.name for p in presets
    }
    for p in presets:
        assert spec_from_config(p.config).params_total == p.params_total, p.name


def test_falcon_configs_from_before_transformers() -> None:
    """Falcon's first config.json files used model_type RefinedWeb(Model) and n_head/n_layer/n_head_kv."""
    old_7b = {"model_type": "RefinedWebModel", "hidden_size": 4544, "n_head": 71, "n_layer": 32, "multi_query": True,
              "parallel_attn": True, "bias": False, "vocab_size": 65024}  # fmt: skip
    assert spec_from_config(old_7b).params_total == 6_921_720_704
    old_40b = {"model_type": "RefinedWeb", "hidden_size": 8192, "n_head": 128, "n_head_kv": 8, "n_layer": 60,
               "parallel_attn": True, "bias": False, "vocab_size": 65024}  # fmt: skip
    new_40b = {"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8,
               "num_hidden_layers": 60, "new_decoder_architecture": True, "parallel_attn": True, "bias": False,
               "vocab_size": 65024}  # fmt: skip
    assert (
        spec_from_config(old_40b).params_total == spec_from_config(new_40b).params_total == 41_303_293_952
    )  # as FalconForCausalLM builds it
    assert spec_from_config(old_40b).num_kv_heads == 8


def test_config_errors_are_user_errors() -> None:
    with pytest.raises(UserError, match="lacks 'hidden_size'"):
        spec_from_config({"model_type": "llama", "num_attention_heads": 4})
    with pytest.raises(UserError, match="'num_hidden_layers' is 'two'"):
        spec_from_config({**LLAMA_2_7B, "num_hidden_layers": "two"})
    with pytest.raises(UserError, match="no parameter formula"):
        spec_from_config({"model_type": "mamba"})


# --- The same formulas against transformers, on the meta device ----------------------------------------------------

_TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
}  # fmt: skip
_TINY_DEEPSEEK = {
    "model_type": "deepseek_v2", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 3, "vocab_size": 128,
    "n_routed_experts": 6, "n_shared_experts": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12,
    "n_group": 1, "topk_group": 1, "topk_method": "greedy",
}  # fmt: skip
TINY: dict[str, dict[str, Any]] = {
    "llama": _TINY_LLAMA,
    "llama-biases-head_dim": {**_TINY_LLAMA, "attention_bias": True, "mlp_bias": True, "head_dim": 24},
    "llama-tied": {**_TINY_LLAMA, "tie_word_embeddings": True},
    "mistral-head_dim": {**_TINY_LLAMA, "model_type": "mistral", "head_dim": 32},
    "qwen2": {**_TINY_LLAMA, "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {**_TINY_LLAMA, "model_type": "qwen3", "head_dim": 32},
    "qwen3-default-head_dim": {**_TINY_LLAMA, "model_type": "qwen3"},
    "gemma-mqa": {**_TINY_LLAMA, "model_type": "gemma", "num_key_value_heads": 1, "head_dim": 48},
    "gemma2": {**_TINY_LLAMA, "model_type": "gemma2", "head_dim": 16},
    "phi": {**_TINY_LLAMA, "model_type": "phi", "num_key_value_heads": 4, "partial_rotary_factor": 0.5},
    "phi-qk_layernorm": {**_TINY_LLAMA, "model_type": "phi", "qk_layernorm": True},
    "phi3": {**_TINY_LLAMA, "model_type": "phi3", "pad_token_id": 0},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 32, "vocab_size": 100},
    "gpt2-n_inner": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 32,
                     "vocab_size": 100, "n_inner": 80},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
                 "num_hidden_layers": 2, "vocab_size": 100, "rotary_pct": 0.25},
    "gpt_neox-no-attention-bias": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 160,
                                   "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
                                   "attention_bias": False},
    "falcon-7b-style": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                        "vocab_size": 100, "multi_query": True, "parallel_attn": True, "bias": False},
    "falcon-40b-style": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 2,
                         "num_hidden_layers": 2, "vocab_size": 100, "new_decoder_architecture": True},
    "falcon-11b-style": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 2,
                         "num_hidden_layers": 2, "vocab_size": 100, "new_decoder_architecture": True,
                         "num_ln_in_parallel_attn": 1, "ffn_hidden_size": 96},
    "falcon-sequential-mha-bias": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4,
                                   "num_hidden_layers": 2, "vocab_size": 100, "multi_query": False,
                                   "parallel_attn": False, "bias": True, "tie_word_embeddings": False},
    "bert": {"model_type": "bert", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 40, "type_vocab_size": 3},
    "roberta": {"model_type": "roberta", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 42, "type_vocab_size": 1},
    "distilbert": {"model_type": "distilbert", "dim": 64, "hidden_dim": 96, "n_heads": 4, "n_layers": 2,
                   "vocab_size": 100, "max_position_embeddings": 40},
    "mixtral": {**_TINY_LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**_TINY_LLAMA, "model_type": "qwen2_moe", "num_hidden_layers": 4, "num_experts": 6,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                  "decoder_sparse_step": 1, "mlp_only_layers": [0]},
    "qwen2_moe-sparse-step": {**_TINY_LLAMA, "model_type": "qwen2_moe", "num_hidden_layers": 4, "num_experts": 6,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2},
    "qwen3_moe": {**_TINY_LLAMA, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 6,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "deepseek_v2": _TINY_DEEPSEEK,
    "deepseek_v2-q_lora": {**_TINY_DEEPSEEK, "q_lora_rank": 24},
    "deepseek_v3": {**_TINY_DEEPSEEK, "model_type": "deepseek_v3", "q_lora_rank": 24, "n_shared_experts": 1},
}  # fmt: skip


def _meta_model(config: dict[str, Any]) -> Any:
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    cfg = AutoConfig.for_model(config["model_type"], **kwargs)
    encoder = config["model_type"] in ("bert", "roberta", "distilbert")
    with torch.device("meta"):
        return (AutoModel if encoder else AutoModelForCausalLM).from_config(cfg)


def _meta_counts(model: Any, experts_per_token: int, num_experts: int) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())  # tied weights once
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - (routed * (num_experts - experts_per_token) // num_experts if num_experts else 0)


@pytest.mark.parametrize("name", [*PUBLISHED, *TINY])
def test_formula_matches_the_model_transformers_builds(name: str) -> None:
    if name == "deepseek-moe-16b":
        pytest.skip("model_type 'deepseek' is remote code only (count checked against the published one above)")
    config = PUBLISHED[name][0] if name in PUBLISHED else TINY[name]
    spec = spec_from_config(config)
    model = _meta_model(config)
    assert (spec.params_total, spec.params_active) == _meta_counts(model, spec.experts_per_token, spec.num_experts)
    assert model.get_input_embeddings().weight.numel() <= spec.params_embedding
    assert spec.num_layers == model.config.num_hidden_layers


@pytest.mark.parametrize("name", list(TINY))
def test_layer_linears_are_the_modules_of_a_block(name: str) -> None:
    """Names and shapes as peft targets them; routed experts (fused 3-D weights in transformers 5) by size."""
    torch = pytest.importorskip("torch")
    config = TINY[name]
    spec = spec_from_config(config)
    model = _meta_model(config)
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    block = next(
        b for b in blocks if not spec.num_experts or any(".experts." in f".{n}." for n, _ in b.named_modules())
    )
    built = Counter()
    for module_name, module in block.named_modules():
        kind = type(module).__name__
        if kind in ("Linear", "Conv1D", "FalconLinear") and ".experts." not in f".{module_name}.":
            w = module.weight
            fin, fout = (w.shape[0], w.shape[1]) if kind == "Conv1D" else (w.shape[1], w.shape[0])
            built[(module_name.rsplit(".", 1)[-1], fin, fout, module.bias is not None)] += 1
    routers = {"gate"}  # an nn.Linear in the checkpoints' code, a bare weight in transformers 5
    listed = Counter(
        (lin.name, lin.in_features, lin.out_features, lin.bias)
        for lin in spec.layer_linears
        if not lin.expert and lin.name not in routers
    )
    assert listed == Counter({k: v for k, v in built.items() if k[0] not in routers})
    expert_params = sum(p.numel() for n, p in block.named_parameters() if ".experts." in f".{n}")
    listed_expert = sum(lin.in_features * lin.out_features for lin in spec.layer_linears if lin.expert)
    assert listed_expert * spec.num_experts == expert_params


def test_every_formula_family_is_checked() -> None:
    checked = {c["model_type"] for c in [*TINY.values(), *(c for c, _ in PUBLISHED.values())]}
    legacy_falcon = {"RefinedWeb", "RefinedWebModel"}  # test_falcon_configs_from_before_transformers
    assert set(SUPPORTED_MODEL_TYPES) - checked - legacy_falcon == {"xlm-roberta", "camembert"}  # RoBERTa's layout
