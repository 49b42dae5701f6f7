"""Several machines: the link between nodes, and the one machine a multi-node plan is searched on.

A multi-node plan spans `nodes` identical nodes (the plan JSON's contract: `parallelism.gpu_indices` are
each node's GPUs, the degrees are global, ranks are node-major). The search sees the nodes as one machine
whose GPU `node * G + k` is the k-th selected GPU of node `node` (G GPUs per node), each node keeping its
own links inside, and the link between nodes as a NIC (`NodeLink`) that the GPUs of a node share.

Nodes must carry the same GPUs (the selected indices, the same model on each): a plan of identical ranks over mixed cards is
bound by the smallest anyway, and torchrun starts the same number of ranks on every node. Mixed nodes
are refused in one line rather than planned for the smallest, so a plan never hides a slower node.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Machine, short_gpu_name
from rigpilot.engine.planner.settings import DEFAULT_LINK, MAX_NODES, ref, refusal

# Share of a NIC's line rate that NCCL's collectives reach, assumed (plans list it as such): over RoCE or
# TCP sockets NCCL's bus bandwidth on 25-100 GbE reaches roughly 70-90% of the line rate; over InfiniBand
# (RDMA, GPUDirect) nccl-tests report 92-97% (about 23-24 GB/s busbw on HDR's 25 GB/s).
ETHERNET_EFFICIENCY = 0.8
INFINIBAND_EFFICIENCY = 0.92
# One hop's latency as a collective sees it, assumed: kernel TCP/RoCE a few tens of µs, InfiniBand a few µs.
ETHERNET_LATENCY_S = 25e-6
INFINIBAND_LATENCY_S = 5e-6


@dataclass(frozen=True)
class NodeLink:
    """The link between nodes: its published line rate per NIC, and what NCCL reaches of it."""

    name: str  # the --internode value: "25gbe", "ndr", or "custom"
    label: str  # "25 GbE", "InfiniBand NDR (400 Gb/s)"
    gbits: float  # published line rate of one NIC, one direction, Gb/s
    nics: int = 1  # NICs per node (GPUs of a node spread their traffic over them)
    efficiency: float = ETHERNET_EFFICIENCY
    latency_s: float = ETHERNET_LATENCY_S
    source: str = "spec"  # "spec": the published figure; "given": the user's own GB/s

    @property
    def gbs(self) -> float:
        """Achievable bandwidth of one node's NICs together, one direction, GB/s."""
        return self.gbits / 8 * self.nics * self.efficiency

    def to_dict(self) -> dict[str, Any]:
        """What a plan's `parallelism.internode` holds (see engine.planner.plan)."""
        return {
            "name": self.name, "label": self.label, "gbits_per_nic": self.gbits, "nics": self.nics,
            "efficiency": self.efficiency, "gbs": round(self.gbs, 4), "latency_s": self.latency_s, "source": self.source,
        }  # fmt: skip


# Published line rates, one direction, per NIC: IEEE 802.3ae (10GBASE), 802.3by (25GBASE), 802.3ba/cd (100GBASE),
# 802.3cd/bs (200/400GBASE); InfiniBand Trade Association: 4x HDR 200 Gb/s, 4x NDR 400 Gb/s, 4x XDR 800 Gb/s.
# "ndr-8": a DGX/HGX H100 node's eight ConnectX-7 NDR ports, one per GPU (NVIDIA DGX H100 user guide).
NODE_LINKS: dict[str, NodeLink] = {
    link.name: link
    for link in (
        NodeLink("10gbe", "10 GbE", 10.0),
        NodeLink("25gbe", "25 GbE", 25.0),
        NodeLink("100gbe", "100 GbE", 100.0),
        NodeLink("200gbe", "200 GbE", 200.0),
        NodeLink("400gbe", "400 GbE", 400.0),
        NodeLink("hdr", "InfiniBand HDR (200 Gb/s)", 200.0, 1, INFINIBAND_EFFICIENCY, INFINIBAND_LATENCY_S),
        NodeLink("ndr", "InfiniBand NDR (400 Gb/s)", 400.0, 1, INFINIBAND_EFFICIENCY, INFINIBAND_LATENCY_S),
        NodeLink("ndr-8", "InfiniBand NDR, 8 NICs per node (400 Gb/s each)", 400.0, 8, INFINIBAND_EFFICIENCY, INFINIBAND_LATENCY_S),
        NodeLink("xdr", "InfiniBand XDR (800 Gb/s)", 800.0, 1, INFINIBAND_EFFICIENCY, INFINIBAND_LATENCY_S),
    )
}
MAX_CUSTOM_GBS = 10_000.0
_CUSTOM = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:gb/?s|gbps)?\s*$", re.IGNORECASE)


