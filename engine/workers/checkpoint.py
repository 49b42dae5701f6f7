"""Checkpoints (torch.distributed.checkpoint, sharded, atomic) and the final Hugging Face folder.

A checkpoint holds everything that decides the next step: model and optimizer
state (sharded as they live on the ranks, so any rank layout that DCP can
reshard to can load it), the LR scheduler, the data position and every rank's
RNG states. It is written to `checkpoints/step-N.tmp`, marked with a `COMPLETE`
file there, and only then renamed to `step-N`: a `.tmp` folder, or one without
the marker, is never loaded, whatever killed the job while writing it.

A save that fails on any rank fails on every rank at once (the ranks agree on
the outcome with a small all-reduce, not a barrier a failed rank never reaches),
and the previous complete checkpoint is left as it was. One that found the disk
full removes its partial folder, giving that space back, and raises `DiskFull`
naming the folder, about how much a checkpoint takes and what is free.

A resume takes the newest complete checkpoint that loads; one that does not
(damaged, or refused as below) is passed over, with a note, for the one before.

Loading runs no code from the job folder, which anyone who can write to it
could have planted: DCP's `.metadata` is a pickle and its non-tensor values are
torch.save'd, and it loads both with the unrestricted unpickler. Here the
COMPLETE marker is checked as JSON first, `.metadata` goes through an
unpickler that knows only DCP's own metadata classes (`_MetadataUnpickler`),
and non-tensor values are read with `torch.load(weights_only=True)` (tensors
already are). A checkpoint holding anything else is refused with one line
(`UnsafeCheckpoint`).
"""

from __future__ import annotations

import copy
import errno
import io
import json
import os
import pickle
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from rigpilot.engine.diskspace import DiskFull, folder_bytes, free_bytes, is_disk_full
from rigpilot.engine.errors import UserError
from rigpilot.engine.workers.model_loading import LoadedModel, auto_class, offline
from rigpilot.engine.workers.parallel_dims import Runtime

COMPLETE = "COMPLETE"


class UnsafeCheckpoint(UserError):
    """A checkpoint holds something that is not plain data: it is not loaded."""


class DamagedCheckpoint(UserError):
    """A complete checkpoint that cannot be read back (a file missing or cut short)."""


# What a rank says of a save or load it took part in; the ranks agree on the worst (all-reduce MAX).
_OK, _FAILED, _DISK_FULL = 0, 1, 2


