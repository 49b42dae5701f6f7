"""How a socket request is declared: its arguments and its handler in one place.

A handler module keeps a `RequestGroup` and declares each request on the function that answers it:

    REQUESTS = RequestGroup()

    @REQUESTS.request("rename", required={"job": Text, "name": Text})
    def rename(engine: Engine, conn: Connection, job: str, name: str) -> Any: ...

engine.service.requests gathers the groups into the one registry that the protocol's argument checks and the
service's dispatch both read, so a request cannot be checked without being answered, or answered unchecked.
Argument types use the notation of engine.api.protocol (`Annotated[..., Limit(...)]`); a declaration whose
handler does not take exactly those arguments is refused when the module is imported, not at the first request.

Handlers see the running service only through `Engine`, what a request may use of it; the socket layer
(engine.service.server) provides it, and this module does not import that layer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from rigpilot.engine.api.tls import Identity
    from rigpilot.engine.hardware.discovery import Discovery
    from rigpilot.engine.hardware.machine import Machine
    from rigpilot.engine.hardware.sampler import Sampler
    from rigpilot.engine.jobs.resilient_store import ResilientTelemetryStore
    from rigpilot.engine.jobs.scaling import Studies
    from rigpilot.engine.jobs.supervisor import Supervisor
    from rigpilot.engine.service.multinode import MultiNode
    from rigpilot.engine.service.options import ServiceOptions
    from rigpilot.engine.service.planworker import PlannerPool


class Engine(Protocol):
    """What a request's handler may use of the running engine service."""

    options: ServiceOptions
    started: float  # Unix time
    machine: Machine
    discovery: Discovery
    sampler: Sampler
    telemetry: ResilientTelemetryStore
    supervisor: Supervisor
    multinode: MultiNode
    studies: Studies
    planners: PlannerPool | None
    tcp_address: tuple[str, int] | None
    identity: Identity | None  # the TLS certificate's, on TCP
    token: str  # "" unless the engine listens on TCP
    doctor_keeping: set[str]  # doctor jobs that ended and whose report is being stored

    def machine_message(self) -> dict[str, Any]: ...

    def reload_machine(self, simulated_profile: str | None = None) -> dict[str, Any]: ...

    def stop(self) -> None: ...


# One argument's type in the protocol's notation, by name.
Arguments = Mapping[str, Any]
Handler = Callable[..., Any]  # (engine, conn, **args) -> the reply's result
H = TypeVar("H", bound=Handler)


@dataclass(frozen=True)
class RequestType:
    """One request the engine answers: the arguments it must and may have, and the function that answers it."""

    name: str
    required: Arguments
    optional: Arguments
    handler: Handler

    @property
    def schema(self) -> tuple[Arguments, Arguments]:
        """(required, optional): what engine.api.protocol checks a request's `args` against."""
        return self.required, self.optional


class RequestGroup:
    """The requests one handler module declares, each on its handler (see the module docstring)."""

    def __init__(self) -> None:
        self._types: dict[str, RequestType] = {}

    def request(
        self, name: str, *, required: Arguments | None = None, optional: Arguments | None = None
    ) -> Callable[[H], H]:
        """Declare `name` as answered by the decorated handler, with these arguments."""

        def declare(handler: H) -> H:
            if name in self._types:
                raise ValueError(f"request {name!r} is declared twice")
            req, opt = dict(required or {}), dict(optional or {})
            _check_signature(name, handler, req, opt)
            self._types[name] = RequestType(name, MappingProxyType(req), MappingProxyType(opt), handler)
            return handler

        return declare

    def __iter__(self) -> Iterator[RequestType]:
        return iter(self._types.values())


def _check_signature(name: str, handler: Handler, required: Arguments, optional: Arguments) -> None:
    """A handler takes (engine, conn) and then each declared argument by name: required ones without a default,
    optional ones with one (the value it stands for when the client leaves it out)."""
    if set(required) & set(optional):
        raise TypeError(f"request {name!r}: {sorted(set(required) & set(optional))} both required and optional")
    params = list(inspect.signature(handler).parameters.values())
    if len(params) < 2 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params[:2]):
        raise TypeError(f"request {name!r}: its handler must take (engine, conn, ...)")
    named = {p.name: p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params[2:])
    for arg in (*required, *optional):
        if arg not in named and not takes_any:
            raise TypeError(f"request {name!r}: its handler does not take the argument {arg!r}")
    for arg, p in named.items():
        if arg in required and p.default is not p.empty:
            raise TypeError(f"request {name!r}: required argument {arg!r} has a default in its handler")
        if arg in optional and p.default is p.empty:
            raise TypeError(f"request {name!r}: optional argument {arg!r} has no default in its handler")
        if arg not in required and arg not in optional:
            raise TypeError(f"request {name!r}: its handler takes {arg!r}, which the request does not declare")
