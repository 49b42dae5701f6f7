"""Requests about the machine check (`rigpilot doctor`): start one, read the stored report, plant a link fault."""

from __future__ import annotations

from typing import Annotated, Any

from rigpilot.engine import paths
from rigpilot.engine.api.protocol import Limit, Number, Text
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.doctor import DEADLINE_ENV, FAULTS_ENV
from rigpilot.engine.hardware.simulated import SimulatedBackend
from rigpilot.engine.jobs import doctor_store
from rigpilot.engine.schema import TERMINAL_STATES
from rigpilot.engine.service.connection import Connection
from rigpilot.engine.service.handling import Engine, RequestGroup

REQUESTS = RequestGroup()
GpuList = Annotated[list[Annotated[int, Limit(0, 4095)]], Limit(max_len=4096)]


@REQUESTS.request(
    "doctor_start", optional={"gpus": GpuList | None, "deadline_s": Annotated[Number, Limit(1, 600)] | None}
)
def doctor_start(
    engine: Engine, conn: Connection, gpus: list[int] | None = None, deadline_s: float | None = None
) -> Any:
    machine = engine.machine
    if machine.source.value == "imported":
        raise UserError(
            "an imported machine is a description, not this computer: its GPUs cannot be checked from here",
            reason="doctor_imported_machine",
        )
    chosen = sorted(set(gpus)) if gpus else [g.index for g in machine.gpus]
    if not chosen:
        raise UserError("this machine has no GPUs to check", reason="doctor_no_gpus")
    running = _running(engine)
    if running is not None:
        raise UserError(f"a machine check is already running (job {running['id']})", reason="doctor_running",
                        job=running["id"])  # fmt: skip
    env: dict[str, str] = {}
    backend = engine.discovery.backend
    if isinstance(backend, SimulatedBackend):
        faults = backend.link_faults()
        if faults:
            env[FAULTS_ENV] = ",".join(f"{a}-{b}:{f}" for (a, b), f in sorted(faults.items()))
    if deadline_s is not None:
        env[DEADLINE_ENV] = str(float(deadline_s))
    spec = {"kind": "doctor", "name": "machine check", "gpus": chosen, "env": env, "max_restarts": 0}
    return {"job": engine.supervisor.submit(spec, None, None)}


@REQUESTS.request("doctor_report")
def doctor_report(engine: Engine, conn: Connection) -> Any:
    report, why = doctor_store.latest(engine.machine, paths.doctor_dir())
    running = _running(engine)
    return {"report": report, "why": why if report is None else None, "running": running["id"] if running else None}


@REQUESTS.request(
    "simulate_link_fault",
    required={"gpus": Annotated[list[Annotated[int, Limit(0, 4095)]], Limit(max_len=2)]},
    optional={"fault": Text | None},
)
def simulate_link_fault(engine: Engine, conn: Connection, gpus: list[int], fault: str | None = None) -> Any:
    backend = engine.discovery.backend
    if not isinstance(backend, SimulatedBackend):
        raise UserError("only a simulated machine's links can be given a fault; this engine runs on real GPUs",
                        reason="not_simulated")  # fmt: skip
    if len(gpus) != 2:
        raise UserError("a link joins two GPUs: give two indices", reason="bad_link")
    a, b = gpus
    try:
        backend.set_link_fault(a, b, fault or None)
    except KeyError:
        raise UserError(f"GPUs {a} and {b} are not both on {engine.machine.label}", reason="unknown_gpu") from None
    except ValueError as e:
        raise UserError(str(e), reason="unknown_link_fault") from None
    return {"gpus": sorted(gpus), "fault": fault or None}


def _running(engine: Engine) -> dict[str, Any] | None:
    """The doctor job not ended yet, or ended but not yet stored (its report is a moment away)."""
    for job in engine.supervisor.jobs(limit=50):
        if job.get("kind") != "doctor":
            continue
        if job.get("state") not in TERMINAL_STATES or job["id"] in engine.doctor_keeping:
            return job
    return None
