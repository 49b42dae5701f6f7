"""The Topology page's view-model: a machine turned into boxes, nodes and labelled edges to draw.

Plain Python (no Qt), built from an engine `Machine`:

- one box per NUMA node (a CPU socket), with its CPU node; GPUs whose node is
  unknown are grouped by which of them avoid the socket interconnect (SYS);
- PCIe as `nvidia-smi topo -m` implies it: GPUs that reach each other through
  PIX/PXB share a PCIe switch node; GPUs within PHB share a host bridge node,
  NODE means different host bridges of one CPU, SYS crosses to another CPU;
- NVLink edges between GPU pairs, labelled NV# and the bandwidth (links ×
  per-link speed), or spokes to one NVSwitch node for a switched fabric;
- the matrix in `topo -m` codes, and measured bandwidths from calibration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rigpilot.engine.hardware.machine import Gpu, GpuPair, Machine, PciePath, format_cpu_list, short_gpu_name
from rigpilot.engine.hardware.specs import match_spec

# NVLink speed of one link in one direction by generation (GB/s), for GPUs the spec table does not know.
NVLINK_LINK_GBS_BY_GEN = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
# No GPU has more NVLink links than this; a GPU "linked" to peers by more in total must go through NVSwitch.
MAX_PHYSICAL_LINKS = 18
_SWITCHED = (PciePath.PIX, PciePath.PXB)
_SAME_BRIDGE = (PciePath.PIX, PciePath.PXB, PciePath.PHB)


@dataclass
class Node:
    id: str  # "gpu3", "switch0", "bridge1", "cpu0", "nvswitch"
    kind: str  # "gpu" | "switch" | "bridge" | "cpu" | "nvswitch"
    label: str
    box: int | None = None  # index into TopologyGraph.boxes; None for the NVSwitch
    gpu: int | None = None
    tooltip: str = ""
    column: float = 0.0  # horizontal slot within the whole drawing, in GPU widths


@dataclass
class Edge:
    a: str
    b: str
    kind: str  # "nvlink" | "pcie" | "smp"
    label: str = ""
    tooltip: str = ""
    links: int = 0  # NVLink links
    gbs: float | None = None  # the link's bandwidth, each way (NVLink; a GPU's own PCIe link)
    gpus: tuple[int, ...] = ()  # the GPUs whose NVLink (or, on a PCIe edge, PCIe) counters this edge carries


@dataclass
class Box:
    numa: int | None
    label: str
    gpus: list[int] = field(default_factory=list)


@dataclass
class TopologyGraph:
    boxes: list[Box]
    nodes: list[Node]
    edges: list[Edge]
    nvswitch_inferred: bool = False

    @property
    def nvlink_edges(self) -> list[Edge]:
        return [e for e in self.edges if e.kind == "nvlink"]

    @property
    def gpu_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "gpu"]


def _components(nodes: list[int], edges: list[tuple[int, int]]) -> list[list[int]]:
    """Connected groups of `nodes`, each sorted, ordered by their first member."""
    group = {n: {n} for n in nodes}
    for a, b in edges:
        if a in group and b in group and group[a] is not group[b]:
            merged = group[a] | group[b]
            for n in merged:
                group[n] = merged
    unique = {id(g): g for g in group.values()}
    return sorted((sorted(g) for g in unique.values()), key=lambda g: g[0])


# -- NVLink bandwidth ------------------------------------------------------------------------------
def _direct_links(machine: Machine, gpu: Gpu) -> int:
    return sum(p.nvlink_count for p in machine.pairs if gpu.index in p.key and not p.nvswitch)


def _physical_links(machine: Machine, gpu: Gpu) -> int:
    """The GPU's active NVLink links: as reported, else from its pairs (on a switch fabric, one pair's count)."""
    if gpu.nvlink_links:
        return gpu.nvlink_links
    switched, _ = _switched_pairs(machine)
    mine = [p for p in machine.pairs if gpu.index in p.key and p.nvlink_count]
    if any(p.key in switched for p in mine):
        return max(p.nvlink_count for p in mine)
    return sum(p.nvlink_count for p in mine)


def nvlink_link_gbs(machine: Machine, gpu: Gpu) -> tuple[float | None, str]:
    """One link's speed in one direction (GB/s), and where that figure comes from."""
    if gpu.nvlink_link_gbps:
        return gpu.nvlink_link_gbps, "as the driver reports it"
    spec = match_spec(gpu.name, gpu.memory_total)
    links = _physical_links(machine, gpu)
    if spec is not None and spec.nvlink_bandwidth_gbs and links:
        # The spec counts both directions of every link together.
        return (
            spec.nvlink_bandwidth_gbs / 2 / links,
            f"{spec.name} spec: {spec.nvlink_bandwidth_gbs:g} GB/s over {links} links",
        )
    if gpu.nvlink_gen in NVLINK_LINK_GBS_BY_GEN:
        return NVLINK_LINK_GBS_BY_GEN[gpu.nvlink_gen], f"typical of NVLink {gpu.nvlink_gen}"
    return None, "the GPU model is not known, so neither is its link speed"


