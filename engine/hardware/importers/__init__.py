"""Build a `Machine` from saved `nvidia-smi` outputs, so a user can plan for a machine not in front of them.

Four kinds of file are understood, recognised by their content (never by their name):

- `nvidia-smi topo -m`: how the GPUs (and NICs) are wired, CPU and NUMA affinity;
- `nvidia-smi -q` and `nvidia-smi -q -x`: per-GPU details (name, memory, clocks, PCIe) and the driver;
- `nvidia-smi nvlink --status`: active NVLink links and their speed.

Several files about one machine merge into one `Machine`. Anything unreadable raises
`MachineImportError`, whose message names the file and, where it can, the line.
"""

from __future__ import annotations

import dataclasses
import re
from enum import StrEnum
from pathlib import Path

from rigpilot.engine.given_path import PathRefused, open_given_file
from rigpilot.engine.hardware.importers import nvlink_status, smi_query, topo_text
from rigpilot.engine.hardware.importers.common import MachineImportError
from rigpilot.engine.hardware.machine import Gpu, Host, Machine

__all__ = [
    "FileKind", "MachineImportError", "decode_text", "import_machine", "import_text", "sniff", "unknown_model_gpus",
    "with_gpu_model",
]  # fmt: skip

# nvidia-smi output is a few hundred kB at most; anything far larger is not one.
_MAX_BYTES = 64 * 1024 * 1024
# Tabs, line ends and ANSI escapes (ESC) are normal in saved terminal output; other control characters mean binary data.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f]")


class FileKind(StrEnum):
    TOPO = "nvidia-smi topo -m"
    SMI_QUERY = "nvidia-smi -q"
    SMI_XML = "nvidia-smi -q -x"
    NVLINK = "nvidia-smi nvlink --status"


def sniff(text: str) -> FileKind | None:
    """Which nvidia-smi output `text` is, judged from its content; None when it is none of them."""
    if smi_query.looks_like_xml(text):
        return FileKind.SMI_XML
    if smi_query.looks_like_text(text):
        return FileKind.SMI_QUERY
    if nvlink_status.looks_like_nvlink_status(text):
        return FileKind.NVLINK
    if topo_text.looks_like_topo(text):
        return FileKind.TOPO
    return None


def import_text(text: str, origin: str) -> Machine:
    """Read one pasted or loaded nvidia-smi output. `origin` names it in messages and in `Machine.origin`."""
    _check_text(text, origin)
    return _merge([_parse(text, origin)])


def import_machine(paths: list[Path] | Path) -> Machine:
    """Read one or more files about the same machine and merge them into one `Machine`.

    Topology comes from `topo -m`, GPU details from `-q` / `-q -x`, NVLink links from `nvlink --status`.
    Files whose GPU counts or identities disagree raise `MachineImportError`.
    """
    if isinstance(paths, str | Path):
        paths = [paths]
    if not paths:
        raise MachineImportError("no files to import")
    return _merge([_parse(_read(Path(p)), Path(p).name) for p in paths])


def decode_text(data: bytes, origin: str) -> str:
    """Turn a saved file's bytes into text, refusing what is not text."""
    # Windows PowerShell's `nvidia-smi > file` writes UTF-16 with a byte-order mark.
    utf16 = data.startswith((b"\xff\xfe", b"\xfe\xff"))
    try:
        text = data.decode("utf-16" if utf16 else "utf-8-sig")
    except UnicodeDecodeError as e:
        raise MachineImportError(
            f"{origin}: not a text file (byte 0x{data[e.start]:02x} at offset {e.start} is not "
            f"{'UTF-16' if utf16 else 'UTF-8'}); "
            "expected nvidia-smi output saved as text"
        ) from None
    _check_text(text, origin)
    return text


# -- reading ------------------------------------------------------------------


@dataclasses.dataclass
class _Parsed:
    origin: str
    kind: FileKind
    machine: Machine | None = None
    nvlink: list[nvlink_status.NvlinkGpuStatus] | None = None


def _read(path: Path) -> str:
    try:
        with open_given_file(path, "nvidia-smi output") as f:
            data = f.read(_MAX_BYTES + 1)
    except PathRefused as e:
        raise MachineImportError(str(e)) from None
    except OSError as e:
        raise MachineImportError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > _MAX_BYTES:
        raise MachineImportError(
            f"{path.name}: larger than {_MAX_BYTES // 2**20} MiB, too large to be nvidia-smi output"
        )
    return decode_text(data, path.name)


def _check_text(text: str, origin: str) -> None:
    if not text.strip():
        raise MachineImportError(f"{origin}: the file is empty")
    bad = _CONTROL.search(text)
    if bad:
        lineno = text.count("\n", 0, bad.start()) + 1
        raise MachineImportError(
            f"{origin}: line {lineno}: binary data (control character 0x{ord(bad.group()):02x}); "
            "expected nvidia-smi text output"
        )


def _parse(text: str, origin: str) -> _Parsed:
    kind = sniff(text)
    if kind is None:
        raise MachineImportError(
            f"{origin}: not a recognised nvidia-smi output "
            "(expected `nvidia-smi topo -m`, `nvidia-smi -q`, `nvidia-smi -q -x` or `nvidia-smi nvlink --status`)"
        )
    try:
        if kind is FileKind.TOPO:
            return _Parsed(origin, kind, machine=topo_text.parse_topo(text, origin))
        if kind is FileKind.SMI_QUERY:
            return _Parsed(origin, kind, machine=smi_query.parse_query_text(text, origin))
        if kind is FileKind.SMI_XML:
            return _Parsed(origin, kind, machine=smi_query.parse_query_xml(text, origin))
        return _Parsed(origin, kind, nvlink=nvlink_status.parse_nvlink_status(text))
    except MachineImportError as e:
        raise MachineImportError(f"{origin}: {e}") from None


