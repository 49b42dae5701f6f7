"""A scaling study's measured speed-ups in plain words, with the link the plan says they wait on.

Each point past the first gets a sentence from three figures: its measured speed-up S over the smallest point
(engine.jobs.scaling.table), so its efficiency E = S / (n / n0) and the share of each of its steps lost against
linear scaling, 1 − E (a step that should take t takes t / E); the plan's share of the step its
communication leaves exposed, c = exposed_comm_s / step_s; and the link that communication binds on, as the
planner sees it after the machine check (host memory where the check turned P2P off, measured bus bandwidth where
a check or a calibration measured it):

    "The host bounce between sockets costs 35% of each step: 2 GPUs give 1.3× (the plan expected 38% at
     6.6 GB/s, measured)"

The link is blamed only where the plan's own share accounts for at least half of what was lost; otherwise the
sentence says the link explains little of it. A noisy point (scaling.noise) gets no sentence: its speed-up
means nothing. On a simulated machine CPU ranks measured the speed-up, so no GPU link is blamed for it: the
sentence gives the measured figures and, apart, what the plan expects of the link on the real GPUs. `words` is pure; `of_study` gathers its inputs from the machine and the stored machine check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.planner import machine_check
from rigpilot.engine.planner.links import Calibration, Topology

WELL = 0.9  # at or above this share of linear a point scales well: nothing to blame
BLAME = 0.5  # the plan's communication share must cover this much of the loss to name the link as its cause

LINK_WORDS = {
    "host": "the host bounce",
    "sys": "the host bounce between sockets",
    "p2p": "PCIe peer-to-peer",
    "nvlink": "NVLink",
    "nvswitch": "NVSwitch",
    "network": "the network between nodes",
}


@dataclass(frozen=True)
class PointLink:
    """The link a point's communication binds on: the planner's Link, and whether the machine check put it there."""

    kind: str
    gbs: float
    measured: bool
    p2p_off: bool = False  # the machine check turned P2P off for these GPUs


def words(rows: list[dict[str, Any]], points: list[dict[str, Any]], links: dict[int, PointLink | None],
          *, simulated: bool = False) -> list[str]:  # fmt: skip
    """One sentence per point past the first whose speed-up means something (see the module's docstring)."""
    shares = {p["gpus"]: comm_share(p.get("predicted")) for p in points}
    out = []
    for row in rows[1:]:
        n, speedup, eff = row["gpus"], row.get("speedup"), row.get("efficiency")
        if row.get("noise") or speedup is None or eff is None:
            continue
        link = links.get(n)
        what = _link_words(link)
        given = f"{n} GPUs give {speedup:.1f}×"
        share = shares.get(n)
        if simulated:
            # CPU ranks over gloo measured it: the GPUs' link is not what they waited on, so it is not blamed.
            line = f"On CPU ranks (simulated): {given} ({eff:.0%} of linear)"
            if what and share is not None:
                line += f"; on the real GPUs the plan expects {what} to cost {share:.0%} of each step"
            out.append(line)
            continue
        if eff >= WELL:
            line = f"{given}, {eff:.0%} of linear" + (f": {what} keeps up" if what else "")
        elif what and link is not None and share is not None and share >= BLAME * (1 - eff):
            expected = (
                f"the plan expected {share:.0%} at {link.gbs:.3g} GB/s, {'measured' if link.measured else 'assumed'}"
            )
            line = f"{what[0].upper()}{what[1:]} costs {1 - eff:.0%} of each step: {given} ({expected})"
        elif what and link is not None and share is not None:
            line = (f"{given} ({eff:.0%} of linear), and {what} explains little of it: the plan expected it to cost "
                    f"{share:.0%} of each step at {link.gbs:.3g} GB/s; the rest is time the plan does not count")  # fmt: skip
        else:
            line = f"{given} ({eff:.0%} of linear)"
        out.append(line)
    return out


def comm_share(predicted: dict[str, Any] | None) -> float | None:
    """The plan's share of a step its communication leaves exposed, or None where the point has no such figure."""
    step, comm = (predicted or {}).get("step_s"), (predicted or {}).get("exposed_comm_s")
    if not isinstance(step, (int, float)) or not isinstance(comm, (int, float)) or step <= 0 or comm < 0:
        return None
    return comm / step


def _link_words(link: PointLink | None) -> str | None:
    if link is None or link.kind not in LINK_WORDS:
        return None
    if link.p2p_off:
        return f"{LINK_WORDS[link.kind]} (P2P off after the machine check)"
    return LINK_WORDS[link.kind] + (" (no P2P)" if link.kind == "host" else "")


def point_link(machine: Machine, gpus: list[int], report: dict[str, Any] | None) -> PointLink | None:
    """The link a point on `gpus` binds on, as the planner sees it after the machine check; None for one GPU."""
    if len(gpus) < 2:
        return None
    used = machine_check.use(report, machine, gpus)
    # Only the link matters here: the check's bus bandwidths, not its matmul rates.
    measured = Calibration({}, dict(used.calibration.bus_bandwidth_gbs)) if used.calibration else None
    ring = Topology(used.machine, gpus, measured).ring(gpus)
    return PointLink(ring.kind, ring.gbs, ring.measured, bool(used.p2p_off))


def of_study(study: dict[str, Any], machine: Machine, report: dict[str, Any] | None) -> list[str]:
    """`words` for a study shown by the engine: each point's binding group from its plan (`comm_group`, else all
    of its GPUs), on this machine as the stored machine check left it."""
    points = study.get("points") or []
    rows = study.get("table") or []
    shown = {r["gpus"] for r in rows[1:] if r.get("speedup") is not None and not r.get("noise")}
    links: dict[int, PointLink | None] = {}
    for p in points:
        if p["gpus"] not in shown:
            continue
        gpus = (p.get("predicted") or {}).get("comm_group") or p.get("gpu_indices") or list(range(p["gpus"]))
        try:
            links[p["gpus"]] = point_link(machine, [int(g) for g in gpus], report)
        except (KeyError, ValueError):  # a GPU this machine no longer has: no link to name
            links[p["gpus"]] = None
    return words(rows, points, links, simulated=bool(study.get("simulated")))
