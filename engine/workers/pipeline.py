"""Pipeline stages of Llama-style decoders, built by hand (the torchtitan way).

A stage keeps the layers [first, last) of the decoder, plus the embedding on
the first stage and the final norm and LM head on the last. It is built by
pruning the loaded model in place and adopting the model's own children, so
every parameter keeps its original name ("model.layers.7.mlp.up_proj.weight",
or peft's "base_model.model.model.layers.7...."): checkpoints written by
different stages merge into the names of the whole model, and the final save
is an ordinary Hugging Face folder.

The forward pass calls the transformers decoder layers themselves with the
causal mask and rotary embeddings transformers would build, so a split model
computes exactly what the whole one does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rigpilot.engine.capability import PIPELINE_TYPES
from rigpilot.engine.errors import UserError

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class DecoderParts:
    root: nn.Module  # the module whose parameter names are the model's names (a PeftModel or the HF model)
    # transformers' modules, whose children are reached by name (nn.Module types those as Tensor | Module).
    causal_lm: Any  # the *ForCausalLM
    inner: Any  # its decoder: embed_tokens, layers, norm, rotary_emb
    config: Any

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)


def decoder_parts(root: nn.Module, what: str, types: tuple[str, ...] = PIPELINE_TYPES) -> DecoderParts:
    """The pieces of a Llama-style decoder, or a UserError saying `what` (e.g. "pipeline parallel") cannot run it.

    `types`: the model types `what` runs (engine.capability's tables).
    """
    parts = getattr(root, "parts", None)
    if isinstance(parts, DecoderParts):  # already a pipeline stage
        return parts
    get_base = getattr(root, "get_base_model", None)
    causal_lm = get_base() if callable(get_base) else root
    config = getattr(causal_lm, "config", None)
    model_type = getattr(config, "model_type", type(causal_lm).__name__)
    inner: Any = getattr(causal_lm, "model", None)
    ok = (
        model_type in types
        and inner is not None
        and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
        and hasattr(causal_lm, "lm_head")
        and isinstance(inner.layers, nn.ModuleList | nn.ModuleDict)
    )
    if ok:
        layer = next(iter(inner.layers.values() if isinstance(inner.layers, nn.ModuleDict) else inner.layers))
        params = inspect.signature(type(layer).forward).parameters
        ok = "position_embeddings" in params
    if not ok:
        raise UserError(
            f"{what} supports Llama-style decoders ({', '.join(types)}); "
            f"model type {model_type!r} is not one of them"
        )
    return DecoderParts(root, causal_lm, inner, config)


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [first, last) layer ranges, as even as possible (earlier stages take the remainder)."""
    if num_layers < num_stages:
        raise UserError(
            f"pipeline of {num_stages} stages needs at least {num_stages} layers; the model has {num_layers}"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


class DecoderStage(nn.Module):
    """One pipeline stage: input ids or hidden states in; hidden states, or logits on the last stage, out."""

    parts: DecoderParts
    # The training loss applies the head a chunk of tokens at a time (engine.workers.chunked_loss): the last
    # stage then returns the final norm's output, the hidden states the head would take.
    head_in_loss: bool = False

    def __init__(self, parts: DecoderParts, stage_index: int, num_stages: int) -> None:
        super().__init__()
        self.first_layer, self.last_layer = stage_layer_ranges(parts.num_layers, num_stages)[stage_index]
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        inner, lm = parts.inner, parts.causal_lm
        layers = list(inner.layers.values()) if isinstance(inner.layers, nn.ModuleDict) else list(inner.layers)
        # A ModuleDict keyed by the global index keeps "model.layers.<i>" names for the kept layers.
        inner.layers = nn.ModuleDict({str(i): layers[i] for i in range(self.first_layer, self.last_layer)})
        # The embedding lives on the first stage, the head on the last: each holds a copy of a tied
        # matrix, which training keeps one matrix (engine/workers/tied.py).
        self.tied_across_stages = bool(getattr(parts.config, "tie_word_embeddings", False)) and num_stages > 1
        if self.tied_across_stages and self.is_last:
            # Frozen stays frozen: under LoRA the head is part of the base model, not trained.
            head = lm.lm_head.weight
            lm.lm_head.weight = nn.Parameter(head.detach().clone(), requires_grad=head.requires_grad)
        if not self.is_first:
            inner.embed_tokens = None
        if not self.is_last:
            inner.norm = None
            lm.lm_head = None
        for name, child in parts.root.named_children():
            self.add_module(name, child)
        # Kept out of _modules so they are not registered twice under other names.
        self.__dict__["parts"] = parts

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        logits_to_keep: int = 0,
        head: bool = True,
    ) -> torch.Tensor:
        """`logits_to_keep` (last stage): the head on the last n positions only, as transformers' argument; 0: all.

        `head=False`: the last stage stops after its layers (a prefill chunk that only fills the cache).
        """
        inner, config = self.parts.inner, self.parts.config
        hidden = inner.embed_tokens(x) if self.is_first else x
        if position_ids is None:  # training on packed blocks: positions 0..S-1, no padding
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        masks = self._masks(hidden, attention_mask, position_ids, past_key_values)
        position_embeddings = inner.rotary_emb(hidden, position_ids)
        layer_types = getattr(config, "layer_types", None)
        for key, layer in inner.layers.items():
            kind = layer_types[int(key)] if layer_types else "full_attention"
            hidden = layer(
                hidden,
                attention_mask=masks.get(kind, masks["full_attention"]),
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=past_key_values is not None,
                position_embeddings=position_embeddings,
            )
        if not self.is_last or not head:
            return hidden
        if logits_to_keep:  # the norm is per position: normalising the kept ones alone gives the same values
            hidden = hidden[:, -logits_to_keep:, :]
        if self.head_in_loss:
            return inner.norm(hidden)
        logits = self.parts.causal_lm.lm_head(inner.norm(hidden))
        cap = getattr(config, "final_logit_softcapping", None)
        if cap:  # Gemma 2 bounds its logits in the causal-LM wrapper, outside the decoder
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _masks(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor, cache: Any
    ) -> dict:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = self.parts.config
        # The cache holds only this stage's layers: size the mask against the first of them.
        kwargs = {"layer_idx": self.first_layer} if cache is not None else {}
        full_fn = create_causal_mask
        if config.model_type in ("mistral", "mixtral", "qwen3_moe") and getattr(config, "sliding_window", None):
            full_fn = create_sliding_window_causal_mask
        layer_types = getattr(config, "layer_types", None) or []
        sliding = "sliding_attention" in layer_types[self.first_layer : self.last_layer]
        if (
            full_fn is create_causal_mask
            and not sliding
            and _decode_step(config, hidden, attention_mask, cache, self.first_layer)
        ):
            # What create_causal_mask gives sdpa for one new position against the whole cache, in a
            # fraction of its time (it costs a decode step 4% of a 4-layer stage of hidden 512): the
            # padding mask, or none at all where nothing is padded (sdpa's own causal-free path).
            assert attention_mask is not None
            full = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
            return {"full_attention": full}
        masks = {"full_attention": full_fn(config, hidden, attention_mask, cache, position_ids, **kwargs)}
        if sliding:
            masks["sliding_attention"] = create_sliding_window_causal_mask(
                config, hidden, attention_mask, cache, position_ids, **kwargs
            )
        return masks


def _decode_step(
    config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None, cache: Any, layer: int
) -> bool:
    """Whether this forward is one new position per row, under sdpa, after all of a 2-D mask's other positions."""
    return (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and hidden.shape[1] == 1
        and cache is not None
        and attention_mask is not None
        and attention_mask.dim() == 2
        and attention_mask.shape[1] == cache.get_seq_length(layer) + 1
    )
