"""Read what a safetensors checkpoint holds from its headers alone, never its tensors.

A safetensors file starts with an 8-byte little-endian header length and a
JSON header mapping each tensor name to its dtype, shape and byte offsets; a
70B checkpoint's headers are a few megabytes, its tensors 140 GB. The same
counting (`count_tensors`) serves local files and the headers that
`huggingface_hub` fetches with HTTP range requests.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import is_given_file, open_given_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# A real header is at most a few MB; a larger length means the file is not safetensors.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# Floating and packed-integer dtypes hold weights; the rest of a checkpoint is buffers.
_WEIGHT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}

# Buffers that older checkpoints saved beside the weights: position ids, rotary
# frequencies and GPT-2/GPT-NeoX causal masks (gpt2's model.safetensors holds
# 12 float mask tensors of 1024x1024). They are not parameters.
_BUFFER_NAME = re.compile(
    r"(^|\.)(position_ids|token_type_ids|inv_freq|masked_bias)$"
    r"|(^|\.)(attn|attention)\.bias$"  # GPT-2 / GPT-NeoX causal mask (the projections' biases are deeper)
)
_EMBEDDING_NAME = re.compile(
    r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|position_embeddings|token_type_embeddings|embed_in|tok_embeddings)"
    r"\.weight$"
)
# Input-embedding names in preference order, to find the matrix an untied-looking head duplicates.
_INPUT_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in|tok_embeddings)\.weight$")
_OUTPUT_HEAD = re.compile(r"^(lm_head|embed_out|output)\.weight$")


@dataclass(frozen=True)
class TensorHeader:
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class TensorCount:
    """Parameters a checkpoint holds, buffers and a duplicated tied head left out."""

    total: int
    by_dtype: dict[str, int]
    embedding: int
    has_head: bool
    skipped: list[str] = field(default_factory=list)  # names left out, for the notes


def read_header(path: Path) -> dict[str, TensorHeader]:
    """The tensors one .safetensors file declares (name -> dtype, shape), reading only its header."""
    try:
        with open_given_file(path, "weights file") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise UserError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length == 0 or length > min(size - 8, _MAX_HEADER_BYTES):
                raise UserError(
                    f"{path}: not a safetensors file or truncated (header length {length}, file {size} bytes)"
                )
            raw = f.read(length)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: corrupt safetensors header ({e})") from e
    return parse_header(header, where=str(path))


def parse_header(header: object, *, where: str) -> dict[str, TensorHeader]:
    """Validate a decoded header and keep each tensor's dtype and shape."""
    if not isinstance(header, dict):
        raise UserError(f"{where}: corrupt safetensors header (not a JSON object)")
    tensors: dict[str, TensorHeader] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(d) for d in info["shape"])
            dtype = str(info["dtype"])
        except (TypeError, KeyError, ValueError) as e:
            raise UserError(f"{where}: corrupt safetensors header (tensor {name!r} has no valid dtype/shape)") from e
        tensors[name] = TensorHeader(dtype, shape)
    return tensors


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files that make up a folder's model, or [] if it has none.

    The index decides for sharded checkpoints. Without one, `model*.safetensors`
    is taken: a folder may also hold `consolidated.safetensors` (the same weights
    in Mistral's own layout) or adapters, which would count twice.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{index}: corrupt safetensors index ({e})") from e
        missing = [s for s in shards if not is_given_file(folder / s)]
        if missing:
            raise UserError(f"{index}: lists {len(missing)} shard(s) that are not in the folder, e.g. {missing[0]}")
        return [folder / s for s in shards]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    return sorted(p for p in folder.glob("model*.safetensors") if is_given_file(p))


def read_checkpoint(folder: Path) -> dict[str, TensorHeader]:
    """Every tensor of a folder's checkpoint, from the headers of all its shards."""
    tensors: dict[str, TensorHeader] = {}
    for path in checkpoint_files(folder):
        tensors.update(read_header(path))
    return tensors


def count_tensors(tensors: Mapping[str, TensorHeader], *, tied_embeddings: bool) -> TensorCount:
    """Count parameters tensor by tensor.

    Buffers are left out (integer/bool dtypes and the names in `_BUFFER_NAME`),
    and an output head that duplicates tied input embeddings counts once, as it
    does in the model.
    """
    by_dtype: dict[str, int] = {}
    embedding = 0
    skipped: list[str] = []
    has_input_embedding = any(_INPUT_EMBEDDING.search(n) for n in tensors)
    has_head = False
    for name, t in tensors.items():
        if t.dtype not in _WEIGHT_DTYPES or _BUFFER_NAME.search(name):
            skipped.append(name)
            continue
        if _OUTPUT_HEAD.match(name.removeprefix("model.")):
            has_head = True
            if tied_embeddings and has_input_embedding:
                skipped.append(name)
                continue
        if _EMBEDDING_NAME.search(name):
            embedding += t.numel
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel
    return TensorCount(sum(by_dtype.values()), by_dtype, embedding, has_head, skipped)


def stored_elements_by_dtype(tensors: Iterable[TensorHeader]) -> dict[str, int]:
    """Elements per dtype exactly as stored (quantised checkpoints pack several weights per element)."""
    out: dict[str, int] = {}
    for t in tensors:
        out[t.dtype] = out.get(t.dtype, 0) + t.numel
    return out
