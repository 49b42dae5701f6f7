"""The optimizer a training job steps with (the recipe's `optimizer`, `master_weights`, `optimizer_in_backward`).

- AdamW: torch.optim.AdamW, fused on CUDA where the parameters allow it, multi-tensor (foreach) otherwise.
- 8-bit AdamW: torchao.optim.AdamW8bit: both moments block-quantized to 8 bits (tensors of 4096+ values whose
  size is a multiple of the block; smaller ones keep plain moments, as bitsandbytes does). torchao compiles its
  per-parameter step with torch.compile: the first step of each parameter shape compiles for a few seconds.
- Pure bf16 (bf16 master weights): torchao's AdamW (or AdamW8bit) with bf16 stochastic rounding. The update is
  computed in fp32 from the bf16 weight, moments and gradient, then rounded to bf16 up or down with the
  probability of its distance: in expectation the weight moves by the whole update, so the small updates late
  in training that round-to-nearest drops (an update under half a bf16 ulp of the weight is lost every step)
  still add up. We chose it over Kahan summation: Kahan keeps a bf16 compensation buffer per weight (2 more
  bytes a parameter, a third more than pure bf16's weights and moments take) to get the same effect, and no
  maintained optimizer we can take ships it for DTensors, while torchao's is maintained, runs under FSDP2 and
  is what torchao's and torchtune's low-precision recipes use.
- The optimizer step in backward: one optimizer per parameter, stepped in that parameter's post-accumulate-grad
  hook (torch's "How to save memory by fusing the optimizer step into the backward pass", torchtune's
  `_register_optim_in_bwd_hooks`), so a gradient is freed as soon as its weight is updated. Under FSDP2 the hook
  fires on the sharded DTensor parameter after its reduce-scatter (FSDP2 calls the sharded parameter's
  post-accumulate-grad hooks itself). DDP's all-reduce buckets keep a copy of every gradient whatever steps them,
  so stepping inside backward would save nothing there: the engine refuses it under DDP (engine.capability).

Stochastic rounding draws random bits (torchao's `_fp32_to_bf16_sr` calls torch.randint on the default
generator; compiled, it draws one kernel seed per parameter from it, whatever the tensor's size). Replicas of a
weight (DDP, the replicated dims of HSDP and tensor parallel) must draw the same bits or they drift apart, while
the default generator differs per data-parallel rank (dropout). So every stochastically rounded step runs on the
default generator forked and seeded from (job seed, step, parameter index), alike on every rank: reproducible,
resumed bit for bit, and alike across replicas. Shards of one weight on different ranks draw the same bits at
the same offset within their shard; each element's rounding is still unbiased.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from rigpilot.engine.schema import MasterWeights, Optimizer

BETAS = (0.9, 0.95)
# Stochastic-rounding seeds: (job seed, step, weight index) mixed into one seed; the multipliers are primes, so two
# (step, weight) pairs of a job share a seed only 7919 weights apart, far more weights than a model has.
_SEED_MIX = (1_000_003, 7919, 131)


def use_foreach(params: Sequence[nn.Parameter]) -> bool | None:
    """Whether AdamW updates all parameters in a few multi-tensor kernels instead of one loop turn each.

    PyTorch picks that itself on GPUs only; on CPU ranks its default loops over the parameters, a
    tenth of a small model's step. The multi-tensor update is the same arithmetic, bit for bit, on
    plain tensors. DTensors keep PyTorch's choice: one multi-tensor op cannot span several meshes.
    """
    return True if not any(isinstance(p, DTensor) for p in params) else None


def use_fused(params: Sequence[nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel runs: every parameter a floating CUDA tensor, DTensors on one mesh."""
    if not params or any(p.device.type != "cuda" or not p.is_floating_point() for p in params):
        return False
    meshes = {id(p.device_mesh) for p in params if isinstance(p, DTensor)}
    return len(meshes) <= 1


def stochastic_rounding(master_weights: str) -> bool:
    """Whether the update is rounded to bf16 stochastically: pure bf16's weights."""
    return master_weights == MasterWeights.BF16


def new_optimizer(
    params: Sequence[nn.Parameter], optimizer: str, master_weights: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """One optimizer over `params`, as the recipe names it (see the module's docstring)."""
    rounding = stochastic_rounding(master_weights)
    if optimizer == Optimizer.ADAMW8BIT:
        return _adamw8bit()(params, lr=lr, weight_decay=weight_decay, betas=BETAS, bf16_stochastic_round=rounding)
    if rounding:
        from torchao.optim import _AdamW

        return _AdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS, bf16_stochastic_round=True)
    if use_fused(params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS, foreach=use_foreach(params))


@functools.cache
def _adamw8bit() -> Callable[..., torch.optim.Optimizer]:
    """torchao's AdamW8bit with its 8-bit moments shown as fp32 tensors whatever the weights' dtype.

    NOTE: torchao 0.18 gives a moment the weight's dtype as its outward dtype; for a bf16 DTensor weight (pure
    bf16 under FSDP2 or tensor parallel) DTensor's checks then refuse the step's lerp (bf16 moment, fp32
    gradient). The outward dtype is only a label: the codes are uint8 and the block scales fp32 either way, and
    the step dequantizes to fp32 itself, so the arithmetic is torchao's, unchanged.
    """
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit

    class AdamW8bitFp32State(AdamW8bit):
        @staticmethod
        def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
            return OptimState8bit.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

    return AdamW8bitFp32State


