"""The optimizer state in host memory (`--optimizer-offload`): one GPU holds the weights only.

torchtune fits Llama-3.1-8B full fine-tuning on one 24 GB card with bitsandbytes' paged AdamW, whose state lives
in CUDA unified memory that pages out to the host. This is the same memory effect done explicitly, on torchao's
design (torchao.optim.CPUOffloadOptimizer), but runnable on CPU ranks as well as on CUDA, with gradient
accumulation and clipping:

- each trainable parameter of at least MIN_OFFLOAD_NUMEL elements gets a host copy in its own dtype (the master
  weights), a host gradient buffer and a host AdamW (fused on the CPU), all pinned on CUDA; smaller ones (norms,
  biases) stay with an AdamW on the device, where a copy would cost more than it saves;
- a post-accumulate-grad hook copies each gradient to the host as soon as backward has made it (on a side
  stream on CUDA, so the copies overlap the rest of backward) and frees the device gradient at once; a later
  micro-batch of the same step goes through one of STAGING_BUFFERS pinned buffers and is added on the host when
  the buffer is needed again or the step begins (in arrival order, so the sum is the one autograd would make), so
  accumulation works without a second host gradient;
- the step waits for the copies, clips with the global norm of the host gradients (and the small ones'), steps
  on the CPU and copies the updated parameters back (non-blocking on CUDA, ordered before the next forward).

It is a torch.optim.Optimizer over the device parameters, so the LR scheduler drives its param_groups and DCP
checkpoints its state under the model's parameter names, as it would a plain AdamW's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from rigpilot.engine.jobspec.spec import JobSpec

# torchao's CPUOffloadOptimizer keeps tensors below this many elements on the device: a norm's few thousand
# values cost more in copies and hook calls than they save.
MIN_OFFLOAD_NUMEL = 4096
# Pinned buffers a later micro-batch's gradients pass through on their way to be added on the host, each the size
# of the largest offloaded tensor: a bounded staging area (not a second host gradient), reused in turn.
STAGING_BUFFERS = 2
_HYPER = ("lr", "betas", "eps", "weight_decay")


class HostOffloadedOptimizer(torch.optim.Optimizer):
    """AdamW whose state, master weights and gradients live in host memory; see the module's docstring."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        device: torch.device,
        min_offload_numel: int = MIN_OFFLOAD_NUMEL,
        rounding: bool = True,
    ) -> None:
        super().__init__(list(params), {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.host: dict[nn.Parameter, torch.Tensor] = {}  # device parameter -> its host master copy
        self._grads: dict[nn.Parameter, torch.Tensor] = {}  # device parameter -> its host gradient buffer
        self._copies: dict[nn.Parameter, Any] = {}  # the CUDA event of each parameter's first copy to the host
        # Staging, by dtype: the pinned buffers and, for each, the gradient it holds until added (param, view, event).
        self._staging: dict[torch.dtype, list[torch.Tensor]] = {}
        self._pending: dict[torch.dtype, list[tuple[nn.Parameter, torch.Tensor, Any] | None]] = {}
        self._turn: dict[torch.dtype, int] = {}
        self._filled: set[nn.Parameter] = set()  # parameters with a gradient since zero_grad
        self._gathered = False
        host_groups: list[dict[str, Any]] = []
        device_groups: list[dict[str, Any]] = []
        self._group_pairs: list[tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]] = []
        for group in self.param_groups:
            hyper = {k: group[k] for k in _HYPER}
            big = [p for p in group["params"] if p.requires_grad and p.numel() >= min_offload_numel]
            small = [p for p in group["params"] if p.requires_grad and p.numel() < min_offload_numel]
            for p in big:
                self.host[p] = self._pinned(p).copy_(p.detach())
                self._grads[p] = self._pinned(p)
                p.register_post_accumulate_grad_hook(self._grad_ready)
            hg = {"params": [self.host[p] for p in big], **hyper} if big else None
            dg = {"params": small, **hyper} if small else None
            host_groups += [hg] if hg else []
            device_groups += [dg] if dg else []
            self._group_pairs.append((group, hg, dg))
        # rounding=False: the memory tracer's fake tensors, which torchao's compiled step cannot run on (the state
        # it holds is the same either way).
        self.host_optimizer = _host_adamw(host_groups, rounding) if host_groups else None
        # The small parameters' step as the plain recipe takes it (engine.workers.train.use_foreach).
        self.device_optimizer = _device_adamw(device_groups, rounding) if device_groups else None
        if self.host_optimizer is not None:  # the optimizers copy the groups they are given
            it = iter(self.host_optimizer.param_groups)
            self._group_pairs = [(g, next(it) if hg else None, dg) for g, hg, dg in self._group_pairs]
        if self.device_optimizer is not None:
            it = iter(self.device_optimizer.param_groups)
            self._group_pairs = [(g, hg, next(it) if dg else None) for g, hg, dg in self._group_pairs]

    def host_tensors(self) -> list[torch.Tensor]:
        """The master copies and gradient buffers in host memory (the memory tracer counts them off the GPU)."""
        return [*self.host.values(), *self._grads.values()]

    def _pinned(self, p: torch.Tensor) -> torch.Tensor:
        # Pinning needs a CUDA context; on CPU ranks host memory is all there is.
        return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self.cuda)

    # -- gradients ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _grad_ready(self, p: torch.Tensor) -> None:
        """Send `p`'s gradient to the host as backward accumulates it, and free it on the device."""
        assert isinstance(p, nn.Parameter)
        g = p.grad
        if g is None:
            return
        first = p not in self._filled
        if self.cuda:
            assert self.stream is not None
            target, slot = (self._grads[p], -1) if first else self._free_slot(p)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # backward has written it
            with torch.cuda.stream(self.stream):
                target.copy_(g, non_blocking=True)
                event = self.stream.record_event()
            g.record_stream(self.stream)  # the allocator waits for the copy before reusing the memory
            if first:
                self._copies[p] = event
            else:
                self._pending[p.dtype][slot] = (p, target, event)
        elif first:
            self._grads[p].copy_(g)
        else:
            self._grads[p].add_(g)
        self._filled.add(p)
        self._gathered = False
        p.grad = None

    def _free_slot(self, p: nn.Parameter) -> tuple[torch.Tensor, int]:
        """The next staging buffer of `p`'s dtype, shaped as `p`, once the gradient it held is added."""
        buffers = self._staging.get(p.dtype)
        if buffers is None:
            largest = max(q.numel() for q in self.host if q.dtype == p.dtype)
            buffers = self._staging[p.dtype] = [
                torch.empty(largest, dtype=p.dtype, device="cpu", pin_memory=True) for _ in range(STAGING_BUFFERS)
            ]
            self._pending[p.dtype] = [None] * STAGING_BUFFERS
            self._turn[p.dtype] = 0
        slot = self._turn[p.dtype]
        self._turn[p.dtype] = (slot + 1) % len(buffers)
        self._add_staged(p.dtype, slot)
        return buffers[slot][: p.numel()].view(p.shape), slot

    def _add_staged(self, dtype: torch.dtype, slot: int) -> None:
        held = self._pending[dtype][slot]
        if held is not None:
            q, view, event = held
            event.synchronize()  # after the first copy of q too: one stream, in order
            self._grads[q].add_(view)
            self._pending[dtype][slot] = None

    def _gather(self) -> None:
        """Every offloaded gradient on the host, whole: after backward, before clipping or the step."""
        if self._gathered:
            return
        for p in self.host:
            if p.grad is not None:  # given without backward (DCP initialises the state with zero gradients)
                self._grad_ready(p)
        for event in self._copies.values():
            event.synchronize()
        self._copies.clear()
        for dtype, pending in self._pending.items():  # oldest first: each parameter's micro-batches in order
            for i in range(len(pending)):
                self._add_staged(dtype, (self._turn[dtype] + i) % len(pending))
        self._gathered = True

    def _grad_list(self) -> list[torch.Tensor]:
        """Every gradient of the step in the parameters' order: host buffers for offloaded ones, device ones else."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.host:
                    if p in self._filled:
                        out.append(self._grads[p])
                elif p.grad is not None:
                    out.append(p.grad)
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the step's gradients, taken from the host copies, and the gradients clipped to
        `max_norm` when it is > 0 (a non-finite norm is reported, not applied), as train.clip_grad_norm does."""
        self._gather()
        grads = self._grad_list()
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if max_norm > 0:
            coef = torch.where(torch.isfinite(total), (max_norm / (total + 1e-6)).clamp(max=1.0), 1.0)
            by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
            for g in grads:
                by_device[g.device].append(g)
            for device, group in by_device.items():
                torch._foreach_mul_(group, coef.to(device))
        return total

    # -- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._gather()
        for group, hg, dg in self._group_pairs:  # the scheduler sets the LR on the groups it was given
            for target in (hg, dg):
                if target is not None:
                    _set_hyper(target, group)
        stepped = [p for p in self.host if p in self._filled]
        for p in stepped:
            self.host[p].grad = self._grads[p]
        if self.device_optimizer is not None:
            self.device_optimizer.step()  # queued on the device first, so it runs beside the CPU step
        if self.host_optimizer is not None:
            self.host_optimizer.step()
        for p in stepped:
            self.host[p].grad = None
            # Non-blocking on CUDA: on the compute stream, so the next forward reads the new weights; the host
            # copy is written again only after the next backward's gradient copies, which wait for this stream.
            p.data.copy_(self.host[p], non_blocking=self.cuda)
        self._filled.clear()
        self._sync_state()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self._filled.clear()
        self._gathered = False

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _sync_state(self) -> None:
        """`state` as a plain optimizer's: keyed by the device parameters, so state_dict() and DCP see one."""
        state: defaultdict[Any, Any] = defaultdict(dict)
        for p, hp in self.host.items():
            if self.host_optimizer is not None and hp in self.host_optimizer.state:
                state[p] = self.host_optimizer.state[hp]
        if self.device_optimizer is not None:
            for small, values in self.device_optimizer.state.items():
                state[small] = values
        self.state = state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A plain AdamW's state dict (ids or, from DCP, parameter names as keys) into the host and device
        optimizers, in each parameter's own dtype: the run resumes bit for bit."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("the loaded optimizer state has a different number of parameter groups")
        saved_state = state_dict["state"]
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("the loaded optimizer state's parameter group has a different size")
            group.update({k: v for k, v in saved.items() if k != "params"})
            for key, p in zip(saved["params"], group["params"], strict=True):
                if key not in saved_state:
                    continue
                values = saved_state[key]
                if p in self.host and self.host_optimizer is not None:
                    hp = self.host[p]
                    self.host_optimizer.state[hp] = {k: _placed(k, v, hp) for k, v in values.items()}
                elif self.device_optimizer is not None:
                    self.device_optimizer.state[p] = {k: _placed(k, v, p) for k, v in values.items()}
        for group, hg, dg in self._group_pairs:
            for target in (hg, dg):
                if target is not None:
                    _set_hyper(target, group)
        # The weights were loaded into the device parameters (DCP sets the model before its optimizer): the host
        # master copies take them, or the next step would update the weights the job started with.
        with torch.no_grad():
            for p, hp in self.host.items():
                hp.copy_(p.detach())
        self._sync_state()