def _pair_bandwidth(machine: Machine, a: Gpu, b: Gpu, links: int) -> tuple[float | None, str]:
    speed_a, why_a = nvlink_link_gbs(machine, a)
    speed_b, why_b = nvlink_link_gbs(machine, b)
    speeds = [(s, w) for s, w in ((speed_a, why_a), (speed_b, why_b)) if s]
    if not speeds:
        return None, why_a
    speed, why = min(speeds)
    return speed * links, f"{links} link{'s' if links != 1 else ''} × {speed:.1f} GB/s each way ({why})"


def _fmt_gbs(v: float | None) -> str:
    if v is None:
        return "? GB/s"
    return f"{v:.0f} GB/s" if v >= 10 else f"{v:.1f} GB/s"


def _switched_pairs(machine: Machine) -> tuple[set[tuple[int, int]], bool]:
    """Pairs joined through an NVSwitch, and whether that had to be inferred (imported machines)."""
    marked = {p.key for p in machine.pairs if p.nvswitch and p.nvlink_count}
    if marked:
        return marked, False
    over = set()
    for g in machine.gpus:
        physical = g.nvlink_links or MAX_PHYSICAL_LINKS
        if _direct_links(machine, g) > physical:
            over.add(g.index)
    inferred = {p.key for p in machine.pairs if p.nvlink_count and p.a in over and p.b in over}
    return inferred, bool(inferred)


# -- the graph ---------------------------------------------------------------------------------------
def _boxes(machine: Machine) -> list[Box]:
    numa_cpus = {n.id: n.cpus for n in machine.host.numa_nodes}
    known: dict[int, list[int]] = {}
    unknown: list[int] = []
    for g in machine.gpus:
        (known.setdefault(g.numa_node, []) if g.numa_node is not None else unknown).append(g.index)
    boxes = []
    for node, gpus in sorted(known.items()):
        cpus = numa_cpus.get(node) or next((g.cpu_affinity for g in machine.gpus if g.index == gpus[0]), None)
        boxes.append(Box(node, f"NUMA node {node} · CPUs {format_cpu_list(cpus)}", gpus))
    if unknown:
        # Without NUMA ids, GPUs that are SYS to each other sit on different sockets; NVLink pairs often
        # hide their PCIe path, so "not known to be SYS" counts as same socket.
        groups: list[list[int]] = []
        for i in unknown:
            home = next(
                (
                    grp
                    for grp in groups
                    if all((machine.pair(i, j) or GpuPair(i, j)).pcie is not PciePath.SYS for j in grp)
                ),
                None,
            )
            if home is None:
                groups.append([i])
            else:
                home.append(i)
        for n, grp in enumerate(groups):
            label = f"CPU socket {n} (inferred from SYS paths)" if len(groups) > 1 else "CPU (NUMA node unknown)"
            boxes.append(Box(None, label, grp))
    return boxes


def _worst(machine: Machine, gpus: list[int]) -> PciePath | None:
    paths = [p.pcie for p in machine.pairs if p.a in gpus and p.b in gpus and p.pcie is not None]
    return max(paths, key=lambda p: p.rank) if paths else None


def build_graph(machine: Machine) -> TopologyGraph:
    boxes = _boxes(machine)
    nodes, edges = _pcie_tree(machine, boxes)
    edges += _socket_links(machine, boxes)
    nvswitch, spokes, inferred = _nvswitch(machine, nodes)
    if nvswitch is not None:
        nodes.append(nvswitch)
    edges += spokes + _nvlink_pairs(machine)
    return TopologyGraph(boxes, nodes, edges, nvswitch_inferred=inferred)


