"""Requests about other engines: the node registry, and one engine's part of a job another engine (the head) leads
(engine.service.multinode); those are reached with the engine's token or this user's socket."""

from __future__ import annotations

from typing import Annotated, Any

from rigpilot.engine.api.protocol import Limit, Text
from rigpilot.engine.service import nodes as registry
from rigpilot.engine.service.connection import Connection
from rigpilot.engine.service.handling import Engine, RequestGroup

REQUESTS = RequestGroup()


# The node registry (engine.service.nodes.check_node validates an entry).
@REQUESTS.request("nodes", optional={"probe": bool})
def nodes(engine: Engine, conn: Connection, probe: bool = True) -> Any:
    found = registry.load()
    listed = registry.probe_all(list(found.values())) if probe else [n.public() for n in found.values()]
    return {"nodes": listed, "path": str(registry.registry_path()), "host_id": registry.host_id()}


@REQUESTS.request(
    "node_add", required={"name": Text, "address": Text, "token": Text}, optional={"fingerprint": Text | None}
)
def node_add(
    engine: Engine, conn: Connection, name: str, address: str, token: str, fingerprint: str | None = None
) -> Any:
    node = registry.add(name, address, token, fingerprint)
    return {"node": registry.probe(node)}


@REQUESTS.request("node_remove", required={"name": Text})
def node_remove(engine: Engine, conn: Connection, name: str) -> Any:
    registry.remove(name)
    return {"removed": name}


@REQUESTS.request("submit_member", required={"job": Text, "spec": dict[str, Any], "nodes": dict[str, Any]})
def submit_member(engine: Engine, conn: Connection, job: str, spec: dict[str, Any], nodes: dict[str, Any]) -> Any:
    return engine.multinode.submit_member(job, spec, nodes)


@REQUESTS.request("check_member", required={"job": Text, "spec": dict[str, Any], "nodes": dict[str, Any]})
def check_member(engine: Engine, conn: Connection, job: str, spec: dict[str, Any], nodes: dict[str, Any]) -> Any:
    return engine.multinode.check_member(job, spec, nodes)


@REQUESTS.request(
    "resume_member",
    required={"job": Text, "run": Annotated[int, Limit(1, 1 << 30)], "endpoint": Text},
    optional={"env": Annotated[dict[str, str], Limit(max_len=1024)] | None},
)
def resume_member(
    engine: Engine, conn: Connection, job: str, run: int, endpoint: str, env: dict[str, str] | None = None
) -> Any:
    return {"job": engine.multinode.resume_member(job, run, endpoint, env)}
