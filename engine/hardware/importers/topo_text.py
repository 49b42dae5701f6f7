"""Read the matrix that `nvidia-smi topo -m` prints.

The reader is tolerant about layout, because real files come tab- or space-separated, hand-realigned,
with ANSI underline escapes around the header, with warnings above and a legend (or none) below,
from drivers that name NIC columns `NIC0` (with a "NIC Legend:") or after the device (`mlx5_0`).
It is strict about content: every row must have its cells, every cell must be a known code and the
matrix must be symmetric, otherwise `MachineImportError` names the line and what is wrong.

Cells are separated by whitespace: no cell contains a space, only the column titles do
("CPU Affinity", "NUMA Affinity", "GPU NUMA ID"). A row with fewer cells than the header has columns
is read by position when the text is space-aligned (no tabs): each cell goes to the header column it
lies under, so an empty cell (a blank CPU Affinity inside some SLURM allocations) stays empty instead
of shifting the cells after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rigpilot.engine.hardware.importers.common import MachineImportError, mark_unavailable
from rigpilot.engine.hardware.machine import (
    Gpu,
    GpuPair,
    Host,
    Machine,
    Nic,
    NumaNode,
    PciePath,
    Source,
    format_cpu_list,
    parse_cpu_list,
)

__all__ = ["GPU_PLACEHOLDER_NAME", "NOTE_NO_GPU_NAMES", "looks_like_topo", "parse_topo"]

GPU_PLACEHOLDER_NAME = "GPU (from topo -m)"
NOTE_NO_GPU_NAMES = "topo -m does not name the GPUs: import `nvidia-smi -q` too for names, memory and clocks"
_NOT_IN_TOPO = "not in topo -m"

# Real escapes (ESC[4m) and what is left of them after a copy from a web page or terminal that drops ESC ([4m).
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b|\[[0-9;]*m")
_GPU_LABEL = re.compile(r"GPU(\d+)")
_NIC_LABEL = re.compile(r"NIC\d+")
# Row and column labels: GPU3, NIC12, and device names on old drivers (mlx5_0, mlx5_bond_0); all end in a digit.
_DEVICE_LABEL = re.compile(r"[A-Za-z][\w.:-]*\d")
_TITLES = {
    "cpu": re.compile(r"CPU\s+Affinity", re.IGNORECASE),
    "numa": re.compile(r"NUMA\s+Affinity", re.IGNORECASE),
    "gpu_numa": re.compile(r"GPU\s+NUMA\s+ID", re.IGNORECASE),
}
# An unknown column title runs to the next tab or wide gap.
_OTHER_TITLE = re.compile(r"(.+?)(?:\t|\s{2,}|$)")
_CELL = re.compile(r"X|PIX|PXB|PHB|NODE|SYS|SOC|NV([1-9]\d*)|N/A")
_NIC_LEGEND_ENTRY = re.compile(r"\s*(NIC\d+)\s*:\s*(\S+)\s*")
_CELL_CODES = "X, PIX, PXB, PHB, NODE, SYS, NV#, N/A"


def looks_like_topo(text: str) -> bool:
    """True when `text` holds a topo -m header, even if the matrix under it turns out broken."""
    lines = _clean_lines(text)
    i = _find_header(lines)
    if i is None:
        return False
    if i + 1 < len(lines) and lines[i + 1].split()[:1] == ["GPU0"]:
        return True
    try:
        labels, titles = _read_header(lines[i], i + 1)
    except MachineImportError:
        return True  # a header with a duplicated column is still a topo header; parse_topo says what is wrong
    # A lone "GPU0 ..." line could be any text; several device columns or an affinity title make it a header.
    return len(labels) > 1 or any(title in _TITLES for title in titles)


def parse_topo(text: str, origin: str | None = None) -> Machine:
    """Read `nvidia-smi topo -m` output into an imported Machine (GPU names stay placeholders)."""
    lines = _clean_lines(text)
    if not any(line.strip() for line in lines):
        raise MachineImportError("the file is empty")
    header = _find_header(lines)
    if header is None:
        raise MachineImportError("no `nvidia-smi topo -m` matrix found (no header line starting with GPU0)")
    matrix = _read_matrix(lines, header)
    return _build_machine(matrix, _nic_legend(lines[matrix.end :]), origin)


# -- the matrix ---------------------------------------------------------------


@dataclass
class _Row:
    label: str
    line: int  # 1-based, for messages
    codes: list[str]  # normalised matrix cells, one per column label
    extra: dict[str, str]  # affinity columns by key ("cpu", "numa", "gpu_numa") or by unknown title


@dataclass
class _Matrix:
    labels: list[str]
    rows: list[_Row]
    end: int  # index of the first line after the matrix
    notes: list[str] = field(default_factory=list)


def _clean_lines(text: str) -> list[str]:
    return [_ESCAPES.sub("", line) for line in text.splitlines()]


def _find_header(lines: list[str]) -> int | None:
    for i, line in enumerate(lines):
        tokens = line.split()
        # The GPU0 row also starts with GPU0, but its next cell is the X of the diagonal.
        if tokens and tokens[0] == "GPU0" and (len(tokens) == 1 or tokens[1].upper() != "X"):
            return i
    return None


def _read_header(line: str, lineno: int) -> tuple[list[str], list[str]]:
    """Split the header into device labels and the titles of the columns after the matrix."""
    labels, titles, _ = _header_columns(line, lineno)
    return labels, titles


def _header_columns(line: str, lineno: int) -> tuple[list[str], list[str], list[int]]:
    """Device labels, the titles after them, and where each column (labels, then titles) starts in `line`."""
    labels: list[str] = []
    starts: list[int] = []
    end = 0
    for m in re.finditer(r"\S+", line):
        if not _DEVICE_LABEL.fullmatch(m.group()):
            break
        if m.group() in labels:
            raise MachineImportError(f"line {lineno}: column '{m.group()}' appears twice in the header")
        labels.append(m.group())
        starts.append(m.start())
        end = m.end()
    for label in labels:
        if label.startswith("GPU") and not _GPU_LABEL.fullmatch(label):
            raise MachineImportError(f"line {lineno}: cannot read GPU column '{label}'")

    titles: list[str] = []
    pos = end
    while line[pos:].strip():
        pos += len(line[pos:]) - len(line[pos:].lstrip())
        title, length = _next_title(line[pos:])
        titles.append(title)
        starts.append(pos)
        pos += length
    return labels, titles, starts


def _cells_by_position(line: str, starts: list[int]) -> list[str] | None:
    """The cells of a space-aligned row after its label, one per header column ("" where a cell is blank).

    Each cell goes to the column its text overlaps most (columns run from one header start to the next),
    so cells may sit a little left or right of their title, as hand-aligned and centred ones do. None when
    two cells fall under one column: then position says nothing reliable.
    """
    tokens = list(re.finditer(r"\S+", line))[1:]
    bounds = [*starts[1:], max(len(line), starts[-1]) + 1]
    cells = [""] * len(starts)
    taken = [False] * len(starts)
    for tok in tokens:
        overlap = [min(tok.end(), bounds[c]) - max(tok.start(), starts[c]) for c in range(len(starts))]
        c = max(range(len(starts)), key=lambda i: (overlap[i], -i))
        if overlap[c] <= 0:
            c = max(i for i in range(len(starts)) if starts[i] <= tok.start()) if tok.start() >= starts[0] else 0
        if taken[c]:
            return None
        cells[c], taken[c] = tok.group(), True
    return cells


def _next_title(rest: str) -> tuple[str, int]:
    """The column title at the start of `rest` (a key of _TITLES when known) and how many characters it spans."""
    for key, pattern in _TITLES.items():
        m = pattern.match(rest)
        if m:
            return key, m.end()
    m = _OTHER_TITLE.match(rest)
    assert m is not None  # `rest` is not empty, so at least one character matches
    return m.group(1).strip(), m.end()


def _read_matrix(lines: list[str], header: int) -> _Matrix:
    labels, titles, starts = _header_columns(lines[header], header + 1)
    n = len(labels)
    matrix = _Matrix(labels=labels, rows=[], end=header + 1 + n)
    for title in titles:
        if title not in _TITLES:
            matrix.notes.append(f"ignored the column '{title}' of topo -m")

    for r, label in enumerate(labels):
        i = header + 1 + r
        lineno = i + 1
        if i >= len(lines):
            raise MachineImportError(f"line {lineno}: expected the row for '{label}', found the end of the file")
        tokens = lines[i].split()
        if not tokens:
            raise MachineImportError(f"line {lineno}: expected the row for '{label}', found a blank line")
        if tokens[0] != label:
            raise MachineImportError(f"line {lineno}: expected the row for '{label}', found '{tokens[0]}'")
        cells = tokens[1:]
        is_gpu = _GPU_LABEL.fullmatch(label) is not None
        # NIC rows end after the matrix; GPU rows carry the affinity columns too.
        allowed = [n + len(titles)] if is_gpu else [n, n + len(titles)]
        if len(cells) < allowed[-1] and "\t" not in lines[i] + lines[header]:
            placed = _cells_by_position(lines[i], starts)
            if placed is not None and all(placed[:n]):
                cells = placed if any(placed[n:]) or is_gpu else placed[:n]
        if len(cells) not in allowed:
            raise MachineImportError(f"line {lineno}: expected {allowed[-1]} cells after '{label}', found {len(cells)}")
        codes = [_read_cell(cell, label, labels[c], lineno, r == c, matrix.notes) for c, cell in enumerate(cells[:n])]
        extra = dict(zip(titles, cells[n:], strict=False))
        matrix.rows.append(_Row(label=label, line=lineno, codes=codes, extra=extra))

    for r in range(n):
        for c in range(r + 1, n):
            a, b = matrix.rows[r], matrix.rows[c]
            if a.codes[c] != b.codes[r]:
                raise MachineImportError(
                    f"line {b.line}: '{b.label}' to '{a.label}' is {b.codes[r]} "
                    f"but line {a.line} says '{a.label}' to '{b.label}' is {a.codes[c]}"
                )
    return matrix


def _read_cell(cell: str, row: str, column: str, lineno: int, diagonal: bool, notes: list[str]) -> str:
    code = cell.upper()
    if not _CELL.fullmatch(code):
        raise MachineImportError(
            f"line {lineno}: unknown cell '{cell}' in column '{column}' of row '{row}' (expected {_CELL_CODES})"
        )
    if diagonal and code != "X":
        raise MachineImportError(f"line {lineno}: '{row}' to itself must be X, found '{cell}'")
    if not diagonal and code == "X":
        raise MachineImportError(f"line {lineno}: X between '{row}' and '{column}' (X only marks a device to itself)")
    if code == "SOC":
        # Drivers before ~384 called the inter-socket hop SOC; newer ones print SYS for the same thing.
        note = "read the old code SOC as SYS"
        if note not in notes:
            notes.append(note)
        return "SYS"
    return code


def _nic_legend(lines: list[str]) -> dict[str, str]:
    legend: dict[str, str] = {}
    for line in lines:
        m = _NIC_LEGEND_ENTRY.fullmatch(line)
        if m:
            legend[m.group(1)] = m.group(2)
    return legend


# -- the machine --------------------------------------------------------------


def _build_machine(matrix: _Matrix, legend: dict[str, str], origin: str | None) -> Machine:
    notes = [NOTE_NO_GPU_NAMES, *matrix.notes]
    gpu_rows = {int(m.group(1)): row for row in matrix.rows if (m := _GPU_LABEL.fullmatch(row.label))}
    gpus = [_build_gpu(index, row, notes) for index, row in sorted(gpu_rows.items())]
    column = {label: c for c, label in enumerate(matrix.labels)}

    pairs: list[GpuPair] = []
    for a, row in sorted(gpu_rows.items()):
        for b, other in sorted(gpu_rows.items()):
            if a < b:
                pairs.append(_build_pair(a, b, row.codes[column[other.label]], notes))

    nics: list[Nic] = []
    nic_rows = [row for row in matrix.rows if not _GPU_LABEL.fullmatch(row.label)]
    for row in nic_rows:
        # Old drivers name the column after the device itself; newer ones say NICn and list the device below.
        device = legend.get(row.label) if _NIC_LABEL.fullmatch(row.label) else row.label
        paths = {index: row.codes[column[gpu_row.label]] for index, gpu_row in sorted(gpu_rows.items())}
        nics.append(Nic(label=row.label, device=device, gpu_paths=paths))
    unnamed = [nic.label for nic in nics if nic.device is None]
    if unnamed and not legend:
        notes.append("no NIC Legend in topo -m: the NICs' device names are unknown")
    elif unnamed:
        notes.append(f"the NIC Legend of topo -m does not list {', '.join(unnamed)}: their device names are unknown")

    host = _build_host(gpus, pairs, notes)
    return Machine(source=Source.IMPORTED, host=host, gpus=gpus, pairs=pairs, nics=nics, origin=origin, notes=notes)


def _build_gpu(index: int, row: _Row, notes: list[str]) -> Gpu:
    gpu = Gpu(index=index, name=GPU_PLACEHOLDER_NAME)
    gpu.unavailable["name"] = "topo -m does not name GPUs"

    cpu = row.extra.get("cpu")
    if cpu is None:
        gpu.na("cpu_affinity", "no CPU Affinity column in topo -m")
    elif cpu == "":
        gpu.na("cpu_affinity", "blank in topo -m (a SLURM allocation may hide the CPUs)")
    elif cpu.upper() == "N/A":
        gpu.na("cpu_affinity", "N/A in topo -m")
    else:
        try:
            gpu.cpu_affinity = parse_cpu_list(cpu)
        except ValueError:
            raise MachineImportError(
                f"line {row.line}: CPU Affinity '{cpu}' of '{row.label}' is not a CPU list like 0-11,24-35"
            ) from None

    numa = row.extra.get("numa")
    if numa is None:
        gpu.na("numa_node", "no NUMA Affinity column in topo -m (older driver)")
    elif numa == "":
        gpu.na("numa_node", "blank in topo -m")
    elif numa.upper() == "N/A":
        gpu.na("numa_node", "N/A in topo -m (the system reports no NUMA node for this GPU)")
    else:
        try:
            nodes = parse_cpu_list(numa)
        except ValueError:
            raise MachineImportError(
                f"line {row.line}: NUMA Affinity '{numa}' of '{row.label}' is not a NUMA node number"
            ) from None
        if len(nodes) == 1:
            gpu.numa_node = nodes[0]
        else:
            gpu.na("numa_node", f"topo -m gives several NUMA nodes ({numa})")

    gpu_numa = row.extra.get("gpu_numa")
    if gpu_numa and gpu_numa.upper() != "N/A":
        if not gpu_numa.isdigit():
            raise MachineImportError(f"line {row.line}: GPU NUMA ID '{gpu_numa}' of '{row.label}' is not a number")
        # Coherent systems (Grace Hopper) expose GPU memory as a NUMA node of its own.
        notes.append(f"GPU {index} memory is NUMA node {gpu_numa} (GPU NUMA ID in topo -m)")

    mark_unavailable(gpu, _NOT_IN_TOPO)
    return gpu


def _build_pair(a: int, b: int, code: str, notes: list[str]) -> GpuPair:
    if code.startswith("NV"):
        return GpuPair(a=a, b=b, nvlink_count=int(code[2:]))
    if code == "N/A":
        notes.append(f"GPU {a} – GPU {b}: the path is N/A in topo -m")
        return GpuPair(a=a, b=b)
    return GpuPair(a=a, b=b, pcie=PciePath(code))


def _build_host(gpus: list[Gpu], pairs: list[GpuPair], notes: list[str]) -> Host:
    cpus_by_node: dict[int, set[int]] = {}
    for gpu in gpus:
        if gpu.numa_node is not None:
            cpus_by_node.setdefault(gpu.numa_node, set()).update(gpu.cpu_affinity or [])
    host = Host(numa_nodes=[NumaNode(id=node, cpus=sorted(cpus)) for node, cpus in sorted(cpus_by_node.items())])
    if host.numa_nodes:
        notes.append(
            "NUMA nodes and their CPUs are those the GPUs are attached to; nodes without a GPU are not in topo -m"
        )
    elif all("no NUMA Affinity column" in g.unavailable.get("numa_node", "") for g in gpus):
        groups = {tuple(g.cpu_affinity) for g in gpus if g.cpu_affinity}
        if len(groups) > 1 and _disjoint(groups):
            listed = " and ".join(format_cpu_list(list(group)) for group in sorted(groups))
            notes.append(
                f"no NUMA Affinity column (older driver), but the GPUs' CPU affinities form {len(groups)} separate "
                f"groups ({listed}): probably {len(groups)} NUMA nodes"
            )
    host.sockets = _guess_sockets(host.numa_nodes, notes)
    if host.sockets is None:
        host.unavailable["sockets"] = _NOT_IN_TOPO
    mark_unavailable(host, _NOT_IN_TOPO)
    return host


def _disjoint(groups: set[tuple[int, ...]]) -> bool:
    seen: set[int] = set()
    for group in groups:
        if seen & set(group):
            return False
        seen |= set(group)
    return True


def _guess_sockets(nodes: list[NumaNode], notes: list[str]) -> int | None:
    """Two NUMA nodes with disjoint, equal-sized CPU sets are almost always two sockets: guess so, and say so.

    One node can hide a second socket that has no GPU, and more than two nodes usually mean one CPU split
    into several (AMD NPS4, Intel SNC), so no guess is made then.
    """
    if len(nodes) != 2:
        return None
    a, b = (set(n.cpus) for n in nodes)
    if not a or a & b or len(a) != len(b):
        return None
    notes.append(
        f"guessed 2 CPU sockets from 2 NUMA nodes with separate CPUs ({format_cpu_list(sorted(a))} and "
        f"{format_cpu_list(sorted(b))}); one CPU split into 2 NUMA nodes (AMD NPS2) would look the same"
    )
    return 2
