"""The GPU spec table: the vendor peak figures the parallelism planner predicts from.

The numbers live in `resources/gpu_specs.json`, one row per product, each with the datasheet it comes
from. Figures are dense peaks (never 2:4 sparsity) and tensor figures use FP32 accumulate where the
vendor distinguishes it, because that is what mixed-precision training actually gets on GeForce cards.

`match_spec` maps the name a driver reports ("NVIDIA A100-SXM4-80GB", "Tesla V100S-PCIE-32GB",
"AMD Instinct MI300X") onto a row. An unknown GPU gives `None`, never a guess from a similar row:
a wrong peak would quietly skew every plan made from it.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from rigpilot import resources

SCHEMA_VERSION = 1

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
_DTYPE_FIELD = {
    "fp32": "fp32_tflops",
    "tf32": "tf32_tflops",
    "bf16": "bf16_tflops",
    "fp16": "fp16_tflops",
    "fp8": "fp8_tflops",
    "int8": "int8_tops",
}
# Callers often hold a torch dtype's name rather than our short one.
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}

# How far the memory a driver reports may sit from a row's nominal size and still be that product.
# Below: ECC on GDDR cards hides 1/16 of it (a 16 GB T4 reports 15 GiB) and HBM parts reserve a little
# (an H100 NVL reports 93.6 of 94). Above: nothing reports more than it has, so only rounding.
# 0.85 still tells a 10 GB RTX 3080 (0.83 of 12) from the 12 GB one.
_MEMORY_FIT = (0.85, 1.05)


class SpecTableError(ValueError):
    """The spec table file is malformed; the message names the file, the row and the field."""


@dataclass(frozen=True)
class GpuSpec:
    """One product's published figures. Throughputs are dense peaks; `None` means the GPU has no such mode."""

    key: str
    name: str
    vendor: str
    architecture: str
    compute_capability: str | None  # CUDA "major.minor"; None for non-NVIDIA GPUs
    memory_gib: float
    memory_bandwidth_gbs: float
    fp32_tflops: float  # non-tensor
    tf32_tflops: float | None
    bf16_tflops: float | None
    fp16_tflops: float | None
    fp8_tflops: float | None
    int8_tops: float | None
    nvlink_gen: int | None
    nvlink_bandwidth_gbs: float | None  # per GPU, both directions together
    pcie_gen: int
    tdp_w: float
    form_factor: str
    source: str
    notes: str = ""
    match: tuple[str, ...] = ()

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense peak for `dtype` (fp32, tf32, bf16, fp16, fp8, int8) in TFLOPS, or TOPS for int8.

        `None` when the GPU has no such mode (bf16 on a V100, fp8 on an A100), so a planner cannot
        mistake "unsupported" for "slow".
        """
        wanted = dtype.strip().lower()
        wanted = _DTYPE_ALIASES.get(wanted, wanted)
        if wanted not in _DTYPE_FIELD:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        return getattr(self, _DTYPE_FIELD[wanted])


# ---------------------------------------------------------------------------------------------------------
# Loading and validation

_STR_FIELDS = ("key", "name", "vendor", "architecture", "form_factor", "source")
_POSITIVE_FIELDS = ("memory_gib", "memory_bandwidth_gbs", "fp32_tflops", "tdp_w")
_OPTIONAL_POSITIVE_FIELDS = (
    "tf32_tflops",
    "bf16_tflops",
    "fp16_tflops",
    "fp8_tflops",
    "int8_tops",
    "nvlink_bandwidth_gbs",
)
# Every field must be present, null where allowed, so a forgotten column is an error and not a silent None.
_REQUIRED_FIELDS = frozenset(
    (
        *_STR_FIELDS,
        *_POSITIVE_FIELDS,
        *_OPTIONAL_POSITIVE_FIELDS,
        "compute_capability",
        "nvlink_gen",
        "pcie_gen",
        "match",
    )
)
_ALL_FIELDS = _REQUIRED_FIELDS | {"notes"}
_KEY_RE = re.compile(r"[a-z0-9][a-z0-9-]*")
_CC_RE = re.compile(r"\d+\.\d+")


def default_path() -> Path:
    return resources.path("gpu_specs.json")


def load_specs(path: Path | None = None) -> list[GpuSpec]:
    """All rows of the spec table (the shipped one unless `path` is given), validated.

    Raises `SpecTableError` naming the row and field for anything malformed. Cached per file and
    modification time, so repeated calls are free and an edited file is read again.
    """
    path = Path(path) if path is not None else default_path()
    stat = path.stat()
    return list(_load_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=8)
def _load_cached(path: str, _mtime_ns: int, _size: int) -> tuple[GpuSpec, ...]:
    file = Path(path)
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SpecTableError(f"{file.name}: not valid JSON: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("gpus"), list):
        raise SpecTableError(f'{file.name}: expected an object with a "gpus" list')
    if document.get("schema_version") != SCHEMA_VERSION:
        raise SpecTableError(f"{file.name}: schema_version {document.get('schema_version')!r} is not {SCHEMA_VERSION}")

    specs: list[GpuSpec] = []
    seen_keys: dict[str, int] = {}
    for index, row in enumerate(document["gpus"]):
        label = _row_label(file, index, row)
        spec = _parse_row(row, label)
        if spec.key in seen_keys:
            raise SpecTableError(f"{label}: duplicate key (also row {seen_keys[spec.key]})")
        seen_keys[spec.key] = index
        specs.append(spec)
    _check_shared_patterns(file, specs)
    return tuple(specs)


def _row_label(file: Path, index: int, row: Any) -> str:
    key = row.get("key") if isinstance(row, dict) else None
    return f"{file.name}: row {index} ({f'key {key!r}' if isinstance(key, str) else 'no key'})"


def _parse_row(row: Any, label: str) -> GpuSpec:
    if not isinstance(row, dict):
        raise SpecTableError(f"{label}: expected an object, got {type(row).__name__}")
    missing = sorted(_REQUIRED_FIELDS - row.keys())
    if missing:
        raise SpecTableError(f"{label}: missing field(s) {', '.join(missing)}")
    unknown = sorted(row.keys() - _ALL_FIELDS)
    if unknown:
        raise SpecTableError(f"{label}: unknown field(s) {', '.join(unknown)}")

    values: dict[str, Any] = {}
    for name in _STR_FIELDS:
        values[name] = _text(row, name, label)
    if not _KEY_RE.fullmatch(values["key"]):
        raise SpecTableError(f"{label}: key must be lower-case letters, digits and '-', got {values['key']!r}")
    if "://" not in values["source"]:
        raise SpecTableError(f"{label}: source must name the datasheet and give its URL")
    notes = row.get("notes", "")
    if not isinstance(notes, str):
        raise SpecTableError(f"{label}: notes must be a string")
    values["notes"] = notes

    for name in _POSITIVE_FIELDS:
        values[name] = _positive(row, name, label)
    for name in _OPTIONAL_POSITIVE_FIELDS:
        values[name] = None if row[name] is None else _positive(row, name, label)

    values["pcie_gen"] = _integer(row, "pcie_gen", label, 1, 7)
    values["nvlink_gen"] = None if row["nvlink_gen"] is None else _integer(row, "nvlink_gen", label, 1, 9)
    if (values["nvlink_gen"] is None) != (values["nvlink_bandwidth_gbs"] is None):
        raise SpecTableError(f"{label}: nvlink_gen and nvlink_bandwidth_gbs must both be set or both be null")

    cc = row["compute_capability"]
    if values["vendor"] == "NVIDIA":
        if not isinstance(cc, str) or not _CC_RE.fullmatch(cc):
            raise SpecTableError(f'{label}: compute_capability must be "major.minor" for an NVIDIA GPU, got {cc!r}')
    elif cc is not None:
        raise SpecTableError(f"{label}: compute_capability is a CUDA notion; it must be null for {values['vendor']}")
    values["compute_capability"] = cc

    values["match"] = _patterns(row["match"], label)
    return GpuSpec(**values)


def _text(row: dict[str, Any], name: str, label: str) -> str:
    value = row[name]
    if not isinstance(value, str) or not value.strip():
        raise SpecTableError(f"{label}: {name} must be a non-empty string, got {value!r}")
    return value


def _positive(row: dict[str, Any], name: str, label: str) -> float:
    value = row[name]
    # bool is an int to Python but never a measurement.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecTableError(f"{label}: {name} must be a number, got {value!r}")
    if value <= 0:
        raise SpecTableError(f"{label}: {name} must be positive, got {value!r} (use null for 'no such mode')")
    return float(value)


def _integer(row: dict[str, Any], name: str, label: str, low: int, high: int) -> int:
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecTableError(f"{label}: {name} must be an integer from {low} to {high}, got {value!r}")
    return value


def _patterns(value: Any, label: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise SpecTableError(f"{label}: match must be a non-empty list of regular expressions")
    for pattern in value:
        if not isinstance(pattern, str) or not pattern:
            raise SpecTableError(f"{label}: match entries must be non-empty strings, got {pattern!r}")
        try:
            compiled = _compile(pattern)
        except re.error as exc:
            raise SpecTableError(f"{label}: match pattern {pattern!r} is not a valid regex: {exc}") from exc
        if compiled.search(""):
            raise SpecTableError(f"{label}: match pattern {pattern!r} matches the empty string, so every name")
    return tuple(value)


def _check_shared_patterns(file: Path, specs: Sequence[GpuSpec]) -> None:
    """Rows may share a pattern only when memory can tell them apart (RTX 3080 10 GB vs 12 GB)."""
    owners: dict[str, GpuSpec] = {}
    for spec in specs:
        for pattern in spec.match:
            other = owners.setdefault(pattern.lower(), spec)
            if other is not spec and other.memory_gib == spec.memory_gib:
                raise SpecTableError(
                    f"{file.name}: rows {other.key!r} and {spec.key!r} share match pattern {pattern!r} "
                    "and the same memory size, so no name could tell them apart"
                )


@lru_cache(maxsize=1024)
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


# ---------------------------------------------------------------------------------------------------------
# Lookup


def match_spec(
    nvml_name: str, memory_total: int | None = None, *, specs: Sequence[GpuSpec] | None = None
) -> GpuSpec | None:
    """The row for a GPU as its driver names it, or None when the table has no such product.

    A row claims the name when one of its `match` patterns is found in it (case-insensitive). Among
    the claimants the most specific wins: the one whose pattern covers the most of the name. When
    `memory_total` (bytes, as NVML reports it) is given, rows whose nominal memory it does not fit are
    dropped first and, of equally specific rows, the one closest in size wins; that is how a name that
    omits the size (or the two RTX 3080s, which share one) resolves. A claimed name whose memory fits
    no row gives None: it is a variant the table does not know. A remaining tie goes to the row listed
    first. `specs` replaces the shipped table (for tests and alternative tables).
    """
    name = " ".join(nvml_name.split())  # imports from text carry stray and doubled spaces
    if not name:
        return None
    table = load_specs() if specs is None else specs
    gib = memory_total / 2**30 if memory_total is not None and memory_total > 0 else None

    best: tuple[tuple[int, float, int], GpuSpec] | None = None
    for index, spec in enumerate(table):
        covered = _coverage(spec, name)
        if not covered:
            continue
        distance = 0.0
        if gib is not None:
            ratio = gib / spec.memory_gib
            if not _MEMORY_FIT[0] <= ratio <= _MEMORY_FIT[1]:
                continue
            distance = abs(math.log(ratio))
        rank = (-covered, distance, index)
        if best is None or rank < best[0]:
            best = (rank, spec)
    return best[1] if best else None


def _coverage(spec: GpuSpec, name: str) -> int:
    """How many characters of `name` the row's best-fitting pattern matches; 0 when none does."""
    longest = 0
    for pattern in spec.match:
        found = _compile(pattern).search(name)
        if found:
            # An empty match scores 0, i.e. no claim: it is no evidence about the name.
            longest = max(longest, found.end() - found.start())
    return longest


