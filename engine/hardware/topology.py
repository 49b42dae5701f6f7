"""Reading a machine's wiring: NVLink islands, shared PCIe switches, socket crossings.

Also renders the matrix in `nvidia-smi topo -m` notation, so users see the
notation they already know, followed by the same facts in plain words.
"""

from __future__ import annotations

from dataclasses import dataclass

from rigpilot.engine.hardware.machine import P2P, PCIE_LEGEND, GpuPair, Machine, PciePath, format_cpu_list


def _components(nodes: list[int], edges: list[tuple[int, int]]) -> list[list[int]]:
    parent = {n: n for n in nodes}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


@dataclass
class TopologySummary:
    nvlink_islands: list[list[int]]  # groups of 2+ GPUs joined by NVLink (directly or through NVSwitch)
    nvswitch: bool
    switch_groups: list[list[int]]  # groups of 2+ GPUs behind a common PCIe switch (PIX/PXB)
    cross_socket_pairs: list[tuple[int, int]]  # SYS pairs
    p2p_ok_pairs: list[tuple[int, int]]
    p2p_unsupported_pairs: list[tuple[int, int]]
    p2p_unknown_pairs: list[tuple[int, int]]
    numa_groups: dict[int, list[int]]  # NUMA node -> GPUs

    def to_dict(self) -> dict:
        return {
            "nvlink_islands": self.nvlink_islands,
            "nvswitch": self.nvswitch,
            "switch_groups": self.switch_groups,
            "cross_socket_pairs": [list(p) for p in self.cross_socket_pairs],
            "p2p_ok_pairs": [list(p) for p in self.p2p_ok_pairs],
            "p2p_unsupported_pairs": [list(p) for p in self.p2p_unsupported_pairs],
            "p2p_unknown_pairs": [list(p) for p in self.p2p_unknown_pairs],
            "numa_groups": {str(k): v for k, v in self.numa_groups.items()},
        }


def summarize(machine: Machine) -> TopologySummary:
    idx = [g.index for g in machine.gpus]
    nv = [p.key for p in machine.pairs if p.nvlink_count > 0]
    sw = [p.key for p in machine.pairs if p.pcie in (PciePath.PIX, PciePath.PXB)]
    numa: dict[int, list[int]] = {}
    for g in machine.gpus:
        if g.numa_node is not None:
            numa.setdefault(g.numa_node, []).append(g.index)
    return TopologySummary(
        nvlink_islands=[c for c in _components(idx, nv) if len(c) > 1],
        nvswitch=any(p.nvswitch for p in machine.pairs),
        switch_groups=[c for c in _components(idx, sw) if len(c) > 1],
        cross_socket_pairs=[p.key for p in machine.pairs if p.pcie is PciePath.SYS],
        p2p_ok_pairs=[p.key for p in machine.pairs if _p2p(p) is P2P.OK],
        p2p_unsupported_pairs=[p.key for p in machine.pairs if _p2p(p) is P2P.UNSUPPORTED],
        p2p_unknown_pairs=[p.key for p in machine.pairs if _p2p(p) is P2P.UNKNOWN],
        numa_groups=numa,
    )


def _p2p(p: GpuPair) -> P2P:
    """A pair counts as P2P-capable only when both directions work."""
    if P2P.UNSUPPORTED in (p.p2p_read, p.p2p_write):
        return P2P.UNSUPPORTED
    if p.p2p_read is P2P.OK and p.p2p_write is P2P.OK:
        return P2P.OK
    return P2P.UNKNOWN


def _fmt_pairs(pairs: list[tuple[int, int]], limit: int = 8) -> str:
    text = ", ".join(f"{a}–{b}" for a, b in pairs[:limit])
    return text + (f" and {len(pairs) - limit} more" if len(pairs) > limit else "")


def _fmt_group(g: list[int]) -> str:
    return "GPU " + ", ".join(str(i) for i in g)


