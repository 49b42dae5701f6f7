"""Requests about the machine the engine serves: what it is, its telemetry, a simulated fault, switching it, and
planning a job for it (or for another machine)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from rigpilot.engine import paths
from rigpilot.engine.api import protocol
from rigpilot.engine.api.protocol import Limit, Number, Path_, Text
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import SimulatedBackend
from rigpilot.engine.jobs import calibration_store, doctor_store
from rigpilot.engine.service.connection import Connection
from rigpilot.engine.service.handling import Engine, RequestGroup

REQUESTS = RequestGroup()


@REQUESTS.request("machine")
def machine(engine: Engine, conn: Connection) -> Any:
    return engine.machine_message()


@REQUESTS.request("topology")
def topology(engine: Engine, conn: Connection) -> Any:
    from rigpilot.engine.hardware.topology import describe, summarize

    m = engine.machine
    gpus = [g.index for g in m.gpus]
    cells = [[("X" if a == b else (p.topo_code if (p := m.pair(a, b)) else None)) for b in gpus] for a in gpus]
    return {"matrix": {"gpus": gpus, "cells": cells}, "summary": summarize(m).to_dict(), "description": describe(m)}


@REQUESTS.request(
    "telemetry_history",
    # since: a Unix time
    optional={"since": Annotated[Number, Limit(-1e12, 1e12)] | None, "limit": Annotated[int, Limit(1, 100_000)]},
)
def telemetry_history(engine: Engine, conn: Connection, since: float | None = None, limit: int = 3600) -> Any:
    since = None if since is None else float(since)  # SQLite takes any float, not any int
    samples, more = engine.telemetry.since(since, limit=max(1, min(limit, 100_000)), max_bytes=protocol.REPLY_BUDGET_BYTES)
    return {"samples": samples, "more": more, "next_since": samples[-1]["time"] if samples else since}


# A simulated machine only: make a GPU report a hardware fault ("lost", "ecc", "xid N"; null clears it).
@REQUESTS.request("simulate_fault", required={"gpu": Annotated[int, Limit(0, 4095)]}, optional={"fault": Text | None})
def simulate_fault(engine: Engine, conn: Connection, gpu: int, fault: str | None = None) -> Any:
    backend = engine.discovery.backend
    if not isinstance(backend, SimulatedBackend):
        raise UserError("only a simulated machine's GPUs can be given a fault; this engine runs on real GPUs")
    try:
        backend.set_fault(gpu, fault)
    except KeyError:
        raise UserError(f"GPU {gpu} does not exist on {engine.machine.label}") from None
    except ValueError as e:
        raise UserError(str(e)) from None
    return {"gpu": gpu, "fault": fault, "health": backend.health().get(gpu)}


@REQUESTS.request("reload_machine", optional={"simulated_profile": Text})
def reload_machine(engine: Engine, conn: Connection, simulated_profile: str | None = None) -> Any:
    return engine.reload_machine(simulated_profile)


@REQUESTS.request(
    "plan",
    required={"model": Path_},
    optional={
        "workload": dict[str, Any], "options": dict[str, Any], "trust_remote_code": bool,
        "gpus": Annotated[list[Annotated[int, Limit(0, 4095)]], Limit(max_len=4096)] | None,
        "deadline_s": Annotated[float, Limit(0.1, 3600)],
        # Another machine to plan for: a simulated profile's id or Machine.to_dict (the planner checks it).
        "machine": Text | dict[str, Any] | None,
        # Several machines: each node's machine, in the same forms (options.nodes/internode: the link).
        "node_machines": Annotated[list[Text | dict[str, Any]], Limit(max_len=64)] | None,
        # No search: this plan with the user's changes, re-checked (engine.planner.recheck): {plan, overrides}.
        "recheck": dict[str, Any] | None,
        # false: the formula's answer at once, its memory check left to `trace` requests (planworker.plan).
        "verify": bool,
        # No search: this plan's memory traced (engine.planner.verify, its trace cache): {plan}.
        "trace": dict[str, Any] | None,
    },
)  # fmt: skip
def plan(
    engine: Engine, conn: Connection, model: str, workload: dict[str, Any] | None = None, gpus: list[int] | None = None,
    options: dict[str, Any] | None = None, trust_remote_code: bool = False, deadline_s: float | None = None,
    machine: str | dict[str, Any] | None = None, node_machines: list[str | dict[str, Any]] | None = None,
    recheck: dict[str, Any] | None = None, verify: bool = True, trace: dict[str, Any] | None = None,
) -> Any:  # fmt: skip
    # In a planner process: a search cannot be stopped inside this one, and it may run a model's own code.
    assert engine.planners is not None
    budget = min(deadline_s or engine.options.plan_deadline_s, engine.options.plan_deadline_s)
    args: dict[str, Any] = {"model": model, "workload": workload, "gpus": gpus, "options": options, "trust_remote_code": trust_remote_code}
    # Another machine (a simulated profile, an imported one) is checked and planned in the planner process;
    # this machine's latest calibration travels with each request for it, so a new one counts from the next plan on.
    args["machine"], args["node_machines"] = machine, node_machines
    if recheck is not None:
        args["recheck"] = recheck
    if trace is not None:
        args["trace"] = trace
    if not verify:
        args["verify"] = False
    other = machine is not None or bool(node_machines)
    args["calibration"] = None if other else calibration_store.stored(paths.calibration_path())
    args["doctor"] = None if other else doctor_store.latest(engine.machine, paths.doctor_dir())[0]
    return {"result": engine.planners.plan(args, time.monotonic() + budget, conn.client_gone)}