def node_link(value: str | float | int | None) -> NodeLink:
    """The link a `--internode` value names: a key of NODE_LINKS, or a measured bandwidth in GB/s ("12.5")."""
    if value is None:
        return NODE_LINKS[DEFAULT_LINK]
    text = str(value).strip().lower()
    if text in NODE_LINKS:
        return NODE_LINKS[text]
    match = _CUSTOM.match(text) if not isinstance(value, bool) else None
    if match is not None:
        gbs = float(match[1])
        if 0 < gbs <= MAX_CUSTOM_GBS:
            # A figure the user measured (nccl-tests' busbw between two nodes) is what NCCL reaches: taken whole.
            return NodeLink("custom", f"a {gbs:g} GB/s link", gbs * 8, 1, 1.0, ETHERNET_LATENCY_S, "given")
    raise refusal(
        "{internode} takes one of {links} or a bandwidth in GB/s between 0 and {most:,.0f} like 12.5 (got {got!r})",
        reason="not_a_link", fields={"setting": "internode", "value": str(value)[:40], "choices": list(NODE_LINKS)},
        internode=ref("internode"), links=", ".join(NODE_LINKS), most=MAX_CUSTOM_GBS, got=str(value)[:40],
    )


def check_nodes(nodes: Any) -> int:
    if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= MAX_NODES:
        raise refusal("{nodes} must be a whole number from 1 to {most} (got {got!r})", reason="out_of_range",
                      fields={"setting": "nodes", "value": str(nodes)[:40], "lo": 1, "hi": MAX_NODES},
                      nodes=ref("nodes"), most=MAX_NODES, got=str(nodes)[:40])  # fmt: skip
    return nodes


@dataclass(frozen=True)
class Cluster:
    """The nodes a search plans for, seen as one machine (`machine`), and how to map its GPUs back."""

    machine: Machine  # GPU node * per_node + k is `local[k]` of node `node`
    local: list[int]  # the selected GPU indices, the same on every node
    nodes: int
    link: NodeLink
    label: str

    @property
    def per_node(self) -> int:
        return len(self.local)

    def node_of(self, g: int) -> int:
        return g // self.per_node

    def to_local(self, g: int) -> int:
        return self.local[g % self.per_node]

    def node_gpus(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))


def build_cluster(machines: list[Machine], local: list[int], link: NodeLink) -> Cluster:
    """One machine of `len(machines)` nodes, each contributing its GPUs `local` (already checked on the first)."""
    first = machines[0]
    want = [short_gpu_name(first.gpu(i).name) for i in local]
    for n, m in enumerate(machines[1:], start=2):
        present = {g.index for g in m.gpus}
        differs = [i for k, i in enumerate(local) if i in present and short_gpu_name(m.gpu(i).name) != want[k]]
        if differs or not present & set(local):
            raise UserError(
                f"node {n} ({m.label}) has {_count(m, [g.index for g in m.gpus])}, node 1 has "
                f"{_count(first, [g.index for g in first.gpus])}: a multi-node plan needs identical nodes; plan each machine on its own"
            )
        missing = [i for i in local if i not in present]
        if missing:
            raise UserError(f"node {n} ({m.label}) has no GPU {missing[0]}: every node needs the GPUs the plan uses")
    per = len(local)
    gpus, pairs = [], []
    for n, m in enumerate(machines):
        pos = {i: n * per + k for k, i in enumerate(local)}
        for i in local:
            g = m.gpu(i)
            numa = (g.numa_node or 0) + 1000 * n  # each node's NUMA nodes are its own (host bandwidth is per node)
            gpus.append(dataclasses.replace(g, index=pos[i], numa_node=numa))
        for p in m.pairs:
            if p.a in pos and p.b in pos:
                a, b = sorted((pos[p.a], pos[p.b]))
                pairs.append(dataclasses.replace(p, a=a, b=b))
    rams = [m.host.memory_total for m in machines]
    # Host RAM counts for all nodes together: each node holds its own ranks' share of the need.
    host = dataclasses.replace(first.host, memory_total=None if None in rams else min(rams) * len(machines))  # type: ignore[operator]
    combined = dataclasses.replace(first, gpus=gpus, pairs=pairs, nics=[], host=host)
    same = all(m.label == first.label for m in machines)
    label = f"{len(machines)} × {first.label}" if same else f"{len(machines)} nodes: " + "; ".join(m.label for m in machines)
    return Cluster(combined, list(local), len(machines), link, label)


def _count(m: Machine, indices: list[int]) -> str:
    names = [short_gpu_name(m.gpu(i).name) for i in indices]
    return ", ".join(f"{names.count(n)} × {n}" for n in dict.fromkeys(names))