def _placed(key: str, value: Any, param: torch.Tensor) -> Any:
    """A saved state value beside `param`, as torch.optim.Optimizer.load_state_dict places it: `step` stays a
    CPU float32 count except where the fused kernel reads it on the parameter's device, moments take the
    parameter's device and dtype."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.detach().to(device=param.device if param.device.type == "cpu" else "cpu", copy=True)
    return value.detach().to(device=param.device, dtype=param.dtype, copy=True)


def _set_hyper(target: dict[str, Any], group: dict[str, Any]) -> None:
    """The scheduler's hyper-parameters onto a host or device group; torchao's AdamW keeps its LR a tensor
    (a float there is refused), so it is filled in place."""
    for k in _HYPER:
        if isinstance(target.get(k), torch.Tensor) and not isinstance(group[k], torch.Tensor):
            target[k].fill_(group[k])
        else:
            target[k] = group[k]


def _rounded(groups: list[dict[str, Any]], rounding: bool) -> torch.optim.Optimizer | None:
    """Pure bf16's step, as the recipe takes it on the GPU: torchao's AdamW with stochastic rounding (its step is
    compiled, on the CPU too). Round-to-nearest would lose every update below half a bf16 step of the weight,
    most of a fine-tune's (measured: 8.5x less movement at lr 2e-5); the rank seeds the rounding (rounding_seed)."""
    if not rounding or not any(p.dtype == torch.bfloat16 for g in groups for p in g["params"]):
        return None
    from torchao.optim import _AdamW

    return _AdamW(groups, bf16_stochastic_round=True)


