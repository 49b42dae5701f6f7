"""How an engine service is run: its listeners, limits and timeouts (`rigpilot engine` flags and tests set them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServiceOptions:
    tcp: str | None = None  # "ADDR:PORT" or "PORT" (binds 127.0.0.1) for remote clients: TLS, and a token login
    simulate: str | None = None  # a simulated profile; default: RIGPILOT_SIMULATE, else real GPUs
    telemetry_period: float = 1.0
    grace_s: float = 30.0
    failure_grace_s: float = 5.0
    max_cpu_ranks: int | None = None  # None: the setting, else 4
    max_connections: int = 256  # per listener (each connection is two threads)
    max_connections_per_host: int = 64  # per remote address, on TCP
    max_logins_per_host: int = 16  # of those, not yet logged in: beyond it the stalest login makes room
    login_timeout_s: float = 10.0  # TCP: from connect to a hello with the login proof
    idle_timeout_s: float = 900.0  # TCP: no request and no subscription for this long
    send_stall_s: float = 60.0  # a write blocked this long means the client stopped reading
    plan_deadline_s: float = 45.0  # under the client's 60 s timeout, so the `timeout` reply arrives
    planners: int = 2  # planner processes at most
