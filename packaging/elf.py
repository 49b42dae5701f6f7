"""The libraries an ELF file asks the dynamic loader for (its DT_NEEDED entries), read without binutils.

The Qt trim (packaging/qt_trim.py) keeps a library exactly when something kept needs it, so it reads
each binary's dynamic section itself: the build then works wherever Python does, readelf or not.
Only what x86-64 Linux wheels contain is understood: 64-bit little-endian ELF.
"""

from __future__ import annotations

import struct
from pathlib import Path

_PT_DYNAMIC = 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB = 0, 1, 5
_PT_LOAD = 1


class NotElf(ValueError):
    """The file is not a 64-bit little-endian ELF object."""


def is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def needed(path: Path) -> list[str]:
    """The DT_NEEDED names of `path`, in the order the loader reads them; [] for a static object."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise NotElf(f"{path} is not a 64-bit little-endian ELF file")
    phoff, phentsize, phnum = struct.unpack_from("<Q", data, 0x20)[0], *struct.unpack_from("<HH", data, 0x36)
    loads: list[tuple[int, int, int]] = []  # (virtual address, file offset, file size)
    dynamic: tuple[int, int] | None = None
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return []
    entries: list[tuple[int, int]] = []
    offset, end = dynamic[0], dynamic[0] + dynamic[1]
    while offset + 16 <= end:
        tag, value = struct.unpack_from("<qQ", data, offset)
        if tag == _DT_NULL:
            break
        entries.append((tag, value))
        offset += 16
    strtab_addr = next((v for t, v in entries if t == _DT_STRTAB), None)
    if strtab_addr is None:
        return []
    # DT_STRTAB is a virtual address: the PT_LOAD segment that maps it gives its place in the file.
    strtab = next((off + strtab_addr - va for va, off, size in loads if va <= strtab_addr < va + size), None)
    if strtab is None:
        raise NotElf(f"{path}: its string table lies outside every loaded segment")
    names = []
    for tag, value in entries:
        if tag == _DT_NEEDED:
            start = strtab + value
            names.append(data[start : data.index(b"\0", start)].decode())
    return names
