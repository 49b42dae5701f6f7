"""A served model split into pipeline stages: one forward of the running batch, on this rank's stage.

Every stage takes the same step at once (engine.workers.serve_lockstep tells it which); the first stage
(rank 0, which serves) embeds the tokens and runs its layers, each stage hands its hidden states to the
next, and the last applies the head and sends the next-token logits back to rank 0, which chooses the
tokens. Each stage keeps the KV cache of its own layers (engine.workers.pipeline.DecoderStage).

One step is in flight at a time, so the stages take turns: the model's memory is split over the GPUs
while its speed stays about one GPU's. (The batch jobs' generator, engine.workers.infer, overlaps
micro-batches across stages; a served batch whose rows come and go between steps does not split into
micro-batches that simply.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rigpilot.engine.workers.parallel_dims import Runtime


class StageForward:
    """KVBatch's `forward` on a pipeline stage: the logits on rank 0, None on the other stages."""

    def __init__(self, runtime: Runtime, config: Any, dtype: torch.dtype) -> None:
        ranks = runtime.mesh["pp"].mesh.flatten().tolist()
        stage = runtime.pp_rank
        self.prev = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage < len(ranks) - 1 else None
        self.first, self.last = ranks[0], ranks[-1]
        if self.first != 0:
            raise RuntimeError(f"serving: the first pipeline stage must be rank 0, not {self.first}")
        self.device, self.dtype = runtime.device, dtype
        self.width, self.vocab = int(config.hidden_size), int(config.vocab_size)

    def __call__(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any, **extra: Any) -> torch.Tensor | None:  # fmt: skip
        assert not extra, "adapters are served on one rank"
        rows, length = ids.shape
        x = ids
        if self.prev is not None:
            x = torch.empty(rows, length, self.width, dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.prev)
        if self.next is not None:
            hidden = model(x, attention_mask=mask, position_ids=positions, past_key_values=cache)
            dist.send(hidden.contiguous(), dst=self.next)
            if self.prev is not None:
                return None
            logits = torch.empty(rows, self.vocab, dtype=torch.float32, device=self.device)
            dist.recv(logits, src=self.last)
            return logits
        out = model(x, attention_mask=mask, position_ids=positions, past_key_values=cache, logits_to_keep=1)
        dist.send(out[:, -1, :].float().contiguous(), dst=self.first)
        return None
