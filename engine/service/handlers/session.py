"""Requests about the connection itself: the greeting (and the TCP login's last step) and stopping the service."""

from __future__ import annotations

import os
import threading
from typing import Annotated, Any

from rigpilot.engine import __version__
from rigpilot.engine.api import protocol, tls
from rigpilot.engine.api.protocol import Limit, ProtocolError, Text
from rigpilot.engine.service import nodes
from rigpilot.engine.service.connection import Connection
from rigpilot.engine.service.handling import Engine, RequestGroup

REQUESTS = RequestGroup()


@REQUESTS.request(
    "hello", optional={"versions": Annotated[list[int], Limit(max_len=64)], "client": Text, "nonce": Text, "proof": Text}
)
def hello(
    engine: Engine, conn: Connection, versions: list[int] | None = None, client: str = "", proof: str = "", nonce: str = ""
) -> Any:
    conn.client = client
    if versions is not None and not set(versions) & set(protocol.SUPPORTED_VERSIONS):
        raise ProtocolError(
            protocol.UNSUPPORTED_VERSION,
            f"client speaks protocol {versions}, this service {list(protocol.SUPPORTED_VERSIONS)}; update Rigpilot",
        )
    return {
        "service": "rigpilot-engine",
        "version": __version__,
        "protocol": protocol.PROTOCOL_VERSION,
        "versions": list(protocol.SUPPORTED_VERSIONS),
        "pid": os.getpid(),
        "started": engine.started,
        "machine": engine.machine.label,
        "simulated": engine.machine.simulated,
        "notes": engine.discovery.notes,
        "telemetry_period": engine.sampler.period,
        "tcp": list(engine.tcp_address) if engine.tcp_address else None,
        "host_id": nodes.host_id(),  # engines with the same id share this computer's files (multi-node jobs)
        "fingerprint": engine.identity.fingerprint if engine.identity else None,  # of the TLS certificate on `tcp`
        # The engine's half of the login: it holds the token too (the client checks before it trusts the reply).
        "proof": tls.login_proof(engine.token, "engine", conn.nonce, conn.client_nonce, engine.identity.fingerprint)
        if conn.remote and engine.identity else None,
    }


@REQUESTS.request("shutdown")
def shutdown(engine: Engine, conn: Connection) -> Any:
    threading.Timer(0.2, engine.stop).start()  # after the reply is on its way
    return {"stopping": True, "jobs_keep_running": True}
