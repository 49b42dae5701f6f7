"""The training loss of a batch: summed token cross-entropy, from the whole logits or a chunk of tokens at a time.

`loss_chunks` 1 (the plain recipe): the model's forward returns the whole logits and `token_loss` upcasts them
to fp32 at once. `loss_chunks` N (torchtune's chunked cross-entropy, the output head applied inside the loss
as its `LinearCrossEntropyLoss` does): the model's forward stops at the final hidden states (the head passes
its input through while it runs, `TokenLoss.model_output`), and the loss splits them along the sequence into
N chunks, each of which goes through the head (and Gemma 2's final soft-capping), is upcast to fp32 and
cross-entropied with sum reduction. Under tensor parallel each chunk's logits are vocabulary-sharded DTensors
and its cross-entropy runs under the caller's `loss_parallel()`, as the whole logits' does.

Each chunk is recomputed in backward (non-reentrant checkpointing of the head and its loss): autograd would
otherwise keep every chunk's fp32 log-probabilities for backward, which together are the whole fp32 logits
the chunking is there to avoid. So only one chunk's logits exist at a time, in forward and in backward, for
one more pass of the head's matmul per token (a few percent of a step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rigpilot.engine.capability import RecipeContext
from rigpilot.engine.layout import Layout
from rigpilot.engine.recipe import Recipe
from rigpilot.engine.recipe_refusal import check_recipe


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the labelled tokens (next tokens, or the masked ones for masked-LM).

    A sum, not a mean: the caller divides by the trained tokens of the whole global batch, which
    no single micro-batch knows. A batch with no labelled token (all prompt) adds 0.
    """
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")


@dataclass(frozen=True)
class OutputHead:
    """A decoder's output head: the linear layer, the module that calls it, and the soft-capping after it."""

    linear: nn.Module  # lm_head (peft's wrapper of it, or a tensor-parallel one: called as the model calls it)
    owner: nn.Module | None  # the *ForCausalLM whose forward calls `linear`; None: a pipeline stage's (its own flag)
    softcap: float | None  # Gemma 2's final_logit_softcapping: tanh(logits / cap) * cap


def output_head(model: nn.Module) -> OutputHead | None:
    """The output head of `model` (a transformers causal LM, a peft model of one, or a last pipeline stage); None
    for a model with no lm_head (a masked-LM encoder)."""
    parts = getattr(model, "parts", None)
    get_base = getattr(model, "get_base_model", None)
    owner: Any = parts.causal_lm if parts is not None else (get_base() if callable(get_base) else model)
    linear = getattr(owner, "lm_head", None)
    config = getattr(owner, "config", None)
    if not isinstance(linear, nn.Module):
        return None
    cap = getattr(config, "final_logit_softcapping", None)
    return OutputHead(linear, None if parts is not None else owner, float(cap) if cap else None)


class _PassThrough(nn.Module):
    """Stands in for the head while the model's forward runs: the final hidden states come out as its 'logits'."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class TokenLoss:
    """The summed token loss of a model's output, whole (`chunks` 1) or a chunk of tokens at a time.

    `compute`: the context the head's matmul runs in (the job's autocast), entered again for each chunk and
    for its recomputation in backward. Call the model under `model_output()`, then this on what its forward
    returned (`.logits`: the logits, or with chunks the final hidden states) and the labels.
    """

    def __init__(
        self, model: nn.Module, chunks: int, compute: Callable[[], AbstractContextManager[Any]] | None = None
    ) -> None:
        self.chunks = int(chunks)
        self.compute = compute or contextlib.nullcontext
        chunked = self.chunks > 1 and getattr(model, "is_last", True)  # a stage before the last computes no loss
        self.head = output_head(model) if chunked else None
        if chunked and self.head is None:
            # The loaded model has no head to chunk: the capability contract's refusal, the one the submission
            # gives where it could read the model's config.json.
            check_recipe(Recipe(loss_chunks=self.chunks), Layout(), RecipeContext(decoder=False))
        self._fsdp_root: Any = None
        if self.head is not None and self.head.owner is None:
            stage: Any = model
            stage.head_in_loss = True  # a last pipeline stage: its forward ends with the final norm

    def hold_head(self, wrapped: nn.Module) -> None:
        """Under FSDP2 (`wrapped` its root), keep the root's parameters, the head's among them, gathered from
        the forward to the loss's backward: the head runs after the forward, and again in backward before the
        root's backward hooks would gather it. (FSDP2 keeps a root gathered so by default; the engine asks
        for resharding explicitly.) After a pass without backward, `release` reshards them."""
        from torch.distributed.fsdp import FSDPModule

        self._fsdp_root = wrapped if self.head is not None and isinstance(wrapped, FSDPModule) else None
        if self._fsdp_root is not None:
            self._fsdp_root.set_reshard_after_forward(False, recurse=False)

    def release(self) -> None:
        """After an evaluation (forwards without backward): the root's gathered parameters go back to shards."""
        if self._fsdp_root is not None:
            self._fsdp_root.reshard()

    @contextlib.contextmanager
    def model_output(self) -> Iterator[None]:
        """Around the model's forward: with chunks, the head passes the final hidden states through."""
        head = self.head
        if head is None or head.owner is None:
            yield
            return
        owner: Any = head.owner
        config: Any = getattr(owner, "config", None)
        owner.lm_head = _PassThrough()
        if head.softcap is not None:
            config.final_logit_softcapping = None  # the model would cap the hidden states; the loss caps the logits
        try:
            yield
        finally:
            owner.lm_head = head.linear
            if head.softcap is not None:
                config.final_logit_softcapping = head.softcap

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return token_loss(output, labels)
        # Along the sequence, as torchtune splits; never an empty chunk.
        n = max(1, min(self.chunks, labels.shape[-1]))
        hidden, targets = output.tensor_split(n, dim=1), labels.tensor_split(n, dim=1)
        total: torch.Tensor | None = None
        for h, y in zip(hidden, targets, strict=True):
            if torch.is_grad_enabled() and h.requires_grad:
                part = checkpoint(self._chunk_loss, h, y, use_reentrant=False, preserve_rng_state=False)
            else:
                part = self._chunk_loss(h, y)
            total = part if total is None else total + part
        assert total is not None
        return total

    def _chunk_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss(self.logits(hidden), labels)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits of `hidden` (soft-capped where the model caps them), in the compute dtype."""
        assert self.head is not None
        with self.compute():
            logits = self.head.linear(hidden)
            cap = self.head.softcap
            if cap is not None:  # as the model's forward does it, in the same dtype
                logits = torch.tanh(logits / cap) * cap
        return logits