def describe(machine: Machine) -> list[str]:
    """The topology in plain sentences, for `rigpilot topo` and the GUI."""
    s = summarize(machine)
    n = len(machine.gpus)
    lines: list[str] = []
    if n < 2:
        lines.append("One GPU: nothing to connect." if n == 1 else "No GPUs.")
        return lines
    if s.nvswitch:
        fabric = s.nvlink_islands[0]
        links = min(p.nvlink_count for p in machine.pairs if p.nvswitch)
        lines.append(f"NVSwitch fabric: {_fmt_group(fabric)} reach each other at NV{links} (all-to-all).")
    elif s.nvlink_islands:
        parts = []
        for isl in s.nvlink_islands:
            counts = sorted({p.nvlink_count for p in machine.pairs if p.nvlink_count and p.a in isl and p.b in isl})
            parts.append(f"{_fmt_group(isl)} (NV{'/NV'.join(str(c) for c in counts)})")
        lines.append(f"NVLink islands: {'; '.join(parts)}.")
        outside = [g.index for g in machine.gpus if not any(g.index in i for i in s.nvlink_islands)]
        if outside:
            lines.append(f"No NVLink: {_fmt_group(outside)}.")
    else:
        lines.append("No NVLink: all GPU-to-GPU traffic goes over PCIe.")
    if s.switch_groups:
        lines.append("Share a PCIe switch: " + "; ".join(_fmt_group(g) for g in s.switch_groups) + ".")
    if s.cross_socket_pairs:
        lines.append(
            f"Cross CPU sockets (SYS, through QPI/UPI/xGMI): {len(s.cross_socket_pairs)} of {len(machine.pairs)} pairs"
            f" ({_fmt_pairs(s.cross_socket_pairs)})."
        )
    if len(s.numa_groups) > 1:
        lines.append("NUMA nodes: " + "; ".join(f"node {k}: {_fmt_group(v)}" for k, v in sorted(s.numa_groups.items())) + ".")
    total = len(machine.pairs)
    if len(s.p2p_ok_pairs) == total:
        lines.append("P2P (direct GPU-to-GPU copies): supported between all pairs.")
    elif len(s.p2p_unsupported_pairs) == total:
        lines.append("P2P (direct GPU-to-GPU copies): not supported: every transfer is staged through host memory.")
    elif len(s.p2p_unknown_pairs) == total:
        lines.append("P2P support: unknown (not in the source).")
    else:
        if s.p2p_ok_pairs:
            lines.append(f"P2P supported: {_fmt_pairs(s.p2p_ok_pairs)}.")
        if s.p2p_unsupported_pairs:
            lines.append(f"P2P not supported: {_fmt_pairs(s.p2p_unsupported_pairs)} (staged through host memory).")
    return lines


def render_matrix(machine: Machine) -> str:
    """The GPU (and NIC) matrix as `nvidia-smi topo -m` prints it, with its legend."""
    gpus = machine.gpus
    heads = [f"GPU{g.index}" for g in gpus] + [n.label for n in machine.nics]
    rows: list[list[str]] = []
    for g in gpus:
        cells = []
        for h in gpus:
            p = machine.pair(g.index, h.index)
            cells.append(" X " if g.index == h.index else (p.topo_code if p else "N/A"))
        cells += [n.gpu_paths.get(g.index, "N/A") for n in machine.nics]
        numa = "N/A" if g.numa_node is None else str(g.numa_node)
        rows.append([f"GPU{g.index}", *cells, format_cpu_list(g.cpu_affinity), numa])
    for n in machine.nics:
        cells = [n.gpu_paths.get(g.index, "N/A") for g in gpus] + [" X " if m is n else "" for m in machine.nics]
        rows.append([n.label, *cells])
    header = ["", *heads, "CPU Affinity", "NUMA Affinity"]
    widths = [max(len(r[i]) if i < len(r) else 0 for r in [header, *rows]) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=False)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
    out += ["", "Legend:", ""]
    out += [f"  {k:<4} = {v}" for k, v in PCIE_LEGEND.items()]
    nic_devices = [n for n in machine.nics if n.device and n.device != n.label]
    if nic_devices:
        out += ["", "NIC Legend:", ""] + [f"  {n.label}: {n.device}" for n in nic_devices]
    return "\n".join(out)