def optimizer_words(optimizer: str, master_weights: str, in_backward: bool) -> str | None:
    """The log's note on the optimizer, where it is not plain AdamW."""
    parts = []
    if optimizer == Optimizer.ADAMW8BIT:
        parts.append("8-bit AdamW (torchao): both moments block-quantized to 8 bits")
    if stochastic_rounding(master_weights):
        parts.append("the bf16 weights are updated with stochastic rounding (torchao)")
    if in_backward:
        parts.append("each weight is stepped in backward as its gradient arrives, one optimizer per weight")
    return "; ".join(parts) if parts else None


@contextlib.contextmanager
def rounding_seed(seed: int, step: int, index: int, device: torch.device) -> Iterator[None]:
    """The default generator, forked and seeded from (seed, step, index) alike on every rank, for one step."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        a, b, c = _SEED_MIX
        torch.manual_seed((seed * a + step * b + index * c) % (1 << 63))
        yield


class Schedulers:
    """One LR schedule over several optimizers (one per weight in backward): stepped together, saved as one."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], lr_lambda: Callable[[int], float]) -> None:
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return [float(x) for x in self.schedulers[0].get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        # Alike in every optimizer: a checkpoint holds one, as the single-optimizer loop's does.
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.load_state_dict(state)


class GradNormSquares:
    """The squared L2 norm of the gradients as their weights are stepped, added up to the step's norm at its end.

    A DTensor gradient's local square sum is summed over the mesh dims it is sharded on (not the ones it is
    replicated on); plain tensors are whole on every rank. One all-reduce per (mesh, sharded dims) at the end.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[Any, torch.Tensor] = {}
        self.groups: dict[Any, list[Any]] = {}

    def add(self, grad: torch.Tensor) -> None:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        square = local.detach().float().pow(2).sum().to(self.device)
        key: Any = None
        if isinstance(grad, DTensor):
            dims = tuple(i for i, p in enumerate(grad.placements) if isinstance(p, Shard))
            key = (id(grad.device_mesh), dims) if dims else None
            if key is not None and key not in self.groups:
                self.groups[key] = [grad.device_mesh.get_group(i) for i in dims]
        self.sums[key] = self.sums[key] + square if key in self.sums else square

    def total(self) -> torch.Tensor:
        """The step's norm (a 0-dim fp32 tensor); starts the next step's sums."""
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        for key, s in self.sums.items():
            for group in self.groups.get(key, []):
                dist.all_reduce(s, group=group)
            square = square + s
        self.sums = {}
        return square.sqrt()


class _ParamStep:
    """One weight's optimizer, stepped in backward: its gradient's norm is counted, then it steps, then it goes."""

    def __init__(self, owner: OptimizerInBackward, index: int, param: nn.Parameter, opt: torch.optim.Optimizer) -> None:
        self.owner, self.index, self.param, self.opt = owner, index, param, opt

    def step(self) -> None:
        grad = self.param.grad
        if grad is None:
            return
        self.owner.norms.add(grad)
        if self.owner.rounding:
            with rounding_seed(self.owner.seed, self.owner.step, self.index, self.owner.device):
                self.opt.step()
        else:
            self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


class OptimizerInBackward:
    """One optimizer per weight, each stepped as soon as its gradient is ready (see the module's docstring).

    `hook` once the model is wrapped; `finish_step` closes a step: the gradient norm of the weights stepped in it.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        *,
        seed: int,
        rounding: bool,
        device: torch.device,
    ) -> None:
        self.params = list(params)
        self.optimizers = [make([p]) for p in self.params]
        self.steps = [
            _ParamStep(self, i, p, o) for i, (p, o) in enumerate(zip(self.params, self.optimizers, strict=True))
        ]
        self.seed, self.rounding, self.device = seed, rounding, device
        self.step = 0  # the step being run (the rounding seed's)
        self.norms = GradNormSquares(device)
        self.handles: list[Any] = []

    def hook(self) -> None:
        """Step each weight in its post-accumulate-grad hook (FSDP2: on the sharded parameter, after the
        reduce-scatter; a single rank or tensor parallel: when autograd has the whole gradient)."""
        for p, s in zip(self.params, self.steps, strict=True):

            def stepped(param: torch.Tensor, s: _ParamStep = s) -> None:
                s.step()
                param.grad = None  # the whole point: this gradient is gone before the next one arrives

            self.handles.append(p.register_post_accumulate_grad_hook(stepped))

    def begin_step(self, step: int) -> None:
        self.step = step

    def finish_step(self) -> torch.Tensor:
        for p in self.params:
            p.grad = None  # the hooks leave none behind; a weight that took no gradient has none either
        return self.norms.total()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict[Any, Any]:
        """Every weight's optimizer state, by parameter (as one optimizer's `state` reads)."""
        merged: dict[Any, Any] = {}
        for o in self.optimizers:
            merged.update(o.state)
        return merged
