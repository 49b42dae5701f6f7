"""Read `nvidia-smi -q` (indented text) and `nvidia-smi -q -x` (XML) into a Machine with per-GPU details.

Both formats are first turned into the same small tree of named nodes, then one table per format says
where each `Gpu` field lives, so both readers share the value handling: "N/A", "[Not Supported]" and the
like become unavailable with that reason, never zero. Neither format holds the topology.

Driver versions moved and renamed sections over the years (e.g. "Power Readings" / "Enforced Power Limit"
before 535, "GPU Power Readings" / "Current Power Limit" after), so a field may list several places.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from xml.parsers import expat

from rigpilot.engine.hardware.importers.common import MachineImportError, mark_unavailable
from rigpilot.engine.hardware.machine import Gpu, Host, Machine, Source

__all__ = ["NOTE_NO_TOPOLOGY", "looks_like_text", "looks_like_xml", "parse_query_text", "parse_query_xml"]

NOTE_NO_TOPOLOGY = "nvidia-smi -q has no topology: GPU links are unknown (import `nvidia-smi topo -m` too)"
_TEXT = "nvidia-smi -q"
_XML = "nvidia-smi -q -x"
_MIB = 1024 * 1024

_BANNER = re.compile(r"=+\s*NVSMI LOG\s*=+")
# "Key    : value"; a GPU section header ("GPU 00000000:41:00.0") has colons but none after a space.
_ENTRY = re.compile(r"(?P<key>\S.*?)\s+:(?:\s+(?P<value>.*?))?\s*")
_GPU_SECTION = re.compile(r"GPU\s+([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)")
# Words nvidia-smi prints instead of a value; they become the reason the field is unavailable.
_NOT_A_VALUE = {
    "n/a",
    "not supported",
    "unknown error",
    "unknown",
    "insufficient permissions",
    "gpu requires reset",
    "gpu is lost",
    "not available",
}


def looks_like_text(text: str) -> bool:
    head = text[:4096]
    if any(_BANNER.fullmatch(line.strip()) for line in head.splitlines()):
        return True
    # A file trimmed by hand may have lost the banner; the GPU count line and a GPU section still tell.
    return re.search(r"^Attached GPUs\s+:", head, re.MULTILINE) is not None and any(
        _GPU_SECTION.fullmatch(line.strip()) for line in text.splitlines()
    )


def looks_like_xml(text: str) -> bool:
    head = text.lstrip("\ufeff \t\r\n")[:4096]
    return head.startswith("<") and "<nvidia_smi_log" in head


def parse_query_text(text: str, origin: str | None = None) -> Machine:
    """Read `nvidia-smi -q` text output."""
    root = _text_tree(text)
    sections = [node for node in root.children if _GPU_SECTION.fullmatch(node.key)]
    if not sections:
        if "No devices were found" in text:
            raise MachineImportError("nvidia-smi found no GPUs on that machine ('No devices were found')")
        raise MachineImportError("no GPU sections (lines like 'GPU 00000000:41:00.0') in the nvidia-smi -q output")
    return _build_machine(root, sections, _TEXT_FORMAT, origin)


def parse_query_xml(text: str, origin: str | None = None) -> Machine:
    """Read `nvidia-smi -q -x` XML output; entity declarations are refused (no entity-expansion bombs)."""
    document = _xml_tree(text)
    if len(document.children) != 1 or document.children[0].key != "nvidia_smi_log":
        tag = document.children[0].key if document.children else "nothing"
        raise MachineImportError(f"the XML root is <{tag}>, not <nvidia_smi_log> (expected `nvidia-smi -q -x` output)")
    root = document.children[0]
    sections = [node for node in root.children if node.key == "gpu"]
    if not sections:
        raise MachineImportError("no <gpu> elements in the nvidia-smi -q -x output")
    return _build_machine(root, sections, _XML_FORMAT, origin)


# -- one tree for both formats ------------------------------------------------


@dataclass
class _Node:
    key: str
    value: str = ""
    line: int = 0
    attrs: dict[str, str] = field(default_factory=dict)
    children: list[_Node] = field(default_factory=list)

    def find(self, path: tuple[str, ...]) -> _Node | None:
        node = self
        for key in path:
            wanted = _fold(key)
            child = next((c for c in node.children if _fold(c.key) == wanted), None)
            if child is None:
                return None
            node = child
        return node


def _fold(key: str) -> str:
    # Drivers differ in case ("ECC Mode" / "Ecc Mode") and spacing of keys.
    return " ".join(key.split()).casefold()


def _text_tree(text: str) -> _Node:
    root = _Node("")
    stack: list[tuple[int, _Node]] = [(-1, root)]
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.expandtabs(4).rstrip()
        if not line.strip() or _BANNER.fullmatch(line.strip()):
            continue
        indent = len(line) - len(line.lstrip())
        m = _ENTRY.fullmatch(line.strip())
        node = (
            _Node(key=m.group("key"), value=m.group("value") or "", line=lineno)
            if m
            else _Node(line.strip(), line=lineno)
        )
        while stack[-1][0] >= indent:
            stack.pop()
        stack[-1][1].children.append(node)
        stack.append((indent, node))
    return root


class _EntityRefused(Exception):
    def __init__(self, name: str, line: int) -> None:
        super().__init__(name)
        self.name, self.line = name, line


def _xml_tree(text: str) -> _Node:
    parser = expat.ParserCreate()
    # Never read the external DTD named in nvidia-smi's DOCTYPE, nor any parameter entities.
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.buffer_text = True
    document = _Node("#document")
    stack = [document]

    def start(tag: str, attrs: dict[str, str]) -> None:
        node = _Node(key=tag, line=parser.CurrentLineNumber, attrs=attrs)
        stack[-1].children.append(node)
        stack.append(node)

    def end(_tag: str) -> None:
        node = stack.pop()
        node.value = node.value.strip()

    def data(chars: str) -> None:
        stack[-1].value += chars

    def refuse_entity(name: str, *_: Any) -> None:
        # nvidia-smi never declares entities; a file that does may be an entity-expansion bomb.
        raise _EntityRefused(name, parser.CurrentLineNumber)

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = data
    parser.EntityDeclHandler = refuse_entity
    try:
        parser.Parse(text, True)
    except _EntityRefused as e:
        raise MachineImportError(
            f"line {e.line}: refusing XML that declares entities (<!ENTITY {e.name} ...>); nvidia-smi never writes them"
        ) from None
    except expat.ExpatError as e:
        raise MachineImportError(f"line {e.lineno}: not well-formed XML ({expat.ErrorString(e.code)})") from None
    return document


# -- where each field lives ---------------------------------------------------

_Places = dict[str, tuple[tuple[str, ...], ...]]

_TEXT_PLACES: _Places = {
    "name": (("Product Name",),),
    "uuid": (("GPU UUID",),),
    "pci_bus_id": (("PCI", "Bus Id"),),
    "memory_total": (("FB Memory Usage", "Total"),),
    "power_limit_w": (
        ("GPU Power Readings", "Current Power Limit"),
        ("Power Readings", "Enforced Power Limit"),
        ("Power Readings", "Current Power Limit"),
        ("Power Readings", "Power Limit"),
    ),
    "max_sm_clock_mhz": (("Max Clocks", "SM"),),
    "max_mem_clock_mhz": (("Max Clocks", "Memory"),),
    "pcie_gen_current": (("PCI", "GPU Link Info", "PCIe Generation", "Current"),),
    "pcie_gen_max": (("PCI", "GPU Link Info", "PCIe Generation", "Max"),),
    "pcie_width_current": (("PCI", "GPU Link Info", "Link Width", "Current"),),
    "pcie_width_max": (("PCI", "GPU Link Info", "Link Width", "Max"),),
    "persistence_mode": (("Persistence Mode",),),
    "mig_enabled": (("MIG Mode", "Current"),),
    "ecc_enabled": (("ECC Mode", "Current"),),
}
_TEXT_HOST: _Places = {
    "driver_version": (("Driver Version",),),
    "cuda_driver_version": (("CUDA Version",),),
}

_XML_PLACES: _Places = {
    "name": (("product_name",),),
    "uuid": (("uuid",),),
    "pci_bus_id": (("pci", "pci_bus_id"),),
    "memory_total": (("fb_memory_usage", "total"),),
    "power_limit_w": (
        ("gpu_power_readings", "current_power_limit"),
        ("power_readings", "enforced_power_limit"),
        ("power_readings", "current_power_limit"),
        ("power_readings", "power_limit"),
    ),
    "max_sm_clock_mhz": (("max_clocks", "sm_clock"),),
    "max_mem_clock_mhz": (("max_clocks", "mem_clock"),),
    "pcie_gen_current": (("pci", "pci_gpu_link_info", "pcie_gen", "current_link_gen"),),
    "pcie_gen_max": (("pci", "pci_gpu_link_info", "pcie_gen", "max_link_gen"),),
    "pcie_width_current": (("pci", "pci_gpu_link_info", "link_widths", "current_link_width"),),
    "pcie_width_max": (("pci", "pci_gpu_link_info", "link_widths", "max_link_width"),),
    "persistence_mode": (("persistence_mode",),),
    "mig_enabled": (("mig_mode", "current_mig"),),
    "ecc_enabled": (("ecc_mode", "current_ecc"),),
}
_XML_HOST: _Places = {
    "driver_version": (("driver_version",),),
    "cuda_driver_version": (("cuda_version",),),
}


@dataclass(frozen=True)
class _Format:
    source: str  # as named in reasons: "not in nvidia-smi -q"
    gpu: _Places
    host: _Places
    attached: tuple[str, ...]  # the GPU count nvidia-smi reports, which a `-i` run does not reduce


_TEXT_FORMAT = _Format(_TEXT, _TEXT_PLACES, _TEXT_HOST, ("Attached GPUs",))
_XML_FORMAT = _Format(_XML, _XML_PLACES, _XML_HOST, ("attached_gpus",))


def _number(unit: str) -> Callable[[str], float]:
    pattern = re.compile(rf"(\d+(?:\.\d+)?)\s*{unit}", re.IGNORECASE)

    def convert(value: str) -> float:
        m = pattern.fullmatch(value)
        if not m:
            raise ValueError(value)
        return float(m.group(1))

    return convert


def _switch(value: str) -> bool:
    states = {"enabled": True, "disabled": False}
    if value.casefold() not in states:
        raise ValueError(value)
    return states[value.casefold()]


def _text_value(value: str) -> str:
    if not value:
        raise ValueError(value)
    return value


_MiB, _W, _MHz, _x = _number("MiB"), _number("W"), _number("MHz"), _number("x")

_CONVERT: dict[str, Callable[[str], Any]] = {
    "name": _text_value,
    "uuid": _text_value,
    "pci_bus_id": _text_value,
    "driver_version": _text_value,
    "cuda_driver_version": _text_value,
    "memory_total": lambda v: int(_MiB(v)) * _MIB,
    "power_limit_w": _W,
    "max_sm_clock_mhz": lambda v: int(_MHz(v)),
    "max_mem_clock_mhz": lambda v: int(_MHz(v)),
    "pcie_gen_current": int,
    "pcie_gen_max": int,
    "pcie_width_current": lambda v: int(_x(v)),
    "pcie_width_max": lambda v: int(_x(v)),
    "persistence_mode": _switch,
    "mig_enabled": _switch,
    "ecc_enabled": _switch,
}


def _fill(obj: Gpu | Host, section: _Node, places: _Places, source: str, notes: list[str]) -> None:
    """Set each field of `obj` from the first place in `section` that holds a value, or say why none does."""
    for name, paths in places.items():
        reason: str | None = None  # the first one found wins: it comes from the place current drivers use
        for path in paths:
            node = section.find(path)
            if node is None:
                continue
            raw = node.value.strip()
            bare = raw.strip("[]").strip()
            if not bare or bare.casefold() in _NOT_A_VALUE:
                reason = reason or f"{bare or 'empty'} in {source}"
                continue
            try:
                setattr(obj, name, _CONVERT[name](bare))
            except ValueError:
                reason = reason or f"unreadable value {raw!r} in {source}"
                notes.append(f"line {node.line}: could not read {'/'.join(path)} = {raw!r}")
                continue
            obj.unavailable.pop(name, None)
            break
        else:
            obj.unavailable[name] = reason or f"not in {source}"


def _build_machine(root: _Node, sections: list[_Node], fmt: _Format, origin: str | None) -> Machine:
    notes = [NOTE_NO_TOPOLOGY]
    host = Host()
    _fill(host, root, fmt.host, fmt.source, notes)
    mark_unavailable(host, f"not in {fmt.source}")

    gpus: list[Gpu] = []
    for index, section in enumerate(sections):
        # nvidia-smi lists GPUs in its own index order (PCI bus order), which the minor number need not follow.
        gpu = Gpu(index=index, name="")
        _fill(gpu, section, fmt.gpu, fmt.source, notes)
        if gpu.pci_bus_id is None:
            bus_id = section.attrs.get("id") or (m.group(1) if (m := _GPU_SECTION.fullmatch(section.key)) else None)
            if bus_id:
                gpu.pci_bus_id = bus_id
                gpu.unavailable.pop("pci_bus_id", None)
        if not gpu.name:
            gpu.name = f"GPU {index} (unnamed in {fmt.source})"
        mark_unavailable(gpu, f"not in {fmt.source}")
        gpus.append(gpu)

    attached = root.find(fmt.attached)
    if attached is not None and attached.value.isdigit() and int(attached.value) != len(gpus):
        notes.append(
            f"the file describes {len(gpus)} of the {int(attached.value)} attached GPUs "
            "(saved with -i?); GPUs are numbered in the order they appear"
        )
    return Machine(source=Source.IMPORTED, host=host, gpus=gpus, origin=origin, notes=notes)
