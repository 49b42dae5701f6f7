"""Requests for what a job writes: an inference job's completions, a rank's log, the metrics, and following
them (and telemetry, and the job list) as events after `subscribe`. Every read is paged to fit one reply."""

from __future__ import annotations

from typing import Annotated, Any

from rigpilot.engine.api import protocol
from rigpilot.engine.api.protocol import MAX_OFFSET, Bytes, Cursor, Limit, ProtocolError, Text, Topics
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.metrics import read_records
from rigpilot.engine.jobs.results import RESULTS_FILE, read_results
from rigpilot.engine.service.connection import Connection
from rigpilot.engine.service.handling import Engine, RequestGroup

REQUESTS = RequestGroup()


@REQUESTS.request(
    "results",
    required={"job": Text},
    optional={"start": Annotated[int, Limit(0, 1 << 30)], "limit": Annotated[int, Limit(1, 10_000)], "max_bytes": Bytes},
)
def results(
    engine: Engine, conn: Connection, job: str, start: int = 0, limit: int = 1000, max_bytes: int = 512 * 1024
) -> Any:
    rec = engine.supervisor.resolve(job)
    if rec.kind != "infer":
        raise UserError(f"job {rec.id} is a {rec.kind} job; only inference jobs write completions")
    budget = max(4096, min(max_bytes, protocol.REPLY_BUDGET_BYTES // 2))  # escaping can double the size
    reply = read_results(engine.supervisor.job_dir(rec.id) / RESULTS_FILE, start=start, limit=limit, max_bytes=budget)
    return {"job": rec.id, "state": rec.state, **reply}


@REQUESTS.request(
    "logs",
    required={"job": Text},
    optional={
        "rank": Annotated[int, Limit(-1, 1 << 20)] | None,  # -1: torchrun's own output
        "since_offset": Annotated[int, Limit(-MAX_OFFSET, MAX_OFFSET)],  # negative: from the end
        "max_bytes": Bytes,
    },
)
def logs(
    engine: Engine, conn: Connection, job: str, rank: int | None = None, since_offset: int = 0,
    max_bytes: int = 256 * 1024,
) -> Any:  # fmt: skip
    rec = engine.supervisor.resolve(job)
    logs_dir = engine.supervisor.job_dir(rec.id) / "logs"
    if rank is None:
        rank = rec.failed_rank if rec.failed_rank is not None else 0
    name = "launcher.log" if rank < 0 else f"rank{rank}.log"  # rank -1: torchrun's own output
    path = logs_dir / name
    ranks = sorted(int(p.stem[4:]) for p in logs_dir.glob("rank*.log") if p.stem[4:].isdigit())
    world = rec.ranks * int((rec.nodes or {}).get("count", 1))  # a multi-node job's head shows every node's ranks
    if rank >= 0 and rank >= world and rank not in ranks:
        raise UserError(f"job {rec.id} has ranks 0–{world - 1}; there is no rank {rank}")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = 0
    start = max(size + since_offset, 0) if since_offset < 0 else min(since_offset, size)
    budget = max(1, min(max_bytes, protocol.REPLY_BUDGET_BYTES // 2))  # escaping can double the size
    data = b""
    if size > start:
        with path.open("rb") as f:
            f.seek(start)
            data = f.read(budget)
    end = start + len(data)
    if end < size and b"\n" in data:
        data = data[: data.rfind(b"\n") + 1]  # whole lines only, so no character is split either
        end = start + len(data)
    return {
        "job": rec.id, "rank": rank, "ranks": ranks, "path": str(path), "offset": start,
        "next_offset": end, "size": size, "more": end < size, "text": data.decode("utf-8", "replace"),
        "state": rec.state,
    }  # fmt: skip


@REQUESTS.request("metrics", required={"job": Text}, optional={"since_cursor": Cursor | None, "max_bytes": Bytes})
def metrics(
    engine: Engine, conn: Connection, job: str, since_cursor: dict[str, int] | None = None, max_bytes: int = 512 * 1024
) -> Any:
    rec = engine.supervisor.resolve(job)
    records, cursor, more = read_records(
        engine.supervisor.job_dir(rec.id) / "metrics", since_cursor,
        max_bytes=max(4096, min(max_bytes, protocol.REPLY_BUDGET_BYTES)),
    )  # fmt: skip
    return {"job": rec.id, "records": records, "cursor": cursor, "more": more, "state": rec.state}


@REQUESTS.request(
    "subscribe",
    required={"topics": Topics},
    optional={"metrics_cursors": Annotated[dict[str, Cursor], Limit(max_len=1024)]},
)
def subscribe(
    engine: Engine, conn: Connection, topics: list[str], metrics_cursors: dict[str, dict[str, int]] | None = None
) -> Any:
    resolved = []
    cursors = {}
    for t in topics:
        if t in protocol.TOPICS:
            resolved.append(t)
        elif t.startswith("metrics:"):
            rec = engine.supervisor.resolve(t.removeprefix("metrics:"))
            resolved.append(f"metrics:{rec.id}")
            given = (metrics_cursors or {}).get(t.removeprefix("metrics:"), (metrics_cursors or {}).get(rec.id))
            cursors[rec.id] = dict(given or {})  # {} replays the whole history
        else:
            raise ProtocolError(protocol.INVALID, f"unknown topic {t!r}; topics: telemetry, jobs, metrics:<job>")
    conn.topics |= set(resolved)
    conn.metrics_cursors.update(cursors)
    for job_id in cursors:
        conn.poke_metrics(job_id)
    return {"topics": sorted(conn.topics)}


@REQUESTS.request("unsubscribe", optional={"topics": Topics})
def unsubscribe(engine: Engine, conn: Connection, topics: list[str] | None = None) -> Any:
    conn.topics -= set(topics) if topics is not None else set(conn.topics)
    return {"topics": sorted(conn.topics)}