def _pcie_tree(machine: Machine, boxes: list[Box]) -> tuple[list[Node], list[Edge]]:
    """Per box: its CPU, host bridges (PHB groups), PCIe switches (PIX/PXB groups) and GPUs, left to right."""
    gpus = {g.index: g for g in machine.gpus}
    nodes: list[Node] = []
    edges: list[Edge] = []
    column = 0.0
    # Files such as `nvidia-smi -q` say nothing about PCIe paths; then GPUs hang off the CPU directly.
    known_paths = any(p.pcie is not None for p in machine.pairs)
    for b, box in enumerate(boxes):
        pairs = [p for p in machine.pairs if p.a in box.gpus and p.b in box.gpus]
        box_start = column
        cpu = Node(f"cpu{b}", "cpu", "CPU" if box.numa is None else f"CPU · NUMA {box.numa}", box=b, tooltip=box.label)
        nodes.append(cpu)
        for bridge_gpus in _components(box.gpus, [p.key for p in pairs if p.pcie in _SAME_BRIDGE]):
            parent = cpu.id
            if known_paths:
                bridge = Node(
                    f"bridge{sum(n.kind == 'bridge' for n in nodes)}", "bridge", "Host bridge", box=b,
                    column=column + (len(bridge_gpus) - 1) / 2,
                    tooltip="PCIe host bridge (root complex) of the CPU; GPUs below it are PHB to each other",
                )  # fmt: skip
                nodes.append(bridge)
                edges.append(Edge(bridge.id, cpu.id, "pcie", tooltip="PCIe root port to the CPU"))
                parent = bridge.id
            switched = [p.key for p in pairs if p.pcie in _SWITCHED]
            for members in _components(bridge_gpus, switched):
                up = parent
                if len(members) > 1:
                    switch = _switch_node(
                        machine, members, f"switch{sum(n.kind == 'switch' for n in nodes)}", b, column
                    )
                    nodes.append(switch)
                    edges.append(Edge(switch.id, parent, "pcie"))
                    up = switch.id
                for i in members:
                    g = gpus[i]
                    label = f"GPU {i}\n{_clip(gpu_model(g), 17)}"
                    nodes.append(Node(f"gpu{i}", "gpu", label, box=b, gpu=i, column=column, tooltip=_gpu_tooltip(g)))
                    edges.append(Edge(f"gpu{i}", up, "pcie", tooltip=_pcie_link(g, known_paths), gpus=(i,),
                                      gbs=pcie_link_gbs(g)))  # fmt: skip
                    column += 1
        cpu.column = (box_start + column - 1) / 2
    return nodes, edges


def _switch_node(machine: Machine, members: list[int], node_id: str, box: int, column: float) -> Node:
    code = _worst(machine, members)
    what = "PCIe switch" if code is PciePath.PIX else "PCIe switches"
    return Node(
        node_id, "switch", f"{what} ({code.value if code else '?'})", box=box,
        column=column + (len(members) - 1) / 2,
        tooltip=f"GPU {', '.join(map(str, members))}: {code.description if code else 'path not known'}",
    )  # fmt: skip


def _pcie_link(g: Gpu, known_paths: bool) -> str:
    gen, width = g.pcie_gen_current or g.pcie_gen_max, g.pcie_width_current or g.pcie_width_max
    text = f"PCIe Gen{gen} x{width}" if gen and width else "PCIe"
    return text if known_paths else f"{text} (path not known)"


def _socket_links(machine: Machine, boxes: list[Box]) -> list[Edge]:
    """The SMP interconnect between two CPUs, where GPUs under them are SYS to each other."""
    edges = []
    for b1 in range(len(boxes)):
        for b2 in range(b1 + 1, len(boxes)):
            crossing = (
                (machine.pair(a, c) or GpuPair(a, c)).pcie is PciePath.SYS
                for a in boxes[b1].gpus
                for c in boxes[b2].gpus
            )
            if any(crossing):
                edges.append(Edge(f"cpu{b1}", f"cpu{b2}", "smp", "SMP interconnect", PciePath.SYS.description))
    return edges


def _nvswitch(machine: Machine, nodes: list[Node]) -> tuple[Node | None, list[Edge], bool]:
    """The NVSwitch node and one spoke per GPU on it, or (None, [], False) without a switch fabric."""
    switched, inferred = _switched_pairs(machine)
    if not switched:
        return None, [], False
    members = sorted({i for k in switched for i in k})
    tooltip = "Every GPU reaches every other at its full NVLink bandwidth through the switch fabric"
    if inferred:
        tooltip += "; inferred: these GPUs report more NVLink peers than a GPU has links"
    node = Node(
        "nvswitch", "nvswitch", "NVSwitch" + (" (inferred)" if inferred else ""),
        column=sum(_column_of(nodes, i) for i in members) / len(members), tooltip=tooltip,
    )  # fmt: skip
    spokes = []
    for i in members:
        gpu = machine.gpu(i)
        links = gpu.nvlink_links or max(p.nvlink_count for p in machine.pairs if i in p.key and p.key in switched)
        speed, why = nvlink_link_gbs(machine, gpu)
        gbs = speed * links if speed else None
        detail = f" × {speed:.1f} GB/s each way ({why})" if speed else f"; {why}"
        label = f"NV{links} · {_fmt_gbs(gbs)}"
        tip = f"GPU {i} to the NVSwitch: {links} links{detail}"
        spokes.append(Edge(f"gpu{i}", "nvswitch", "nvlink", label, tip, links=links, gbs=gbs, gpus=(i,)))
    return node, spokes, inferred


