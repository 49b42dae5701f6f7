"""Measure what one real training step holds, component by component, and what a KV cache holds.

Parameters, gradients and optimizer state are the nbytes of their tensors.
Activations are what autograd saves for backward during the forward pass:
every tensor packed through `saved_tensors_hooks`, counted once per storage
(views and tensors saved by several ops share one), the parameters themselves
left out (they are counted as parameters; autocast's bf16 copies of them are
not parameters and stay in). Under tensor parallel (`engine.accuracy.tp`) every
figure is one rank's: the local parts of DTensor parameters, gradients, state
and saved tensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rigpilot.engine.accuracy.cuda_autocast import CudaAutocastOnCpu, CudaDropoutOnCpu
from rigpilot.engine.accuracy.models import Built, build

COMPONENTS = ("params", "grads", "optimizer", "activations_saved")


@dataclass(frozen=True)
class Case:
    """One training step, in the planner's vocabulary (`rigpilot.engine.planner.memory.predict_components`)."""

    model: str  # a name from engine.accuracy.models.MODEL_NAMES
    precision: str = "fp32"  # "fp32", or "bf16": autocast over fp32 weights (LoRA: a bf16 base, fp32 adapters)
    method: str = "full"  # "full" | "lora"
    # "none" | "full" (every block keeps only its input) | "selective" (the engine's policy: matmul and
    # attention outputs kept, the rest recomputed; measured as live storages, see LiveStorageMeter)
    checkpointing: str = "none"
    micro_batch: int = 2
    seq_len: int = 64
    lora_rank: int = 8
    lora_targets: tuple[str, ...] | None = None  # None: peft's default for the family
    optimizer: str = "adamw"
    tp: int = 1  # > 1: measured per rank on tp gloo CPU ranks, split by the engine's apply_tensor_parallel
    sequence_parallel: bool = False

    @property
    def name(self) -> str:
        parts = [self.model, self.precision, self.method]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + (" sp" if self.sequence_parallel else ""))
        if self.method == "lora":
            parts.append(f"r{self.lora_rank}" + (f":{','.join(self.lora_targets)}" if self.lora_targets else ""))
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing}")
        if self.seq_len != 64:
            parts.append(f"s{self.seq_len}")
        return " ".join(parts)


