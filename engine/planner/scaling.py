"""How a multi-node plan scales: its speed against the best plan on one node, and what crosses the link.

A multi-node search tries one node, powers of two and all of them (search.node_counts) in one ranking, so
the best plan on one node is at hand to compare with: the speed-up is the ratio of their tokens/s and the
efficiency that ratio over the number of nodes (1.0 = linear scaling).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rigpilot.engine.planner.cluster import Cluster
from rigpilot.engine.planner.durations import duration_text
from rigpilot.engine.planner.explain import number_word
from rigpilot.engine.planner.plan import CommItem, Parallelism, Plan, Timing
from rigpilot.engine.planner.result import SPEED_TIE, Candidate, SearchResult
from rigpilot.engine.planner.speed import SpeedModel

BETWEEN_NODES = "between nodes"  # what the label of every link crossing nodes contains (links.Topology)


def crossing(timing: Timing) -> list[CommItem]:
    """The communication of a step that crosses the link between nodes."""
    return [c for c in timing.comm if BETWEEN_NODES in c.link]


def _one_node(fitting: list[Candidate]) -> Candidate | None:
    # `fitting` is in ranking order: the first one-node plan the engine runs is the best one.
    return next((c for c in fitting if c.par.nodes == 1 and c.runs_here), None)


def scaling_of(plan: Plan, fitting: list[Candidate], speed: SpeedModel, cluster: Cluster) -> dict[str, Any] | None:
    """`Plan.scaling` of a plan of a multi-node search; None for a plan on one node."""
    nodes = plan.parallelism.nodes
    if nodes <= 1:
        return None
    one = _one_node(fitting)
    items = crossing(plan.timing)
    base = one.tokens_per_s if one is not None else None
    speedup = plan.timing.tokens_per_s / base if base else None
    return {
        "nodes": nodes,
        "one_node_tokens_per_s": base,
        "speedup": speedup,
        "efficiency": speedup / nodes if speedup is not None else None,
        "internode_s": sum(i.seconds for i in items),
        "internode_exposed_s": sum(i.exposed_seconds for i in items),
    }


def _local(par: Parallelism, cluster: Cluster) -> Parallelism:
    per = par.world_size // par.nodes
    return dataclasses.replace(
        par, gpu_indices=[cluster.to_local(g) for g in par.gpu_indices[:per]],
        internode=cluster.link.to_dict() if par.nodes > 1 else None,
    )  # fmt: skip


def _spans(par: Parallelism, per_node: int) -> str:
    """What the nodes split between them, in words."""
    stage = par.dp * par.tp
    if par.pp > 1 and stage <= per_node:
        return "the pipeline's stages" + (" (data parallel inside each node)" if par.dp > 1 else "")
    if par.hsdp and par.shard_degree * par.tp <= per_node:
        return "HSDP's replicas (each node holds one sharded copy of the model)"
    if par.zero_stage >= 1:
        return "the sharded data-parallel ranks"
    return "the data-parallel replicas"


def multinode_lines(result: SearchResult, fitting: list[Candidate], speed: SpeedModel, cluster: Cluster) -> list[str]:
    """Why the plan uses the nodes it does: the link against a node's own links, the speed-up and efficiency."""
    best = result.best
    if best is None:
        return []
    link, nodes, per = cluster.link, cluster.nodes, cluster.per_node
    topo = speed.topo
    inside = topo.ring(cluster.node_gpus(0)) if per > 1 else None
    versus = f" against {inside.gbs:.0f} GB/s over {inside.label} inside a node" if inside is not None else ""
    wire = f"{link.label} ({link.gbs:.1f} GB/s per node{versus})"
    if best.parallelism.nodes > 1:
        sc = best.scaling or {}
        items = crossing(best.timing)
        what = " and ".join(i.what for i in items) or "nothing"
        lines = [
            f"Across {number_word(best.parallelism.nodes)} nodes joined by {wire}: tensor parallelism stays inside "
            f"each node and the nodes split {_spans(best.parallelism, per)}, so only the {what} cross the link."
        ]
        waits = (
            f"they take {duration_text(sc.get('internode_s') or 0.0)} per step on the link and each step waits "
            f"{duration_text(sc.get('internode_exposed_s') or 0.0)} for them"
        )
        if sc.get("speedup") is not None:
            lines.append(
                f"Over {link.label} {waits}: predicted {sc['speedup']:.2f}× the best plan on one node "
                f"({sc['one_node_tokens_per_s']:,.0f} tokens/s), {sc['efficiency']:.0%} of linear scaling."
            )
        else:
            lines.append(f"Over {link.label} {waits}; nothing fits on one node, so there is no one-node speed to compare.")
        if best.parallelism.nodes < nodes:
            lines.append(
                f"It uses {best.parallelism.nodes} of your {nodes} nodes: over {link.label} more nodes are slower "
                f"or add less than {SPEED_TIE:.0%}."
            )
        return lines
    wider = [c for c in fitting if c.par.nodes > 1 and c.runs_here]
    if not wider:
        return [f"Planned on one of your {nodes} nodes: no plan over several nodes fits that the engine runs."]
    alt = max(wider, key=lambda c: c.tokens_per_s)
    t = speed.timing(alt.par)
    items = crossing(t)
    exposed = sum(i.exposed_seconds for i in items)
    ratio = alt.tokens_per_s / best.timing.tokens_per_s
    what = " and ".join(i.what for i in items) or "communication"
    return [
        f"Planned on one of your {nodes} nodes: over {wire} the best plan on {number_word(alt.par.nodes)} nodes "
        f"({_local(alt.par, cluster)._describe()}) reaches {alt.tokens_per_s:,.0f} tokens/s, {ratio:.2f}× this one "
        f"({ratio / alt.par.nodes:.0%} of linear): its {what} cross the link and each step waits "
        f"{duration_text(exposed)} for them; another node is used only where it is more than {SPEED_TIE:.0%} faster."
    ]