def _nvlink_pairs(machine: Machine) -> list[Edge]:
    """Direct NVLink (bridges, hybrid cube meshes) between GPU pairs that are not on a switch fabric."""
    switched, _ = _switched_pairs(machine)
    edges = []
    for p in machine.pairs:
        if p.nvlink_count and p.key not in switched:
            gbs, why = _pair_bandwidth(machine, machine.gpu(p.a), machine.gpu(p.b), p.nvlink_count)
            label, tip = f"NV{p.nvlink_count} · {_fmt_gbs(gbs)}", f"GPU {p.a} ↔ GPU {p.b}: {why}"
            edges.append(
                Edge(f"gpu{p.a}", f"gpu{p.b}", "nvlink", label, tip, links=p.nvlink_count, gbs=gbs, gpus=p.key)
            )
    return edges


def _column_of(nodes: list[Node], index: int) -> float:
    return next(n.column for n in nodes if n.gpu == index)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def name_unknown(g: Gpu) -> bool:
    """Whether the source named no model for this GPU (`topo -m` alone lists none)."""
    return "name" in g.unavailable


def gpu_model(g: Gpu) -> str:
    """The model as a GPU's box shows it: 'RTX 4090', or 'name unknown'."""
    return "name unknown" if name_unknown(g) else short_gpu_name(g.name)


def gpu_title(g: Gpu) -> str:
    """'GPU 0 (NVIDIA GeForce RTX 4090)', or 'GPU 0 (name unknown: topo -m lists no model)'."""
    if name_unknown(g):
        why = "topo -m lists no model" if "topo -m" in g.unavailable["name"] else g.unavailable["name"]
        return f"GPU {g.index} (name unknown: {why})"
    return f"GPU {g.index} ({g.name})"


def machine_title(machine: Machine, *, origin: bool = True) -> str:
    """The machine's label, with GPUs no source named counted as such rather than under a placeholder name;
    without `origin`, an imported machine's files are left out (for headlines: file names can be long)."""
    unknown = [g for g in machine.gpus if name_unknown(g)]
    if not unknown or len(unknown) != len(machine.gpus):
        if not origin and machine.source.value == "imported":
            return f"imported: {machine.summary_name}"
        return machine.label
    n = len(unknown)
    what = f"{n} GPU{'s' if n != 1 else ''}, model{'s' if n != 1 else ''} unknown (topo -m lists none)"
    kind = {"imported": "imported", "simulated": "simulated"}.get(
        machine.source.value, machine.host.hostname or "this machine"
    )
    return f"{kind}: {what}" + (f" ({machine.origin})" if machine.origin and origin else "")


def _gpu_tooltip(g: Gpu) -> str:
    lines = [gpu_title(g), f"Bus {g.pci_bus_id or 'n/a'}"]
    if g.memory_total:
        lines.append(f"{g.memory_total / 2**30:.0f} GiB")
    if g.nvlink_links:
        lines.append(f"{g.nvlink_links} NVLink links")
    lines.append("Click to select; Space toggles the focused GPU")
    return "\n".join(lines)


# -- live throughput -----------------------------------------------------------------------------------
# GT/s per lane and line-code efficiency of each PCIe generation (8b/10b up to Gen2, 128b/130b after; Gen6
# PAM4 with FLIT encoding is close to 1).
_PCIE_GEN = {1: (2.5, 0.8), 2: (5.0, 0.8), 3: (8.0, 128 / 130), 4: (16.0, 128 / 130), 5: (32.0, 128 / 130),
             6: (64.0, 242 / 256)}  # fmt: skip


def pcie_link_gbs(gpu: Gpu) -> float | None:
    """A GPU's PCIe link bandwidth in GB/s each way, at its current generation and width (max when idle)."""
    gen = gpu.pcie_gen_current or gpu.pcie_gen_max
    width = gpu.pcie_width_current or gpu.pcie_width_max
    if gen not in _PCIE_GEN or not width:
        return None
    gts, efficiency = _PCIE_GEN[gen]
    return gts * efficiency * width / 8


