"""Every request the engine service answers, gathered from the handler modules where each is declared.

The one registry both halves read: `parse_request` checks a request's `args` against its declaration, and
`answer` calls the handler declared with it. Adding a request is one `@REQUESTS.request(...)` on its handler in
engine/service/handlers/ (and a line in engine.api.protocol's docstring, which documents the wire).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from rigpilot.engine.api import protocol
from rigpilot.engine.api.protocol import Request
from rigpilot.engine.service.connection import Connection
from rigpilot.engine.service.handlers import cluster, doctor, jobs, machine, output, scaling, session
from rigpilot.engine.service.handling import Arguments, Engine, RequestGroup, RequestType


def _gather(groups: Iterable[RequestGroup]) -> Mapping[str, RequestType]:
    found: dict[str, RequestType] = {}
    for group in groups:
        for kind in group:
            if kind.name in found:
                raise ValueError(f"request {kind.name!r} is declared in two handler modules")
            found[kind.name] = kind
    return MappingProxyType(found)


REQUESTS: Mapping[str, RequestType] = _gather(
    m.REQUESTS for m in (session, machine, jobs, cluster, output, scaling, doctor)
)

# type -> (required args, optional args), read-only: what protocol.parse_request checks `args` against.
REQUEST_SCHEMAS: Mapping[str, tuple[Arguments, Arguments]] = MappingProxyType(
    {name: kind.schema for name, kind in REQUESTS.items()}
)


def parse_request(msg: dict[str, Any]) -> Request:
    """Check one request's envelope and args against its declaration; raise ProtocolError when either is wrong
    (`unknown_type` for a type no handler module declares)."""
    return protocol.parse_request(msg, REQUEST_SCHEMAS)


def answer(engine: Engine, conn: Connection, req: Request) -> Any:
    """The result of a request `parse_request` accepted: its declared handler's."""
    return REQUESTS[req.type].handler(engine, conn, **req.args)
