"""How fast each GPU computes and how fast GPUs reach each other, for the step-time model.

Compute: the spec table's dense peak for the dtype times an efficiency prior for
the GPU's architecture, unless the user measured matmul throughput. Links: per
pair, NVLink (NV# links × that generation's per-link speed, or the full NVSwitch
bandwidth), PCIe peer-to-peer, through host memory where P2P is off (data is
copied into host memory and out again: about half of PCIe), or across CPU
sockets (SYS). A ring collective runs at the speed of its slowest hop, so a
group's bandwidth is the binding link of the best ring through it, unless the
user measured that group.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from rigpilot import resources
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import P2P, Gpu, GpuPair, Machine, PciePath, short_gpu_name
from rigpilot.engine.hardware.specs import match_spec
from rigpilot.engine.planner.cluster import NodeLink
from rigpilot.engine.planner.plan import Figure
from rigpilot.engine.planner.settings import ref, refusal

# NVLink per link and direction by generation, GB/s, for GPUs the spec table does not know.
NVLINK_LINK_GBS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.877}
PCIE_EFFICIENCY = 0.8  # DMA reaches ~80% of the raw link rate
NCCL_EFFICIENCY = {"nvswitch": 0.85, "nvlink": 0.85, "p2p": 0.8, "host": 0.8, "sys": 0.8}
HOST_BOUNCE = 0.5  # no P2P: copied into host memory and out again
CROSS_SOCKET = 0.4  # through both sockets' memory and the socket interconnect
LATENCY_S = {"nvswitch": 6e-6, "nvlink": 6e-6, "p2p": 10e-6, "host": 20e-6, "sys": 25e-6, "self": 0.0}


def no_bf16(index: int, name: str) -> UserError:
    """The refusal of bf16 on a GPU without it (Turing and older)."""
    return refusal("GPU {index} ({name}) has no bf16 support; use {fp16}", reason="no_bf16",
                   fields={"setting": "precision", "value": "bf16", "gpu": index},
                   index=index, name=name, fp16=ref("precision", "fp16"))  # fmt: skip


def _efficiency_priors(stack: str = "eager") -> tuple[dict[str, float], float, dict[str, str]]:
    """Share of the dense spec peak a training step's matmuls reach, by GPU class (resources/speed_priors.json).

    Two stacks, each fitted to published measured runs of that stack (resources/published_runs.json,
    benchmarks/published_runs.py --fit): "eager" (PyTorch FSDP, SDPA, no torch.compile: the engine's default)
    and "compiled" (the same with torch.compile of each block). A class with no compiled run to fit keeps its
    eager prior times the compile gain the fitted classes show (the file's `compile_gain`), said as such; the
    third map says which figure is fitted and which assumed, in the words a plan shows.
    """
    doc = json.loads(resources.path("speed_priors.json").read_text())
    gain = float(doc.get("compile_gain", {}).get("value", 1.0))
    eff: dict[str, float] = {}
    sources: dict[str, str] = {}
    for k, v in doc["efficiency"].items():
        entry = v if stack == "eager" else v.get("compiled")
        if entry is None:
            eff[k] = float(v["efficiency"]) * gain
            sources[k] = f"assumed: eager × {gain:.2f}, the fitted classes' compile gain"
            continue
        eff[k] = float(entry["efficiency"])
        fitted = entry.get("fitted") and entry.get("runs")
        sources[k] = f"fitted to {len(entry['runs'])} published {'compiled ' if stack != 'eager' else ''}runs" if fitted else "assumed"
    default = float(doc["default"]) * (gain if stack != "eager" else 1.0)
    return eff, default, sources


EFFICIENCY_PRIOR, DEFAULT_EFFICIENCY, EFFICIENCY_SOURCE = _efficiency_priors()
COMPILED_EFFICIENCY_PRIOR, DEFAULT_COMPILED_EFFICIENCY, COMPILED_EFFICIENCY_SOURCE = _efficiency_priors("compiled")
# GeForce and RTX workstation cards: their own class where the file has one (the datacenter fit does not carry over).
_WORKSTATION_KEY = re.compile(r"^(rtx|gtx|titan)")
MEASURED_TO_STEP = 0.80  # a step reaches ~80% of a large measured GEMM's rate (other kernels, launch gaps)
MEMORY_BW_EFFICIENCY = 0.75
# Unknown GPUs: deliberately modest figures, flagged as assumed so the user can calibrate them.
UNKNOWN_PEAK = {"bf16": 50.0, "fp16": 50.0, "tf32": 25.0, "fp32": 15.0, "int8": 100.0}
UNKNOWN_MEMORY_BW = 500.0


@dataclass
class Calibration:
    """Numbers the user measured; each replaces the prior it corresponds to.

    What a search uses; the file a calibrate job writes, and when it applies, is engine/planner/calibration.py.

    matmul_tflops: GPU index -> dense matmul TFLOP/s in the plan's dtype.
    bus_bandwidth_gbs: GPU group ("0,1,2,3") -> all-reduce bus bandwidth, GB/s (nccl-tests' busbw).
    """

    matmul_tflops: dict[int, float] = field(default_factory=dict)
    bus_bandwidth_gbs: dict[str, float] = field(default_factory=dict)

    def bandwidth_for(self, group: list[int]) -> float | None:
        want = set(group)
        best: tuple[int, float] | None = None
        for key, gbs in self.bus_bandwidth_gbs.items():
            members = set(_parse_group(key))
            # A measured ring also bounds any subset of it from below.
            if want <= members and (best is None or len(members) < best[0]):
                best = (len(members), gbs)
        return best[1] if best else None

    def to_dict(self) -> dict[str, Any]:
        return {"matmul_tflops": {str(k): v for k, v in self.matmul_tflops.items()}, "bus_bandwidth_gbs": dict(self.bus_bandwidth_gbs)}

    def for_nodes(self, local: list[int], nodes: int) -> Calibration:
        """This machine's figures carried to the same GPUs of every (identical) node of a multi-node search,
        whose GPU node · len(local) + k is `local[k]` of that node (engine.planner.cluster)."""
        pos = {i: k for k, i in enumerate(local)}
        mm: dict[int, float] = {}
        bw: dict[str, float] = {}
        for n in range(nodes):
            base = n * len(local)
            for i, v in self.matmul_tflops.items():
                if i in pos:
                    mm[base + pos[i]] = v
            for key, v in self.bus_bandwidth_gbs.items():
                members = _parse_group(key)
                if all(i in pos for i in members):
                    bw[",".join(str(x) for x in sorted(base + pos[i] for i in members))] = v
        return Calibration(mm, bw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        try:
            mm = {int(k): float(v) for k, v in (d.get("matmul_tflops") or {}).items()}
            bw = {",".join(str(i) for i in _parse_group(k)): float(v) for k, v in (d.get("bus_bandwidth_gbs") or {}).items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise UserError(f"malformed calibration: {e}") from e
        if any(v <= 0 for v in [*mm.values(), *bw.values()]):
            raise UserError("calibration figures must be positive")
        return cls(mm, bw)


def _parse_group(key: str) -> list[int]:
    return sorted(int(x) for x in str(key).replace(" ", "").split(",") if x)


@dataclass(frozen=True)
class GpuPerf:
    index: int
    name: str
    memory: int  # bytes
    architecture: str
    spec_key: str | None
    peak: dict[str, float | None]  # dense TFLOPS by dtype
    efficiency: float
    measured_tflops: float | None
    memory_bandwidth_gbs: float
    pcie_gbs: float  # achievable, one direction
    nvlink_link_gbs: float | None  # one link, one direction
    nvlink_total_gbs: float | None  # all links, one direction (what an NVSwitch gives one peer)
    efficiency_source: str = "assumed"  # or "fitted to N published runs"
    compiled_efficiency: float | None = None  # the share under torch.compile; None: as eager
    compiled_efficiency_source: str = "assumed"

    @property
    def short_name(self) -> str:
        return short_gpu_name(self.name)

    def peak_tflops(self, dtype: str) -> float:
        v = self.peak.get(dtype)
        if v is None and dtype == "bf16":
            raise no_bf16(self.index, self.short_name)
        return float(v or self.peak.get("fp32") or UNKNOWN_PEAK["fp32"])

    def share(self, compile: bool = False) -> float:
        """The prior share of peak a step reaches, eager or compiled."""
        return self.compiled_efficiency if compile and self.compiled_efficiency is not None else self.efficiency

    def step_tflops(self, dtype: str, *, compile: bool = False) -> float:
        """What a training step's matmuls achieve: measured × 0.8, else peak × prior.

        A measured GEMM rate does not change under torch.compile; what compile removes is the time between
        the matmuls (fused norms, activations and casts), so a measured rate takes the prior's compiled/eager ratio.
        """
        if self.measured_tflops:
            return self.measured_tflops * MEASURED_TO_STEP * self.share(compile) / self.efficiency
        return self.peak_tflops(dtype) * self.share(compile)


@dataclass(frozen=True)
class Link:
    kind: str  # "nvswitch" | "nvlink" | "p2p" | "host" | "sys" | "self" | "network" (between nodes)
    gbs: float  # achievable collective bus bandwidth over this hop, one direction, GB/s
    latency_s: float
    label: str  # a noun phrase: "NVLink NV4", "PCIe P2P (PIX)", "host memory (no P2P)"
    measured: bool = False

    @property
    def nvlink(self) -> bool:
        return self.kind in ("nvswitch", "nvlink")

    @property
    def fast(self) -> bool:
        """Good enough for tensor parallelism: NVLink, or P2P behind one PCIe switch."""
        return self.nvlink or self.kind == "self" or (self.kind == "p2p" and self.label.endswith(("(PIX)", "(PXB)")))


_SELF = Link("self", float("inf"), 0.0, "same GPU")


class Topology:
    """The selected GPUs' compute and links, with measured numbers taking precedence."""

    def __init__(
        self, machine: Machine, gpu_indices: list[int], calibration: Calibration | None = None, *,
        per_node: int = 0, internode: NodeLink | None = None,
    ) -> None:  # fmt: skip
        """`per_node` > 0 with `internode`: `machine` is several nodes (engine.planner.cluster), GPU g on node
        g // per_node, and GPUs of different nodes reach each other only over `internode`."""
        self.machine = machine
        self.indices = list(gpu_indices)
        self.calibration = calibration or Calibration()
        self.per_node = per_node if internode is not None else 0
        self.internode = internode
        self.gpus: dict[int, GpuPerf] = {i: gpu_perf(machine.gpu(i), self.calibration) for i in self.indices}
        self._links: dict[tuple[int, int], Link] = {}
        self._rings: dict[frozenset[int], Link] = {}
        self._partitions: dict[tuple[tuple[int, ...], int], list[list[int]]] = {}

    # -- links -------------------------------------------------------------------------------------
    def node_of(self, g: int) -> int:
        return g // self.per_node if self.per_node else 0

    def crosses_nodes(self, group: list[int]) -> bool:
        return bool(self.per_node) and len({self.node_of(g) for g in group}) > 1

    def nic(self) -> Link:
        """One node's NICs, as one link (only for a multi-node topology)."""
        assert self.internode is not None
        nl = self.internode
        return Link("network", nl.gbs, nl.latency_s, nl.label, measured=nl.source == "given")

    def link(self, a: int, b: int) -> Link:
        if a == b:
            return _SELF
        key = (min(a, b), max(a, b))
        found = self._links.get(key)
        if found is None and self.crosses_nodes([a, b]):
            found = self._links[key] = self.nic()
        if found is None:
            found = self._links[key] = _pair_link(self.machine, self.gpus[key[0]], self.gpus[key[1]])
        return found

    def ring(self, group: list[int]) -> Link:
        """The binding link of the best ring through `group` (measured bandwidth wins)."""
        key = frozenset(group)
        found = self._rings.get(key)
        if found is not None:
            return found
        if len(key) < 2:
            found = _SELF
        elif self.crosses_nodes(list(key)):
            found = self._hierarchical([sorted(key)])
        else:
            order = self._best_ring(sorted(key))
            hops = [self.link(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
            found = min(hops, key=lambda x: (x.gbs, -x.latency_s))
            measured = self.calibration.bandwidth_for(sorted(key))
            if measured is not None:
                found = Link(found.kind, measured, found.latency_s, found.label, measured=True)
        self._rings[key] = found
        return found

    def _best_ring(self, nodes: list[int]) -> list[int]:
        if len(nodes) <= 3:
            return nodes
        candidates = [nodes]
        for start in nodes:
            order, left = [start], set(nodes) - {start}
            while left:
                nxt = max(sorted(left), key=lambda j: self.link(order[-1], j).gbs)
                order.append(nxt)
                left.remove(nxt)
            candidates.append(order)

        def score(order: list[int]) -> float:
            return min(self.link(order[i], order[(i + 1) % len(order)]).gbs for i in range(len(order)))

        return max(candidates, key=score)

    def collective(self, groups: list[list[int]]) -> Link:
        """The binding link when `groups` run the same collective at once.

        Groups whose slowest hop goes through host memory or across sockets share
        that path, so each gets its share of it.
        """
        rings = [self.ring(g) for g in groups if len(g) > 1 and not self.crosses_nodes(g)]
        if any(self.crosses_nodes(g) for g in groups):
            # Groups inside a node run beside those across nodes: the slower of the two binds.
            return min([self._hierarchical(groups), *rings], key=lambda x: x.gbs)
        if not rings:
            return _SELF
        shared = sum(1 for r in rings if r.kind in ("host", "sys") and not r.measured)
        worst = min(rings, key=lambda x: x.gbs)
        if worst.kind in ("host", "sys") and shared > 1 and not worst.measured:
            return Link(worst.kind, worst.gbs / shared, worst.latency_s, f"{worst.label}, shared by {shared} groups")
        return worst

    def _hierarchical(self, groups: list[list[int]]) -> Link:
        """The link that, in the ring formulas of engine.planner.speed, gives a hierarchical collective's time.

        Across nodes NCCL reduces inside each node first (on the node's own links), moves only what each
        node contributes over its NICs, then spreads the result inside the node again (its tree and
        NVLS/CollNet algorithms; a flat ring would cross each node's NIC with up to twice the bytes on
        two nodes). An all-reduce of B bytes over N nodes of k GPUs each then takes
            2(k-1)/k · B / intra  +  2(N-1)/N · B · m/k / nic
        where m GPUs of a node run such collectives at once (m/k groups share its NICs). The returned
        link's bandwidth is 2(n-1)/n divided by that time per byte (n = N·k), so allreduce_s and
        gather_s (half of each term) give exactly this; its latency makes 2(n-1)·latency the same sum.
        """
        nic = self.nic()
        cross = [g for g in groups if self.crosses_nodes(g)]
        sharing: dict[int, int] = {}
        for g in cross:
            for x in g:
                sharing[self.node_of(x)] = sharing.get(self.node_of(x), 0) + 1
        m = max(sharing.values())
        worst: tuple[float, float, Link, int] | None = None
        for g in cross:
            by_node: dict[int, list[int]] = {}
            for x in g:
                by_node.setdefault(self.node_of(x), []).append(x)
            nodes, k, n = len(by_node), max(len(v) for v in by_node.values()), len(g)
            intra = min((self.ring(v) for v in by_node.values() if len(v) > 1), key=lambda x: x.gbs, default=_SELF)
            per_byte = (2 * (k - 1) / k / (intra.gbs * 1e9) if k > 1 else 0.0) + 2 * (nodes - 1) / nodes * m / k / (nic.gbs * 1e9)
            gbs = 2 * (n - 1) / n / per_byte / 1e9
            latency = ((k - 1) * intra.latency_s + (nodes - 1) * nic.latency_s) / (n - 1)
            if worst is None or gbs < worst[0]:
                worst = (gbs, latency, intra, k)
        assert worst is not None
        gbs, latency, intra, k = worst
        label = f"{nic.label} between nodes"
        if m > 1:
            label += f" ({m} GPUs of a node share it)"
        if k > 1:
            label += f", {intra.label} inside each"
        return Link("network", gbs, latency, label, measured=nic.measured)

    # -- grouping ------------------------------------------------------------------------------------
    def partition(self, gpus: list[int], size: int) -> list[list[int]]:
        """Split `gpus` into groups of `size` whose internal rings are as fast as possible."""
        key = (tuple(gpus), size)
        found = self._partitions.get(key)
        if found is not None:
            return found
        if size <= 1 or size >= len(gpus):
            found = [list(gpus)] if size >= len(gpus) else [[g] for g in gpus]
        else:
            found = self._partition(list(gpus), size)
        self._partitions[key] = found
        return found

    def _partition(self, gpus: list[int], size: int) -> list[list[int]]:
        natural = [gpus[i : i + size] for i in range(0, len(gpus), size)]
        greedy: list[list[int]] = []
        left = list(gpus)
        while left:
            group = [left.pop(0)]
            while len(group) < size:
                nxt = max(left, key=lambda j: (min(self.link(g, j).gbs for g in group), -j))
                group.append(nxt)
                left.remove(nxt)
            greedy.append(sorted(group))

        def score(groups: list[list[int]]) -> float:
            return min(self.ring(g).gbs for g in groups)

        best = max([natural, greedy], key=score)  # ties keep the natural order
        if len(gpus) <= 8 and len(gpus) // size == 2:
            # Two groups: try every split (at most 35 for eight GPUs) and keep the fastest.
            first = gpus[0]
            for rest in itertools.combinations(gpus[1:], size - 1):
                a = [first, *rest]
                b = [g for g in gpus if g not in a]
                if score([a, b]) > score(best):
                    best = [a, b]
        return best

    def fast_partition(self, gpus: list[int], size: int) -> list[list[int]] | None:
        """Groups of `size` in which every pair is fast (NVLink, or P2P behind a PCIe switch), or None."""
        if size <= 1:
            return [[g] for g in gpus]
        groups = self.partition(gpus, size)
        for g in groups:
            if any(not self.link(a, b).fast for a, b in itertools.combinations(g, 2)):
                return None
        return groups

    # -- figures -------------------------------------------------------------------------------------
    def compute_figures(self, gpu_indices: list[int], dtype: str, *, compile: bool = False) -> list[Figure]:
        out: list[Figure] = []
        seen: set[tuple[str, float]] = set()
        for i in gpu_indices:
            g = self.gpus[i]
            if g.measured_tflops:
                out.append(Figure(f"matmul TFLOP/s, GPU {i} ({g.short_name})", g.measured_tflops, "TFLOP/s", "measured"))
                continue
            key = (g.name, g.efficiency)
            if key in seen:
                continue
            seen.add(key)
            src = "spec" if g.spec_key else "assumed"
            out.append(Figure(f"peak {dtype} TFLOP/s, {g.short_name}", g.peak_tflops(dtype), "TFLOP/s", src))
            if compile:
                out.append(Figure(f"share of that peak reached compiled, {g.short_name}", g.share(True), "",
                                  g.compiled_efficiency_source))
            else:
                out.append(Figure(f"share of that peak reached, {g.short_name}", g.efficiency, "", g.efficiency_source))
        return out


def gpu_perf(gpu: Gpu, calibration: Calibration | None = None) -> GpuPerf:
    spec = match_spec(gpu.name, gpu.memory_total)
    measured = (calibration.matmul_tflops.get(gpu.index) if calibration else None) or None
    memory = gpu.memory_total or (int(spec.memory_gib * 2**30) if spec else 0)
    if spec is not None:
        peak: dict[str, float | None] = {d: spec.peak_tflops(d) for d in ("bf16", "fp16", "tf32", "fp32", "int8")}
        arch = spec.architecture
        mem_bw = spec.memory_bandwidth_gbs
        cls = arch.lower()
        if _WORKSTATION_KEY.match(spec.key) and f"{cls} workstation" in EFFICIENCY_PRIOR:
            cls = f"{cls} workstation"
        eff = EFFICIENCY_PRIOR.get(cls, DEFAULT_EFFICIENCY)
        eff_source = EFFICIENCY_SOURCE.get(cls, "assumed") if cls in EFFICIENCY_PRIOR else "assumed"
        ceff = COMPILED_EFFICIENCY_PRIOR.get(cls, DEFAULT_COMPILED_EFFICIENCY)
        ceff_source = COMPILED_EFFICIENCY_SOURCE.get(cls, "assumed") if cls in COMPILED_EFFICIENCY_PRIOR else "assumed"
        nv_total = spec.nvlink_bandwidth_gbs / 2 if spec.nvlink_bandwidth_gbs else None
    else:
        peak = dict(UNKNOWN_PEAK)
        arch = "unknown"
        mem_bw = UNKNOWN_MEMORY_BW
        eff = DEFAULT_EFFICIENCY
        eff_source = "assumed"
        ceff, ceff_source = DEFAULT_COMPILED_EFFICIENCY, "assumed"
        nv_total = None
    links = gpu.nvlink_links or 0
    per_link = None
    if links and nv_total:
        per_link = nv_total / links
    elif links:
        per_link = NVLINK_LINK_GBS.get(gpu.nvlink_gen or 0, 25.0)
        nv_total = per_link * links
    gen = gpu.pcie_gen_max or gpu.pcie_gen_current or (spec.pcie_gen if spec else 4)
    width = gpu.pcie_width_current or gpu.pcie_width_max or 16
    pcie = PCIE_LANE_GBS.get(gen, PCIE_LANE_GBS[4]) * width * PCIE_EFFICIENCY
    return GpuPerf(
        index=gpu.index,
        name=gpu.name,
        memory=memory,
        architecture=arch,
        spec_key=spec.key if spec else None,
        peak=peak,
        efficiency=eff,
        measured_tflops=measured,
        memory_bandwidth_gbs=mem_bw,
        pcie_gbs=pcie,
        nvlink_link_gbs=per_link,
        nvlink_total_gbs=nv_total,
        efficiency_source=eff_source,
        compiled_efficiency=ceff,
        compiled_efficiency_source=ceff_source,
    )


def _pair_link(machine: Machine, a: GpuPerf, b: GpuPerf) -> Link:
    pair = machine.pair(a.index, b.index)
    if pair is not None and pair.nvlink_count:
        if pair.nvswitch:
            gbs = min(a.nvlink_total_gbs or 0.0, b.nvlink_total_gbs or 0.0) or NVLINK_LINK_GBS[4] * pair.nvlink_count
            kind, label = "nvswitch", f"NVSwitch (NV{pair.nvlink_count})"
        else:
            per = min(a.nvlink_link_gbs or NVLINK_LINK_GBS.get(pair.nvlink_gen or 0, 25.0), b.nvlink_link_gbs or 1e9)
            gbs = per * pair.nvlink_count
            kind, label = "nvlink", f"NVLink NV{pair.nvlink_count}"
        return Link(kind, gbs * NCCL_EFFICIENCY[kind], LATENCY_S[kind], label)
    pcie = min(a.pcie_gbs, b.pcie_gbs)
    path = pair.pcie if pair is not None else None
    p2p = _p2p_state(pair)
    if path is PciePath.SYS:
        factor = HOST_BOUNCE if p2p is P2P.OK else CROSS_SOCKET
        kind, label = "sys", "the link between CPU sockets (SYS" + (", P2P)" if p2p is P2P.OK else ", no P2P)")
    elif p2p is P2P.UNSUPPORTED:
        factor, kind, label = HOST_BOUNCE, "host", "host memory (no P2P)"
    else:
        factor = 1.0 if path in (PciePath.PIX, PciePath.PXB) else 0.85
        kind = "p2p"
        label = f"PCIe P2P ({path.value if path else 'path unknown'})"
    return Link(kind, pcie * factor * NCCL_EFFICIENCY[kind], LATENCY_S[kind], label)


def _p2p_state(pair: GpuPair | None) -> P2P:
    if pair is None:
        return P2P.UNKNOWN
    if P2P.UNSUPPORTED in (pair.p2p_read, pair.p2p_write):
        return P2P.UNSUPPORTED
    if pair.p2p_read is P2P.OK and pair.p2p_write is P2P.OK:
        return P2P.OK
    return P2P.UNKNOWN
