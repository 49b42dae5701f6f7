"""Activation offloading: the tensors autograd saves for backward wait in host memory instead of on the device.

As torchtune's OffloadActivations (torchtune/training/_activation_offloading.py) does it, with PyTorch's
`saved_tensors_hooks`: around the model's forward every saved tensor of at least MIN_OFFLOAD_BYTES that is not
a parameter (nor a view of one: weights stay where they are) is copied to host memory, and copied back when
backward unpacks it. On CUDA the host buffers are pinned and the copies out run on a side stream that
overlaps the forward's compute (the device tensor is held until its copy is done); the copies back are
asynchronous on a side stream the compute stream waits for. On CPU ranks the same path runs (copies are
CPU to CPU), so what the hooks do to the numbers is what CI tests.

Beside activation checkpointing (engine.workers.parallelize): checkpointed blocks save only their inputs
through these hooks (non-reentrant checkpointing saves them with `save_for_backward`), and those are what
goes to the host; what the blocks recompute in backward never leaves the device. The output head and the
loss keep their tensors on the device (`keep_on_device`): backward needs them first, at once.

The `Store` decides where an offloaded tensor waits: host memory for training (`HostStore`), or (the
planner's memory trace, on fake tensors: `TracedStore`) nowhere at all, so the traced device peak counts exactly what stays behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

MIN_OFFLOAD_BYTES = 1024  # torchtune's min_offload_size: smaller tensors are not worth a copy
MAX_FORWARD_STASH = 5  # torchtune's max_fwd_stash_size: device tensors held while their copies run


@dataclass
class _Offloaded:
    """A saved tensor in host memory (or, traced, its shape only) and how to rebuild it on the device."""

    host: torch.Tensor | None
    device: torch.device
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    spec: Any = None  # a DTensor's spec: the local shard was offloaded


class Store(Protocol):
    """Where offloaded tensors wait: `put` in forward (what it returns is kept), `get` in backward."""

    def put(self, t: torch.Tensor) -> torch.Tensor | None: ...

    def get(self, item: _Offloaded) -> torch.Tensor: ...

    def finish(self) -> None: ...


class HostStore:
    """Copies saved tensors to host memory and back: pinned and on a side stream on CUDA, plain copies on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.stash: list[tuple[torch.Tensor, Any]] = []  # device tensors whose copies out are in flight

    def put(self, t: torch.Tensor) -> torch.Tensor | None:
        host = torch.empty_like(t, device="cpu", pin_memory=self.cuda)
        if self.stream is None:
            host.copy_(t)
            return host
        compute = torch.cuda.current_stream(self.device)
        self._release(MAX_FORWARD_STASH - 1)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = self.stream.record_event()
        self.stash.append((t, done))  # the caching allocator must not reuse t before the copy has read it
        return host

    def get(self, item: _Offloaded) -> torch.Tensor:
        assert item.host is not None
        if self.stream is None:
            return item.host
        compute = torch.cuda.current_stream(self.device)
        self._release(0)
        with torch.cuda.stream(self.stream):
            t = item.host.to(self.device, non_blocking=True)
        compute.wait_stream(self.stream)
        t.record_stream(compute)  # allocated on the side stream, used on the compute stream
        return t

    def finish(self) -> None:
        """At the end of a forward: the compute stream waits for the copies still in flight."""
        self._release(0)

    def _release(self, keep: int) -> None:
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        while len(self.stash) > keep:
            _, done = self.stash.pop(0)
            if compute is not None:
                compute.wait_event(done)


class TracedStore:
    """The planner's trace: an offloaded tensor keeps only its shape, so the device's count drops it as the
    real host copy would; backward gets an empty tensor of that shape (fake tensors have no values)."""

    def finish(self) -> None:
        pass

    def put(self, t: torch.Tensor) -> torch.Tensor | None:
        return None

    def get(self, item: _Offloaded) -> torch.Tensor:
        return torch.empty_strided(item.shape, item.stride, dtype=item.dtype, device=item.device)


class ActivationOffload:
    """The saved-tensor hooks of one job: `saving()` around the model's forward, `keep_on_device()` around
    what must not be offloaded (the head and the loss). Disabled, both are no-ops."""

    def __init__(self, enabled: bool, store: Store | None = None, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.enabled = enabled
        self.store: Store | None = store
        self.min_bytes = min_bytes
        self.offloaded = 0  # tensors and bytes sent to the host (a benchmark's and a test's figures)
        self.offloaded_bytes = 0

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        assert self.store is not None
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.store.finish()

    def keep_on_device(self) -> contextlib.AbstractContextManager[Any]:
        """Saved tensors made inside stay where they are (the innermost hooks are the ones that run)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return saved_tensors_hooks(_same, _same)

    def exclude(self, module: nn.Module) -> None:
        """Keep `module`'s saved tensors on the device whenever it runs (the output head inside the model)."""
        if not self.enabled:
            return
        active: list[Any] = []

        def enter(*_: Any) -> None:
            ctx = saved_tensors_hooks(_same, _same)
            ctx.__enter__()
            active.append(ctx)

        def leave(*_: Any) -> None:
            if active:
                active.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)

    def _pack(self, t: torch.Tensor) -> Any:
        if _is_weight(t) or t.numel() * t.element_size() < self.min_bytes:
            return t
        local, spec = (t._local_tensor, t._spec) if isinstance(t, DTensor) else (t, None)
        if _is_weight(local) or local.device.type == "meta":
            return t
        assert self.store is not None
        with torch.no_grad():
            host = self.store.put(local)
        self.offloaded += 1
        self.offloaded_bytes += local.numel() * local.element_size()
        return _Offloaded(host, local.device, local.shape, local.stride(), local.dtype, spec)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        assert self.store is not None
        local = self.store.get(packed)
        if packed.spec is None:
            return local
        spec = packed.spec
        return DTensor(local, spec, requires_grad=False)


def offload_activations(
    model: nn.Module, enabled: bool, device: torch.device, *, head_in_loss: bool = False
) -> ActivationOffload:
    """The job's offloading of `model`'s saved activations to host memory (a no-op unless `enabled`), with its
    output head's tensors kept on the device.

    `head_in_loss`: the chunked loss applies the head (chunked_loss.TokenLoss), outside the model's forward and
    checkpointed chunk by chunk. The head is then left alone: its hooks would sit inside the checkpoint's and keep
    every chunk's saved tensors (the head's bf16 copy among them) on the device until backward."""
    from rigpilot.engine.workers.chunked_loss import output_head

    offload = ActivationOffload(enabled, HostStore(device) if enabled else None)
    head = output_head(model) if enabled and not head_in_loss else None
    if head is not None:  # an encoder's head is found by no name: its tensors go too
        offload.exclude(head.linear)
    return offload


def _same(t: Any) -> Any:
    return t


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight transposed): it stays resident anyway."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)
