"""A tied embedding and LM head that pipeline parallelism puts on two stages, kept one matrix.

Gemma, Qwen2-0.5B and Llama-3.2-1B use one matrix as token embedding and output
head. A pipeline puts the embedding on its first stage and the head on its last,
so each holds a copy (pipeline.DecoderStage). They stay one matrix the way
Megatron-LM and torchtitan-style pipelines keep them: both copies start equal
(the first stage's is sent to the last), after a step's backward passes each
copy's gradient is replaced by the sum of both (the gradient of the one tied
weight), and the two optimizers, fed the same gradients from the same state,
make the same update bit for bit. The gradient norm counts the pair once.

A copy is held whole or sharded by FSDP over the same data-parallel mesh on
both stages (tensor parallelism keeps a tied head whole, see
parallelize.apply_tensor_parallel), so each rank's local part of one copy
matches its partner's part of the other, element for element.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rigpilot.engine.workers.pipeline import DecoderStage


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly FSDP-sharded) tensor this rank stores; in-place changes reach the tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _stored_in(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors `t` is stored in: itself, or a tensor subclass's inner tensors (torchao's 8-bit moments:
    their codes and block scales), which a collective sends where it cannot send the subclass."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return [t]
    names, _ = flatten()
    return [part for name in names for part in _stored_in(getattr(t, name))]


class TiedAcrossStages:
    """The pair (first stage's embedding, last stage's head) of one model replica, and the group joining them.

    Every rank of the job constructs it (creating the pair groups is collective);
    only the ranks of the first and last stage hold a copy, and only they act.
    """

    def __init__(self, stage: DecoderStage, mesh: DeviceMesh) -> None:
        ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, tp): rank ids in mesh order
        firsts, lasts = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
        me = dist.get_rank()
        self.group: Any = None
        self.source = -1  # the global rank whose copy the pair starts from (the first stage's)
        for first, last in zip(firsts, lasts, strict=True):
            group = dist.new_group([first, last])  # collective: every rank creates every pair's group
            if me in (first, last):
                self.group, self.source = group, first
        self.stage = stage
        self.is_head = stage.is_last and not stage.is_first

    @property
    def weight(self) -> nn.Parameter | None:
        """This rank's copy, looked up each time: tensor parallelism and FSDP replace the parameter objects."""
        parts = self.stage.parts
        if self.stage.is_first:
            return parts.inner.embed_tokens.weight
        if self.stage.is_last:
            return parts.causal_lm.lm_head.weight
        return None

    @torch.no_grad()
    def align_weights(self) -> None:
        """Make the head's copy equal to the embedding's (at start, and after a resume).

        Frozen copies (LoRA's base) are equal from the load on and never change: nothing is sent.
        """
        weight = self.weight
        if weight is not None and weight.requires_grad:
            self._broadcast(_local(weight))

    @torch.no_grad()
    def align_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the head's copy the embedding's optimizer state (after a resume).

        A checkpoint written before the pair was kept tied holds two sets of moments, and one of an
        unsplit model holds the embedding's only (the head's were left to this): from here on both
        copies must take the same update.
        """
        weight = self.weight
        if weight is None or not weight.requires_grad:
            return
        state = optimizer.state[weight]
        for key in sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)):  # AdamW's, alike on both
            for part in _stored_in(_local(state[key])):
                self._broadcast(part)

    def _broadcast(self, t: torch.Tensor) -> None:
        if t.device.type == "cpu" and dist.get_backend(self.group) == "nccl":
            # NCCL sends GPU tensors only, and AdamW keeps its step count on the CPU.
            sent = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.broadcast(sent, src=self.source, group=self.group)
            t.copy_(sent)
            return
        dist.broadcast(t, src=self.source, group=self.group)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Replace each copy's gradient with the pair's sum: the tied weight's gradient, on both stages."""
        weight = self.weight
        if weight is None or not weight.requires_grad:
            return
        if weight.grad is None:  # a copy that took no gradient this step still joins the sum
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(_local(weight.grad), group=self.group)

    def derived_keys(self, module: nn.Module) -> tuple[str, ...]:
        """The checkpoint keys of the head copy's optimizer state, which this class can fill in (see
        align_optimizer) when a checkpoint lacks them: an unsplit tied model saves them under the embedding."""
        weight = self.weight
        if not self.is_head or weight is None or not weight.requires_grad:
            return ()
        name = next((n for n, p in module.named_parameters() if p is weight), None)
        return (f"app.optimizer.state.{name}",) if name else ()

    def counted_elsewhere(self) -> list[nn.Parameter]:
        """The copy whose gradient the gradient norm must leave out: the first stage counts the pair."""
        weight = self.weight
        return [weight] if self.is_head and weight is not None else []


def tied_across_stages(stage: nn.Module, mesh: DeviceMesh) -> TiedAcrossStages | None:
    """The pair to keep tied, or None when `stage` is not part of a pipeline of a tied model."""
    return TiedAcrossStages(stage, mesh) if isinstance(stage, DecoderStage) and stage.tied_across_stages else None