class SavedTensorMeter:
    """Unique storages autograd packs for backward, the given parameters' own storages excluded."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params = {local(p).untyped_storage().data_ptr() for p in params}
        # Holding each storage keeps its address from being reused by a later, different tensor.
        self._kept: dict[int, torch.UntypedStorage] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._params:
            self._kept.setdefault(ptr, storage)
        return t

    @contextmanager
    def recording(self) -> Iterator[SavedTensorMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def bytes(self) -> int:
        return sum(s.nbytes() for s in self._kept.values())


class LiveStorageMeter(TorchDispatchMode):
    """Storages the ops of a forward pass create that are still alive after it, the given ones left out.

    Selective checkpointing keeps its tensors where `saved_tensors_hooks` never see them (the
    non-reentrant checkpoint's own hooks replace the tensors, the policy's cache holds the matmul
    outputs): what a forward pass leaves alive is what it keeps for backward, besides the outputs
    the caller holds (`exclude`).
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._params = {local(p).untyped_storage().data_ptr() for p in params}
        self._seen: dict[int, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import weakref

        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = local(t).untyped_storage()
                ptr = storage.data_ptr()
                known = self._seen.get(ptr)
                if ptr and ptr not in self._params and (known is None or known() is None):
                    self._seen[ptr] = weakref.ref(storage)  # a freed storage's address may be reused
        return out

    def bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        skip = {local(t).untyped_storage().data_ptr() for t in exclude}
        alive = (ref() for ptr, ref in self._seen.items() if ptr not in skip)
        return sum(s.nbytes() for s in alive if s is not None and s.data_ptr())


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose memory `t` is: a DTensor's local part, a pending collective's result, or `t`."""
    for _ in range(4):  # wrappers may nest (a DTensor over an AsyncCollectiveTensor)
        inner = getattr(t, "_local_tensor", None)
        if not isinstance(inner, torch.Tensor):
            inner = getattr(t, "elem", None) if type(t).__name__ == "AsyncCollectiveTensor" else None
        if not isinstance(inner, torch.Tensor):
            return t
        t = inner
    return t


def measure_step(
    case: Case, *, device: str = "cpu", cuda_autocast_policy: bool = True, tp_mesh: Any = None
) -> dict[str, int]:
    """Run one forward/backward/AdamW step of `case` and return bytes per component.

    On the CPU, `cuda_autocast_policy` makes bf16 autocast cast the way CUDA's does
    and dropout keep CUDA's bool mask (see `cuda_autocast`), since the planner
    predicts what a GPU holds. With a
    `tp_mesh` (see `engine.accuracy.tp`) the model is split as a training job's
    workers split it and the step runs as theirs does (their loss, under
    `loss_parallel` when the LM head is vocabulary-parallel); bytes are this rank's.
    """
    built = build(case.model)
    model = _prepare(built, case).to(device)
    loss_parallel = False
    if tp_mesh is not None:
        from rigpilot.engine.workers.parallelize import apply_tensor_parallel, logits_split

        apply_tensor_parallel(model, tp_mesh, case.sequence_parallel, vocab_parallel=True)  # as train.py does
        loss_parallel = logits_split(model)
    if case.checkpointing == "selective":
        from rigpilot.engine.workers.parallelize import apply_activation_checkpointing

        apply_activation_checkpointing(model, "selective")  # after tensor parallel, as the workers apply it
    params = list(model.parameters())  # unique: a tied weight appears once
    trainable = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(built.vocab_size, (case.micro_batch, case.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    device_type = torch.device(device).type
    autocast = case.precision == "bf16"
    meter = SavedTensorMeter(params)
    live = LiveStorageMeter(params) if case.checkpointing == "selective" else contextlib.nullcontext()
    with contextlib.ExitStack() as outer:
        if loss_parallel:
            # The worker runs forward and backward of vocabulary-sharded logits under loss_parallel.
            from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

            outer.enter_context(loss_parallel_context())
        with contextlib.ExitStack() as stack:
            stack.enter_context(meter.recording())
            stack.enter_context(live)
            stack.enter_context(torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast))
            if autocast and device_type == "cpu" and cuda_autocast_policy:
                stack.enter_context(CudaAutocastOnCpu())
            if device_type == "cpu" and cuda_autocast_policy:
                stack.enter_context(CudaDropoutOnCpu())
            if tp_mesh is not None:
                out, loss = _worker_forward(model, ids)
            else:
                out, loss = _forward(model, ids, decoder=built.spec.is_decoder)
        saved = meter.bytes
        if isinstance(live, LiveStorageMeter):
            # The logits the loop holds are alive but not kept for backward; the loss is its own output.
            saved = live.bytes(exclude=[out.logits, loss] if hasattr(out, "logits") else [loss])
        loss.backward()
    optimizer.step()
    del out  # kept alive until here, as a training loop keeps its outputs until after backward
    return {
        "params": sum(local(p).nbytes for p in params),
        "grads": sum(local(p.grad).nbytes for p in trainable if p.grad is not None),
        "optimizer": sum(
            local(t).nbytes for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
        ),
        "activations_saved": saved,
    }


def _prepare(built: Built, case: Case) -> torch.nn.Module:
    model: torch.nn.Module = built.model
    if case.checkpointing == "full":
        # Reentrant checkpointing saves each block's input through ctx.save_for_backward, where the hooks see
        # it; the non-reentrant kind keeps the same tensors alive in a closure the hooks never see.
        _enable_checkpointing(built.model)
    elif case.checkpointing not in ("none", "selective"):  # selective: applied in measure_step, as the workers do
        raise ValueError(f"the harness measures checkpointing none, selective or full, not {case.checkpointing!r}")
    if case.method == "lora":
        from peft import LoraConfig, get_peft_model

        if case.precision == "bf16":
            model = model.to(torch.bfloat16)  # the base in half; peft keeps the adapters fp32
        targets = list(case.lora_targets) if case.lora_targets else None
        config = LoraConfig(r=case.lora_rank, lora_alpha=2 * case.lora_rank, lora_dropout=0.0, target_modules=targets)
        with warnings.catch_warnings():
            # peft asks transformers 5 whether checkpointing is on by a name transformers now calls deprecated.
            warnings.simplefilter("ignore", FutureWarning)
            model = get_peft_model(model, config)
    elif case.method != "full":
        raise ValueError(f"the harness measures full or lora training, not {case.method!r}")
    return model


def _enable_checkpointing(model: Any) -> None:
    kwargs = {"use_reentrant": True}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.enable_input_require_grads()  # a frozen embedding (LoRA) would otherwise cut the reentrant graph


def _worker_forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The training worker's forward and loss (engine.workers.train), the ids standing in for labels."""
    from rigpilot.engine.workers.train import token_loss

    out = model(input_ids=ids, use_cache=False)
    return out, token_loss(out.logits, ids)


def _forward(model: torch.nn.Module, ids: torch.Tensor, *, decoder: bool) -> tuple[Any, torch.Tensor]:
    if decoder:
        out = model(input_ids=ids, labels=ids, use_cache=False)  # training builds no KV cache
        return out, out.loss
    # An encoder has no loss of its own; a sum keeps nothing for backward, so only the encoder's tensors count.
    out = model(input_ids=ids)
    return out, out.last_hidden_state.float().sum()


def measure_kv_cache(
    case_model: str, *, batch: int, prompt: int, new_tokens: int, dtype: torch.dtype, device: str = "cpu"
) -> int:
    """Bytes of the KV cache after generating `new_tokens` greedily after a `prompt`-token prompt.

    The cache then holds prompt + new_tokens - 1 positions: the last token generated is never fed back.
    """
    model = build(case_model).model.to(device, dtype).eval()
    ids = torch.randint(model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # a random model might otherwise stop at an end-of-text token
            do_sample=False,
            use_cache=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return cache_bytes(out.past_key_values)


def cache_bytes(cache: Any) -> int:
    """nbytes of every key and value tensor in a transformers cache (Cache object or legacy tuples)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if t is not None)
    return sum(t.nbytes for layer in cache for t in layer)