def pcie_throughput(edge: Edge, sample: dict[str, Any]) -> tuple[float, float] | None:
    """(received, sent) bytes/s over a GPU's own PCIe link, from its PCIe counters; None if not reported."""
    if edge.kind != "pcie" or len(edge.gpus) != 1:
        return None
    g = next((g for g in sample.get("gpus", []) if g.get("index") == edge.gpus[0]), None) or {}
    rx, tx = g.get("pcie_rx_bps"), g.get("pcie_tx_bps")
    if not isinstance(rx, int | float) or not isinstance(tx, int | float):
        return None
    return float(rx), float(tx)


def edge_throughput(machine: Machine, edge: Edge, sample: dict[str, Any]) -> tuple[float, float] | None:
    """Estimated bytes/s over an NVLink edge, each way, from the GPUs' NVLink counters; None if not reported.

    Counters are per GPU, not per link, so a GPU with several NVLink peers has its traffic shared
    among them by link count: an estimate, said so in the label.
    """
    by_gpu = {g["index"]: g for g in sample.get("gpus", [])}
    if len(edge.gpus) == 1:  # a spoke to the NVSwitch carries all of that GPU's NVLink traffic
        g = by_gpu.get(edge.gpus[0]) or {}
        if g.get("nvlink_tx_bps") is None or g.get("nvlink_rx_bps") is None:
            return None
        return float(g["nvlink_tx_bps"]), float(g["nvlink_rx_bps"])
    a, b = edge.gpus
    ga, gb = by_gpu.get(a) or {}, by_gpu.get(b) or {}
    if ga.get("nvlink_tx_bps") is None or gb.get("nvlink_tx_bps") is None:
        return None
    share_a = edge.links / max(_direct_links(machine, machine.gpu(a)), edge.links)
    share_b = edge.links / max(_direct_links(machine, machine.gpu(b)), edge.links)
    return float(ga["nvlink_tx_bps"]) * share_a, float(gb["nvlink_tx_bps"]) * share_b


# -- the matrix ---------------------------------------------------------------------------------------
@dataclass
class Matrix:
    headers: list[str]  # columns: GPUs, NICs, CPU Affinity, NUMA Affinity
    rows: list[str]  # GPUs then NICs
    cells: list[list[str]]


def topo_matrix(machine: Machine) -> Matrix:
    """The `nvidia-smi topo -m` table, cell for cell (as engine.hardware.topology.render_matrix prints it)."""
    gpus, nics = machine.gpus, machine.nics
    headers = [f"GPU{g.index}" for g in gpus] + [n.label for n in nics] + ["CPU Affinity", "NUMA Affinity"]
    rows, cells = [], []
    for g in gpus:
        row = []
        for h in gpus:
            p = machine.pair(g.index, h.index)
            row.append("X" if g.index == h.index else (p.topo_code if p else "N/A"))
        row += [n.gpu_paths.get(g.index, "N/A") for n in nics]
        row += [format_cpu_list(g.cpu_affinity), "N/A" if g.numa_node is None else str(g.numa_node)]
        rows.append(f"GPU{g.index}")
        cells.append(row)
    for n in nics:
        rows.append(n.label)
        cells.append([n.gpu_paths.get(g.index, "N/A") for g in gpus] + ["X" if m is n else "" for m in nics] + ["", ""])
    return Matrix(headers, rows, cells)


def code_category(code: str) -> str:
    """Colour class of a matrix cell: nvlink, switch (PIX/PXB), bridge (PHB), node (NODE), sys, self or unknown."""
    code = code.strip()
    if code.startswith("NV"):
        return "nvlink"
    return {"PIX": "switch", "PXB": "switch", "PHB": "bridge", "NODE": "node", "SYS": "sys", "X": "self"}.get(
        code, "unknown"
    )


# -- measured bandwidth (calibration) ---------------------------------------------------------------------
def measured_bandwidth(machine_dict: dict[str, Any] | None) -> dict[tuple[int, int], float]:
    """GPU pair -> measured bus bandwidth (GB/s), from a machine dict's `calibration` entry.

    The hook for calibration results: the same shape as the planner's Calibration.to_dict()
    (`{"bus_bandwidth_gbs": {"0,1": 21.5, ...}}`); groups of two GPUs become heat-map cells.
    """
    calibration = (machine_dict or {}).get("calibration") or {}
    out: dict[tuple[int, int], float] = {}
    for key, gbs in (calibration.get("bus_bandwidth_gbs") or {}).items():
        try:
            members = sorted(int(x) for x in str(key).split(",") if x.strip())
            value = float(gbs)
        except (TypeError, ValueError):
            continue
        if len(members) == 2 and value > 0:
            out[(members[0], members[1])] = value
    return out