# What DCP's FileSystemWriter pickles into `.metadata` (torch 2.x): its metadata dataclasses, tensor
# sizes, dtypes and layouts, and the checkpoint's path. Nothing here runs code when constructed.
_DCP = "torch.distributed.checkpoint"
_METADATA_GLOBALS = {
    *((f"{_DCP}.metadata", n) for n in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` read through `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as e:  # any way it fails, it is not DCP's metadata
                raise UnsafeCheckpoint(f"checkpoint {Path(self.path).name}: its .metadata is refused ({e})") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"checkpoint {Path(self.path).name}: its .metadata is not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, with a write that found no room raised as ENOSPC.

    torch.save reports a short write as a RuntimeError ("file write failed") with the OSError only as
    its context, which DCP loses when it gathers the ranks' errors: the errno must be on the error itself.
    """

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().write_data(*args, **kwargs)
        except Exception as e:
            if is_disk_full(e):
                raise _enospc(self.path) from e
            raise

    def finish(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().finish(*args, **kwargs)
        except Exception as e:
            if is_disk_full(e):
                raise _enospc(self.path) from e
            raise


def _enospc(path: Any) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


class _PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values read by torch's weights-only unpickler."""

    def __init__(self, checkpoint: str, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)  # raises on anything but plain data, running nothing
        except Exception as e:
            first = next((ln for ln in str(e).splitlines() if "Unsupported global" in ln), str(e).splitlines()[0])
            raise UnsafeCheckpoint(
                f"checkpoint {self.checkpoint}: {read_item.dest_index.fqn} is not plain data ({first.strip()})"
            ) from None
        # As DefaultLoadPlanner.load_bytes places it, minus its weights_only=False load.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def check_marker(path: Path) -> dict[str, Any]:
    """The COMPLETE marker, read as the JSON Rigpilot wrote at save time, before DCP reads anything."""
    try:
        info = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UnsafeCheckpoint(f"checkpoint {path.name}: its {COMPLETE} marker is not Rigpilot's JSON ({e})") from None
    step = info.get("step") if isinstance(info, dict) else None
    if not isinstance(step, int) or f"step-{step}" != path.name:
        raise UnsafeCheckpoint(f"checkpoint {path.name}: its {COMPLETE} marker names step {step!r}")
    return info


def _unsafe_in(e: BaseException) -> UnsafeCheckpoint | None:
    """The UnsafeCheckpoint some rank raised inside DCP, which wraps it in a CheckpointException."""
    if isinstance(e, UnsafeCheckpoint):
        return e
    if isinstance(e, CheckpointException):
        for exc, _ in e.failures.values():
            found = _unsafe_in(exc)
            if found:
                return found
    return _unsafe_in(e.__cause__) if e.__cause__ is not None else None


class _ModelAndOptimizer(Stateful):
    """DCP-facing view of one model part and its optimizer, in the model's own parameter names.

    Several optimizers (one per weight, stepped in backward) are saved as one: torch's get_state_dict merges
    their states by parameter name, and set_state_dict hands each its own back, so the checkpoint reads the
    same as one optimizer's. torchao's 8-bit moments are saved as its tensor subclass (torchao implements the
    ops DCP uses on it and registers it with the weights-only unpickler)."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], trainable_only: bool) -> None:
        self.model, self.optimizers = model, list(optimizers)
        self.optimizer = self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers
        # LoRA: frozen base weights come from the base model again on resume; saving them is waste.
        self.options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self.options,
        )


class _Plain(Stateful):
    """Anything with state_dict()/load_state_dict() (scheduler, data position) as DCP Stateful."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    def __init__(
        self,
        job_dir: Path,
        runtime: Runtime,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        scheduler: Any,
        data_position: Any,
        trainable_only: bool,
        keep: int = 0,
        derived: tuple[str, ...] = (),
    ) -> None:
        self.folder = job_dir / "checkpoints"
        # Flattened state keys the job can derive itself when a checkpoint lacks them: the last stage's
        # copy of a tied matrix, whose optimizer state a checkpoint of an unsplit model keeps only under
        # the embedding's name (engine/workers/tied.py fills it in after the load).
        self.derived = derived
        self.keep = keep  # newest complete checkpoints kept after a save; 0 keeps them all
        self.runtime = runtime
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.app = _ModelAndOptimizer(model, optimizers, trainable_only)
        self.scheduler = _Plain(scheduler)
        self.data = _Plain(data_position)

    def _state(self, step: int) -> dict[str, Any]:
        return {
            "app": self.app,
            "scheduler": self.scheduler,
            "data": self.data,
            "train": {"step": step},
            # Per rank: dropout and other randomness differ between ranks and must each come back.
            f"rng_rank{self.runtime.rank}": rng_state(),
        }

    def save(self, step: int) -> Path:
        """Write checkpoint step-N whole, or raise on every rank with the previous ones untouched."""
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        failure: BaseException | None = None
        if self.runtime.is_main:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
            except OSError as e:
                failure = e
        outcome = self._agree(failure)
        if outcome == _OK:
            try:
                dcp.save(self._state(step), storage_writer=_Writer(str(tmp)))
            except (Exception, CheckpointException) as e:  # DCP raises one rank's write error on every rank
                failure = e
            outcome = self._agree(failure)  # every rank's shard is on disk before the checkpoint is declared whole
        if outcome == _OK:
            if self.runtime.is_main:
                try:
                    self._seal(tmp, final, step)
                except OSError as e:
                    failure = e
            outcome = self._agree(failure)
        if outcome != _OK:
            failed_at = time.time()
            if self.runtime.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # the partial folder, and the room it took
            self._agree(None)  # gone before any rank measures what is free
            if outcome == _DISK_FULL:
                needed = self._needed_bytes()
                raise DiskFull(self.folder, free_bytes(self.folder), needed, f"for step-{step}", failed_at) from None
            if failure is None:
                raise RuntimeError(f"checkpoint step-{step} failed on another rank")
            root = _first_failure(failure)
            raise RuntimeError(f"checkpoint step-{step} failed: {type(root).__name__}: {_first_line(root)}") from failure
        if self.runtime.is_main:
            prune_checkpoints(self.folder, self.keep)
        dist.barrier()
        return final

    def _seal(self, tmp: Path, final: Path, step: int) -> None:
        """Mark `tmp` complete, then give it its final name: a `step-N` folder is whole or absent."""
        info = {"step": step, "time": time.time(), "world_size": self.runtime.world_size}
        info["parallelism"] = dict(zip(("pp", "dp_replicate", "dp_shard", "tp"), self.runtime.dims.shape, strict=True))
        blocks = getattr(self.data.obj, "blocks_per_batch", None)
        if blocks is not None:  # the unit of the data position, which another layout may cut otherwise
            info["blocks_per_batch"] = blocks
        with open(tmp / COMPLETE, "w") as f:
            f.write(json.dumps(info) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # a damaged one a resume passed over
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(self.folder)

    def _agree(self, failure: BaseException | None) -> int:
        """The worst outcome over every rank (_OK, _FAILED, _DISK_FULL); a collective every rank must reach."""
        mine = _OK if failure is None else _DISK_FULL if is_disk_full(_first_failure(failure)) else _FAILED
        flag = torch.tensor([mine], dtype=torch.int64, device=self.runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _needed_bytes(self) -> int:
        """About what one checkpoint takes: the newest complete one's size, else this state's bytes over the ranks.

        Replicated data-parallel copies are written once, so the ranks' sum is divided by their number.
        """
        newest = latest_checkpoint(self.folder)
        trainable_only = self.app.options.ignore_frozen_params
        params = [p for p in self.app.model.parameters() if p.requires_grad or not trainable_only]
        mine = 0
        for t in [*params, *(t for o in self.app.optimizers for t in _tensors(o.state))]:
            if isinstance(t, torch.Tensor):
                local = t.to_local() if isinstance(t, DTensor) else t
                mine += local.numel() * local.element_size()
        total = torch.tensor([mine], dtype=torch.int64, device=self.runtime.device)
        dist.all_reduce(total)  # every rank reaches this, so every rank computes it
        if newest is not None:
            return folder_bytes(newest)
        return int(total.item()) // max(self.runtime.dims.dp_replicate, 1)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.folder)

    def resume(self) -> tuple[Path, int, list[str]] | None:
        """Restore the newest complete checkpoint that loads: (its folder, its step, notes for the log).

        None when there is no complete checkpoint. One that cannot be loaded is passed over for the
        one before, with a note; when none loads, the newest one's error is raised.
        """
        candidates = [d for _, ok, d in _checkpoints(self.folder) if ok][::-1]
        if not candidates:
            return None
        passed: list[str] = []
        skipped: list[Path] = []
        first: UserError | None = None
        for path in candidates:
            try:
                step, notes = self.load(path)
            except (UnsafeCheckpoint, DamagedCheckpoint) as e:
                first = first or e
                passed.append(str(e))
                skipped.append(path)
                continue
            if passed:
                notes = [f"{'; '.join(passed)}: resuming from {path.name}, the newest checkpoint that loads", *notes]
                self._set_aside(skipped)
            return path, step, notes
        assert first is not None
        raise first

    def _set_aside(self, damaged: list[Path]) -> None:
        """Rename checkpoints a resume passed over to step-N.damaged: kept for a look, never loaded again, and
        not counted as the newest when later saves prune (which would then delete the good ones)."""
        if self.runtime.is_main:
            for path in damaged:
                target = path.with_name(f"{path.name}.damaged")
                shutil.rmtree(target, ignore_errors=True)
                try:
                    path.rename(target)
                except OSError:
                    shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def load(self, path: Path) -> tuple[int, list[str]]:
        """Restore everything from `path`; returns the step it was taken after, and notes for the log.

        Every rank reaches the same verdict: a rank that cannot read its part fails them all.
        """
        notes: list[str] = []
        state = self._state(0)
        rng_key = f"rng_rank{self.runtime.rank}"
        failure: BaseException | None = None
        stored: dict[str, Any] = {}
        marker: dict[str, Any] = {}
        try:
            marker = check_marker(path)
            stored = SafeReader(str(path)).read_metadata().state_dict_metadata
        except Exception as e:
            failure = e
        if self._agree(failure) != _OK:
            raise _load_error(path, failure)
        if not _holds(stored, rng_key):
            state.pop(rng_key)
            notes.append(f"{path.name} was written by a different number of ranks: RNG states start fresh")
        partial = any(not _holds(stored, key) for key in self.derived)
        try:
            planner = _PlainDataPlanner(path.name, allow_partial_load=partial)
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=planner)
        except (Exception, CheckpointException) as e:  # a BaseException, so no `except Exception` takes it by mistake
            failure = e
        if self._agree(failure) != _OK:
            raise _load_error(path, failure)
        if rng_key in state:
            set_rng_state(state[rng_key])
        resumed = getattr(self.data.obj, "resumed", None)
        if resumed is not None:
            written = marker.get("blocks_per_batch")
            resumed(written if isinstance(written, int) and written > 0 else None)
        return int(state["train"]["step"]), notes


def _holds(stored: Any, key: str) -> bool:
    """Whether a checkpoint's flattened keys hold `key` or anything under it."""
    return any(k == key or k.startswith(key + ".") for k in stored)


def _load_error(path: Path, failure: BaseException | None) -> UserError:
    """Why `path` did not load, as one line: refused (UnsafeCheckpoint) or damaged."""
    if failure is None:
        return DamagedCheckpoint(f"checkpoint {path.name}: another rank could not read its part")
    unsafe = _unsafe_in(failure)
    if unsafe is not None:
        return UnsafeCheckpoint(str(unsafe))
    root = _first_failure(failure)
    return DamagedCheckpoint(f"checkpoint {path.name} is damaged ({type(root).__name__}: {_first_line(root)})")


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _first_failure(e: BaseException) -> BaseException:
    """The error a rank raised inside DCP, which wraps every rank's in a CheckpointException (the
    first that is a disk-full one, which decides what the user is told)."""
    if isinstance(e, CheckpointException):
        found = [_first_failure(exc) for exc, _ in e.failures.values()]
        return next((f for f in found if is_disk_full(f)), found[0] if found else e)
    return e


def _tensors(value: Any) -> list[Any]:
    """The tensors inside nested dicts and lists (an optimizer's state)."""
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return [value]


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoints(folder: Path) -> list[tuple[int, bool, Path]]:
    """(step, complete, folder) of every step-N folder, a half-written step-N.tmp included, by step."""
    found: list[tuple[int, bool, Path]] = []
    if not folder.is_dir():
        return found
    for d in folder.iterdir():
        if not d.is_dir() or not d.name.startswith("step-"):
            continue
        try:
            step = int(d.name.removeprefix("step-").removesuffix(".tmp"))
        except ValueError:
            continue
        found.append((step, not d.name.endswith(".tmp") and (d / COMPLETE).is_file(), d))
    return sorted(found, key=lambda t: (t[0], t[1]))


def latest_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    complete = [d for _, ok, d in _checkpoints(folder) if ok]
    return complete[-1] if complete else None


def prune_checkpoints(folder: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints, and unfinished ones older than the newest.

    A full-model checkpoint is the size of the weights plus twice that in optimizer state; kept at
    every save, a long run fills the disk. Returns what was removed. keep=0 removes nothing.
    """
    if keep <= 0:
        return []
    found = _checkpoints(folder)
    complete = [(step, d) for step, ok, d in found if ok]
    if not complete:
        return []
    newest = complete[-1][0]
    doomed = [d for _, d in complete[:-keep]]
    doomed += [d for step, ok, d in found if not ok and step < newest]  # left by a run that was killed
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


# --- the final model ------------------------------------------------------------------------------


def gather_full_state(model: nn.Module, runtime: Runtime, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (CPU), gathered one tensor at a time; empty on other ranks.

    Each DTensor is made whole with full_tensor() (a collective within its own
    mesh), copied to the CPU by the one rank that keeps it, and dropped, so no
    device ever holds more than one full tensor. Pipeline stages then send
    their part to rank 0.
    """
    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    coord = runtime.coord
    keeper = coord["dp_replicate"] == 0 and coord["dp_shard"] == 0 and coord["tp"] == 0
    part: dict[str, torch.Tensor] = {}
    for name, value in sd.items():
        if not isinstance(value, torch.Tensor):
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keeper:
            part[name] = full.detach().to("cpu", copy=True)
        del full
    if runtime.dims.pp == 1:
        return part if runtime.is_main else {}
    gathered: list[Any] | None = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(part if keeper else {}, gathered, dst=0)
    merged: dict[str, torch.Tensor] = {}
    for p in gathered or []:
        merged.update(p)
    return merged


def save_final_model(
    out_dir: Path,
    loaded: LoadedModel,
    state: dict[str, torch.Tensor],
    *,
    save_merged: bool,
    trust_remote_code: bool,
) -> None:
    """Rank 0 only: write `out_dir` as a Hugging Face folder (LoRA: the adapter; merged weights in merged/)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if loaded.lora:
        _lora_skeleton(loaded, trust_remote_code).save_pretrained(str(out_dir), state_dict=state)
        loaded.tokenizer.save_pretrained(str(out_dir))
        if save_merged:
            _save_merged(out_dir, loaded, trust_remote_code)
        return
    _write_hf_folder(out_dir, loaded, copy.deepcopy(loaded.config), state, trust_remote_code)


def _write_hf_folder(
    out_dir: Path, loaded: LoadedModel, config: Any, state: dict[str, torch.Tensor], trust_remote_code: bool
) -> None:
    # A skeleton on the meta device costs no memory; assigning the gathered tensors gives
    # transformers' own save_pretrained (tied weights, shards, key renames) a real model to save.
    with torch.device("meta"):
        skeleton = auto_class(loaded.objective).from_config(config, trust_remote_code=trust_remote_code)
    dtype = loaded.saved_dtype
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    skeleton.load_state_dict(state, strict=False, assign=True)
    _check_tied_pair(skeleton)
    skeleton.tie_weights()
    still_meta = [n for n, p in skeleton.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"final save: weights missing from the gathered state: {still_meta[:5]}")
    skeleton.save_pretrained(str(out_dir))
    loaded.tokenizer.save_pretrained(str(out_dir))


def _check_tied_pair(model: nn.Module) -> None:
    """Say so when the two copies of a tied matrix (a pipeline's first and last stage) came back different.

    Training keeps them equal bit for bit (engine/workers/tied.py); tie_weights() then saves the
    embedding as both, which is the model the job trained only while that holds.
    """
    config = getattr(model, "config", None)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or inp is None or out is None or out.weight is inp.weight:
        return
    if out.weight.is_meta or inp.weight.is_meta or out.weight.shape != inp.weight.shape:
        return
    diff = float((out.weight.float() - inp.weight.float()).abs().max())
    if diff > 0:
        print(
            f"rigpilot-worker: note: the tied LM head came back {diff:.3g} away from the embedding; "
            "the embedding is saved as both",
            flush=True,
        )


def _lora_skeleton(loaded: LoadedModel, trust_remote_code: bool) -> nn.Module:
    """The whole PeftModel on the meta device: peft finds the adapter's entries by walking the model's
    LoRA layers, and this rank's own copy may be one pipeline stage of it."""
    from peft import get_peft_model

    peft_config = copy.deepcopy(loaded.model.peft_config["default"])
    with torch.device("meta"):
        base = auto_class(loaded.objective).from_config(loaded.config, trust_remote_code=trust_remote_code)
        return get_peft_model(base, peft_config)


def _save_merged(out_dir: Path, loaded: LoadedModel, trust_remote_code: bool) -> None:
    from peft import PeftModel

    src = loaded.source
    base = auto_class(loaded.objective).from_pretrained(
        src.location, dtype=loaded.saved_dtype, trust_remote_code=trust_remote_code, local_files_only=offline()
    )
    merged = PeftModel.from_pretrained(base, str(out_dir)).merge_and_unload()
    merged.save_pretrained(str(out_dir / "merged"))
    loaded.tokenizer.save_pretrained(str(out_dir / "merged"))
