"""Requests about the job queue: submitting (or only checking) a job, listing, showing, cancelling, resuming,
renaming and deleting jobs. A job over several engines goes through engine.service.multinode."""

from __future__ import annotations

from typing import Annotated, Any

from rigpilot.engine.api import protocol
from rigpilot.engine.api.protocol import Limit, NodeNames, Path_, ProtocolError, Text
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.store import ALL_STATES
from rigpilot.engine.service.connection import Connection
from rigpilot.engine.service.handling import Engine, RequestGroup

REQUESTS = RequestGroup()

_NOT_BOTH = "a job goes to SLURM or across nodes, not both: SLURM chooses a SLURM job's nodes itself"


# slurm: {partition?, account?, time?, login?} submits the job to SLURM with sbatch (engine.jobs.slurm).
# nodes: engines the job spans ("local" and names from the node registry); shared_dir: their common folder.
@REQUESTS.request(
    "submit",
    required={"spec": dict[str, Any]},
    optional={"plan": dict[str, Any] | None, "cwd": Path_ | None, "slurm": dict[str, Any] | None, "nodes": NodeNames,
              "shared_dir": Path_ | None},
)  # fmt: skip
def submit(
    engine: Engine, conn: Connection, spec: dict[str, Any], plan: dict[str, Any] | None = None, cwd: str | None = None,
    slurm: dict[str, Any] | None = None, nodes: list[str] | None = None, shared_dir: str | None = None,
) -> Any:  # fmt: skip
    if nodes:
        if slurm is not None:
            raise UserError(_NOT_BOTH)
        return {"job": engine.multinode.submit(spec, plan, cwd, nodes, shared_dir)}
    return {"job": engine.supervisor.submit(spec, plan, cwd, slurm)}


# The whole submission path without creating anything: what would run, or the one-line refusal
# (a SLURM job's request is put to SLURM with sbatch --test-only, which queues nothing).
@REQUESTS.request(
    "check",
    required={"spec": dict[str, Any]},
    optional={"plan": dict[str, Any] | None, "cwd": Path_ | None, "nodes": NodeNames, "shared_dir": Path_ | None,
              "slurm": dict[str, Any] | None},
)  # fmt: skip
def check(
    engine: Engine, conn: Connection, spec: dict[str, Any], plan: dict[str, Any] | None = None, cwd: str | None = None,
    nodes: list[str] | None = None, shared_dir: str | None = None, slurm: dict[str, Any] | None = None,
) -> Any:  # fmt: skip
    if nodes:
        if slurm is not None:
            raise UserError(_NOT_BOTH)
        return engine.multinode.submit(spec, plan, cwd, nodes, shared_dir, check=True)
    return engine.supervisor.check(spec, plan, cwd, slurm_options=slurm)


@REQUESTS.request(
    "jobs", optional={"states": Annotated[list[Text], Limit(max_len=64)], "limit": Annotated[int, Limit(1, 100_000)]}
)
def jobs(engine: Engine, conn: Connection, states: list[str] | None = None, limit: int = 200) -> Any:
    unknown = sorted(set(states or []) - ALL_STATES)
    if unknown:
        raise ProtocolError(protocol.INVALID, f"jobs.states: unknown state {unknown[0]!r}; states: {', '.join(sorted(ALL_STATES))}")
    return {"jobs": engine.supervisor.jobs(states, max(1, limit))}


@REQUESTS.request("job", required={"job": Text})
def job(engine: Engine, conn: Connection, job: str) -> Any:
    return {"job": engine.multinode.annotate(engine.supervisor.detail(job))}


@REQUESTS.request("cancel", required={"job": Text})
def cancel(engine: Engine, conn: Connection, job: str) -> Any:
    return {"job": engine.multinode.cancel(job)}


# env's values are checked by engine.jobs.limits.check_env.
@REQUESTS.request("resume", required={"job": Text}, optional={"env": Annotated[dict[str, str], Limit(max_len=1024)] | None})
def resume(engine: Engine, conn: Connection, job: str, env: dict[str, str] | None = None) -> Any:
    return {"job": engine.multinode.resume(job, env)}


@REQUESTS.request("delete", required={"job": Text})
def delete(engine: Engine, conn: Connection, job: str) -> Any:
    return engine.multinode.delete(job)


@REQUESTS.request("rename", required={"job": Text, "name": Text})
def rename(engine: Engine, conn: Connection, job: str, name: str) -> Any:
    return {"job": engine.supervisor.rename(job, name)}