def driver_name(spec: GpuSpec) -> str:
    """A name as a driver reports this product ("NVIDIA A100-SXM4-80GB"), one `match_spec` maps back onto this row
    at its nominal memory: for a GPU known only by the row a user chose (an imported `topo -m` names no model)."""
    memory = int(spec.memory_gib * 2**30)
    spelled = []
    for pattern in spec.match:  # the patterns' own spelling, without the regular-expression syntax
        text = re.sub(r"\((\w+ ?)\)\?", r"\1", pattern)  # "(NVIDIA )?" → "NVIDIA "
        text = re.sub(r"\[([^\]])[^\]]*\]", r"\1", text)  # "[- ]" → "-"
        text = re.sub(r"(\w)\?", r"\1", text)  # "SXM4?" → "SXM4"
        spelled.append(text.replace("\\b", "").replace("^", "").replace("$", "").replace("\\", ""))
    candidates = [*spelled, spec.name]
    candidates = [*(c if c.startswith(spec.vendor) else f"{spec.vendor} {c}" for c in candidates), *candidates]
    for name in candidates:
        found = match_spec(name, memory)
        if found is not None and found.key == spec.key:
            return name
    return f"{spec.vendor} {spec.name}"


def spec_by_key(key: str) -> GpuSpec:
    """The row with this key; a typo raises KeyError listing the closest keys."""
    specs = load_specs()
    wanted = key.strip().lower()
    for spec in specs:
        if spec.key == wanted:
            return spec
    keys = [spec.key for spec in specs]
    close = difflib.get_close_matches(wanted, keys, n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(keys)}"
    raise KeyError(f"no GPU spec with key {key!r}{hint}")
