"""A served model split over ranks: rank 0 serves, and every other rank repeats its batch's steps.

Under TP every rank runs the whole forward on the same tokens (each holding its share of the heads, the MLP
and the KV cache); in a pipeline every stage runs its layers on the same rows (engine.workers.serve_pipeline
passes the hidden states on). Only rank 0 has the requests. So rank 0's batch (engine.workers.serve_batch.KVBatch) is a
`Leader`: each step it takes — rows kept, new rows prefilled, a decode, the tokens chosen — is broadcast to
the other ranks before it is taken, and each of them, a `follow` loop, takes the same step on its own
KVBatch. The messages are int64 tensors over the job's process group (no pickling): a header
(operation, two numbers) and the step's tensors. The tokens are chosen on rank 0 alone (sampling, seeds,
logit bias are the requests'), so the other ranks need no more than the chosen ids.

While nothing happens rank 0 says so every HEARTBEAT_S, so that a server idle for hours never runs into the
process group's timeout. Rank 0 ends the loop (STOP) when it stops serving; the other ranks ignore the
engine's SIGTERM and wait for that, so that no rank leaves a collective half done.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from rigpilot.engine.workers.serve_batch import KVBatch

KEEP, PREFILL, DECODE, LAST, IDLE, STOP = range(6)
HEARTBEAT_S = 30.0  # far inside the process group's timeout (engine.workers.parallel_dims, 30 minutes)


class Channel:
    """Rank 0's side and the others': one header and its tensors per step, broadcast from rank 0."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sent_at = time.monotonic()

    def send(self, op: int, a: int = 0, b: int = 0, *tensors: torch.Tensor) -> None:
        dist.broadcast(torch.tensor([op, a, b], dtype=torch.long, device=self.device), src=0)
        for t in tensors:
            dist.broadcast(t.to(self.device, torch.long).contiguous(), src=0)
        self.sent_at = time.monotonic()

    def receive(self) -> tuple[int, int, int]:
        header = torch.empty(3, dtype=torch.long, device=self.device)
        dist.broadcast(header, src=0)
        op, a, b = header.tolist()
        return op, a, b

    def tensor(self, *shape: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.long, device=self.device)
        dist.broadcast(t, src=0)
        return t

    def heartbeat(self) -> None:
        if time.monotonic() - self.sent_at >= HEARTBEAT_S:
            self.send(IDLE)


class Leader:
    """Rank 0's KVBatch: each step told to the other ranks, then taken (the Batcher's `kv`)."""

    def __init__(self, kv: KVBatch, channel: Channel) -> None:
        self.kv, self.channel = kv, channel

    @property
    def size(self) -> int:
        return self.kv.size

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv.kv_cache_bytes

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, **extra: Any) -> torch.Tensor | None:
        assert not extra, "adapters are served on one rank"
        self.channel.send(PREFILL, *ids.shape, ids, mask)
        return self.kv.prefill(ids, mask)

    def decode(self, **extra: Any) -> torch.Tensor | None:
        assert not extra, "adapters are served on one rank"
        self.channel.send(DECODE)
        return self.kv.decode()

    def set_last(self, start: int, tokens: torch.Tensor) -> None:
        self.channel.send(LAST, start, len(tokens), tokens)
        self.kv.set_last(start, tokens)

    def keep(self, keep: list[int]) -> None:
        self.channel.send(KEEP, len(keep), 0, *([torch.tensor(keep, dtype=torch.long)] if keep else []))
        self.kv.keep(keep)

    def stop(self) -> None:
        self.channel.send(STOP)


@torch.no_grad()
def follow(kv: KVBatch, channel: Channel) -> None:
    """A rank other than 0: take rank 0's steps on this rank's share of the model, until it stops."""
    while True:
        op, a, b = channel.receive()
        if op == STOP:
            return
        if op == KEEP:
            kv.keep(channel.tensor(a).tolist() if a else [])
        elif op == PREFILL:
            ids, mask = channel.tensor(a, b), channel.tensor(a, b)
            kv.prefill(ids, mask)
        elif op == DECODE:
            kv.decode()
        elif op == LAST:
            kv.set_last(a, channel.tensor(b))
        elif op != IDLE:
            raise RuntimeError(f"serving: rank 0 sent an unknown step {op}")