def _host_adamw(groups: list[dict[str, Any]], rounding: bool) -> torch.optim.Optimizer:
    """AdamW on the CPU: fused where torch has the CPU kernel for every dtype in `groups`, else for-each (pure
    bf16: torchao's, rounding stochastically)."""
    rounded = _rounded(groups, rounding)
    if rounded is not None:
        return rounded
    dtypes = {p.dtype for g in groups for p in g["params"]}
    fused = dtypes <= {torch.float32, torch.float64, torch.float16, torch.bfloat16}
    return torch.optim.AdamW(groups, fused=True) if fused else torch.optim.AdamW(groups, foreach=True)


def _device_adamw(groups: list[dict[str, Any]], rounding: bool) -> torch.optim.Optimizer:
    """The small tensors' AdamW on the device, as the plain recipe takes it (pure bf16: stochastic rounding)."""
    return _rounded(groups, rounding) or torch.optim.AdamW(groups, foreach=True)


def host_offloaded_optimizer(
    params: list[nn.Parameter], spec: JobSpec, device: torch.device, notes: list[str]
) -> HostOffloadedOptimizer:
    """The job's optimizer with its state in host memory (the rank has checked the recipe: engine.recipe_refusal)."""
    s = spec.train
    assert s is not None
    opt = HostOffloadedOptimizer(
        params, lr=s.learning_rate, weight_decay=s.weight_decay, betas=(0.9, 0.95), device=device
    )
    moved = sum(p.numel() for p in opt.host)
    total = sum(p.numel() for p in params) or 1
    host = opt.host_optimizer
    if host is not None and not isinstance(host, torch.optim.AdamW):
        kind = "torchao's CPU AdamW with bf16 stochastic rounding"
    else:
        kind = f"{'fused' if host is not None and host.defaults.get('fused') else 'for-each'} CPU AdamW"
    notes.append(
        f"optimizer state in host memory: {len(opt.host)} of {len(params)} trainable tensors ({moved / total:.1%} of "
        f"the trainable parameters) have their master copy, gradient and AdamW state on the host and step with "
        f"{kind}; the GPU keeps their weights only"
    )
    return opt