# -- merging ------------------------------------------------------------------

# Fields that identify a GPU: two files that disagree on them describe different GPUs (or machines).
_IDENTITY = ("name", "uuid", "pci_bus_id", "memory_total")
_GPU_DATA_FIELDS = [f.name for f in dataclasses.fields(Gpu) if f.name not in ("index", "unavailable")]
_HOST_DATA_FIELDS = [f.name for f in dataclasses.fields(Host) if f.name not in ("numa_nodes", "unavailable")]


def _merge(parsed: list[_Parsed]) -> Machine:
    topo = [p for p in parsed if p.kind is FileKind.TOPO]
    details = [p for p in parsed if p.kind in (FileKind.SMI_QUERY, FileKind.SMI_XML)]
    nvlinks = [p for p in parsed if p.kind is FileKind.NVLINK]
    if len(topo) > 1:
        raise MachineImportError(
            f"{topo[0].origin} and {topo[1].origin} are both `topo -m` outputs; import one machine at a time"
        )

    # The topology file, if any, is the base: -q files add GPU details to it, nvlink files add links.
    base = (topo + details + nvlinks)[0]
    if base.machine is not None:
        machine = base.machine
    else:
        machine = nvlink_status.machine_from_nvlink(base.nvlink or [], base.origin)
    for p in details:
        if p is not base:
            assert p.machine is not None
            _merge_details(machine, base.origin, p.machine, p.origin)
    for p in nvlinks:
        if p is not base:
            nvlink_status.merge_nvlink(machine, p.nvlink or [], p.origin)

    if topo:
        machine.notes = [n for n in machine.notes if n != smi_query.NOTE_NO_TOPOLOGY]
    if all("name" not in g.unavailable for g in machine.gpus):
        machine.notes = [n for n in machine.notes if n != topo_text.NOTE_NO_GPU_NAMES]
    machine.notes = list(dict.fromkeys(machine.notes))
    machine.origin = ", ".join(p.origin for p in parsed)
    return machine


def _merge_details(machine: Machine, base_origin: str, other: Machine, origin: str) -> None:
    """Fill `machine`'s GPUs and host from a `-q` / `-q -x` reading of the same machine."""
    if len(other.gpus) != len(machine.gpus):
        raise MachineImportError(
            f"{origin} shows {len(other.gpus)} GPUs but {base_origin} shows {len(machine.gpus)}; "
            "are they from the same machine?"
        )
    # Both files number GPUs the way nvidia-smi does (PCI bus order), so position matches position.
    for mine, theirs in zip(sorted(machine.gpus, key=lambda g: g.index), other.gpus, strict=True):
        for name in _GPU_DATA_FIELDS:
            old, new = getattr(mine, name), getattr(theirs, name)
            if new is None or name in theirs.unavailable:  # unavailable but set: a placeholder name
                continue
            # A GPU whose name is unavailable carries a placeholder (topo -m names no GPU).
            if old is None or (name == "name" and "name" in mine.unavailable):
                setattr(mine, name, new)
                mine.unavailable.pop(name, None)
            elif old != new and name in _IDENTITY:
                raise MachineImportError(
                    f"GPU {mine.index}: {name} is {old!r} in {base_origin} but {new!r} in {origin}; "
                    "are they from the same machine?"
                )
            elif old != new:
                machine.notes.append(
                    f"GPU {mine.index}: {name} is {old!r} in {base_origin}, {new!r} in {origin}; kept the first"
                )
    for name in _HOST_DATA_FIELDS:
        old, new = getattr(machine.host, name), getattr(other.host, name)
        if new is None:
            continue
        if old is None:
            setattr(machine.host, name, new)
            machine.host.unavailable.pop(name, None)
        elif old != new:
            machine.notes.append(f"host {name} is {old!r} in {base_origin}, {new!r} in {origin}; kept the first")
    machine.notes.extend(other.notes)


def unknown_model_gpus(machine: Machine) -> list[int]:
    """The GPUs a `topo -m` file alone described: it names no model, so their memory is unknown."""
    return [g.index for g in machine.gpus if "name" in g.unavailable or not g.memory_total]


def with_gpu_model(machine: Machine, key: str) -> Machine:
    """The imported machine with the GPU model a user chose (a key of the GPU spec table) for the GPUs its files
    left unnamed: their name and memory from the table's row. GPUs the files named keep what the files said."""
    from rigpilot.engine.errors import UserError
    from rigpilot.engine.hardware.specs import driver_name, spec_by_key

    try:
        spec = spec_by_key(key)
    except KeyError as e:
        raise UserError(str(e.args[0]), reason="unknown_gpu_model", key=key) from None
    unknown = unknown_model_gpus(machine)
    if not unknown:
        raise UserError(
            f"the files name every GPU's model already ({machine.summary_name}); a GPU model is for a topo -m file "
            "imported on its own",
            reason="gpu_model_known", key=key,
        )  # fmt: skip
    name = driver_name(spec)  # so every lookup of the table (match_spec) lands on this row
    gpus = [
        dataclasses.replace(
            g, name=name, memory_total=int(spec.memory_gib * 2**30),
            unavailable={k: v for k, v in g.unavailable.items() if k not in ("name", "memory_total")},
        ) if g.index in unknown else g
        for g in machine.gpus
    ]
    note = f"GPU {', '.join(map(str, unknown))}: {spec.name} as chosen by the user (topo -m names no model)"
    notes = [n for n in machine.notes if not n.startswith("topo -m does not name the GPUs")]
    return dataclasses.replace(machine, gpus=gpus, notes=[*notes, note])
