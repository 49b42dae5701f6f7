"""Jobs across several Rigpilot engines: the head engine leads, each member engine runs its own ranks.

`rigpilot run train … --nodes local,box2`: the engine the CLI talks to is the
head. It checks every node (reachable with its token, the same protocol, the
same kind of machine, the same number of ranks), picks the rendezvous endpoint
(its own address as the others reach it, 127.0.0.1 on loopback, and a port free
now, per job and run) and hands the same job id, checked spec and node facts to
every member (`submit_member`). Each engine then starts its own
`torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint HEAD:PORT
--rdzv-id JOB-RUN` and supervises its own ranks; only the head's torchrun hosts
the rendezvous store (`is_host`).

The head shows one job. A watcher pulls each member's metric records and log
lines over its API into the head's job folder (`metrics/rank<N>.jsonl`,
`logs/rank<N>.log`, `logs/launcher-<node>.log`; records get `node`), so every
view of the job (CLI, GUI, `metrics`) sees every rank. One cancel and one
resume reach every node. A member whose job fails, or whose engine cannot be
reached for `lost_after_s`, fails the whole job: the head stops its own ranks
and cancels the other members, and the job's reason names the node.

Checkpoints (DCP: one file per rank plus rank 0's metadata) go to one folder
every rank sees: the head's job folder when all engines share this computer,
else `<shared dir>/rigpilot-<job>/checkpoints`, which the head proves shared
with a marker each member must read back. Each member's `checkpoints` is a
link to it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigpilot.engine import __version__, paths
from rigpilot.engine.api import protocol
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import FOLDER, PathRefused, check_given_path, is_given_folder, open_given_file, shown
from rigpilot.engine.jobs import submission
from rigpilot.engine.jobs.conditions import Conditions
from rigpilot.engine.jobs.store import (
    ACTIVE_STATES,
    CANCELLED,
    COMPLETED,
    FAILED,
    QUEUED,
    TERMINAL_STATES,
    JobRecord,
)
from rigpilot.engine.service import nodes as registry

log = logging.getLogger(__name__)

PULL_FILE = "nodes-pull.json"  # the head's cursors into each member's metrics and logs
FINAL_WAIT_S = 15.0  # how long a head job whose own ranks ended waits for the other nodes' last records
MAX_NODES = 64


def plan_nodes(plan: dict[str, Any] | None) -> int:
    """`parallelism.nodes` of a plan (or a search result's best plan); 1 when absent."""
    p = submission.plan_of(plan) or {}
    raw = p.get("parallelism")
    par = raw if isinstance(raw, dict) else {}
    n = par.get("nodes", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


@dataclass
class _Member:
    name: str
    address: str
    client: Any = None
    last_ok: float = field(default_factory=time.monotonic)
    state: str | None = None
    exit_reason: str | None = None
    unreachable: str | None = None  # why the last attempt failed
    ranks: list[int] = field(default_factory=list)
    telemetry: dict[str, Any] | None = None  # the node's latest GPU sample, shown with the job


@dataclass
class _Watch:
    job_id: str
    members: list[_Member]
    cursors: dict[str, Any] = field(default_factory=dict)  # node -> {"metrics": {...}, "logs": {rank: offset}}
    done_at: float | None = None  # the head's job ended: one more pass, then stop watching
    passes: int = 0
    final: bool = False  # every member's part had ended before the last pass: all its records are here


class MultiNode:
    def __init__(self, supervisor: Any, *, poll_s: float = 1.0, lost_after_s: float = 5.0):
        self.sup = supervisor
        self.poll_s = poll_s
        self.lost_after_s = lost_after_s
        self._lock = threading.Lock()
        self._watches: dict[str, _Watch] = {}
        self._conditions = Conditions(log)  # a pass that keeps failing (a full disk) is logged once
        self._failures: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        supervisor.finish_hook = self._finished
        supervisor.finish_ready = self._ready_to_finish

    # -- lifetime --------------------------------------------------------------------------------

    def start(self) -> None:
        for rec in self.sup.store.list(ACTIVE_STATES | {QUEUED}):
            if _role(rec) == "head":
                self._watch(rec)
        self._thread = threading.Thread(target=self._loop, name="multinode-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)

    # -- the head: submit, check, cancel, resume ------------------------------------------------

    def submit(
        self, spec: dict[str, Any], plan: dict[str, Any] | None, cwd: str | None, names: list[str],
        shared_dir: str | None = None, *, check: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Submit (or with `check`, only check) one job over the nodes `names` ('local' is this engine)."""
        names = _node_names(names)
        count = len(names)
        planned = plan_nodes(plan)
        if plan is not None and planned not in (1, count):
            raise UserError(f"the plan is for {planned} nodes and --nodes names {count}; plan again or name {planned}")
        members = [registry.get(n) for n in names if n != registry.LOCAL]
        if not members:
            return self.sup.check(spec, plan, cwd) if check else self.sup.submit(spec, plan, cwd)
        me = registry.host_id()
        hellos = {m.name: _hello_of(m) for m in members}
        for m in members:
            h = hellos[m.name]
            if h.get("protocol") != protocol.PROTOCOL_VERSION or h.get("version") != __version__:
                raise UserError(
                    f"node {m.name} runs Rigpilot {h.get('version')} (protocol {h.get('protocol')}) and this engine "
                    f"{__version__} (protocol {protocol.PROTOCOL_VERSION}); run the same version on every node"
                )
            if bool(h.get("simulated")) != self.sup.machine.simulated:
                kinds = {True: "a simulated machine", False: "real GPUs"}
                raise UserError(
                    f"node {m.name} has {kinds[bool(h.get('simulated'))]} and this one {kinds[self.sup.machine.simulated]}; "
                    "a job runs on one kind"
                )
        one_host = all(hellos[m.name].get("host_id") == me for m in members)
        if not one_host and not shared_dir:
            others = ", ".join(m.name for m in members if hellos[m.name].get("host_id") != me)
            raise UserError(
                f"{others} {'runs' if ',' not in others else 'run'} on another computer: a multi-node job needs a "
                "folder every node sees at the same path for its checkpoints (--shared-dir DIR, e.g. an NFS mount)"
            )
        host = "127.0.0.1" if one_host else registry.local_address_towards(members[0])
        if planned == 1 and plan is not None:
            spec = _spread_over_nodes(spec, plan, count)
        sub = submission.prepare(
            spec, plan, cwd, job_id="check", machine=self.sup.machine, max_cpu_ranks=self.sup.max_cpu_ranks,
            nodes=count,
        )
        # The checked spec (absolute paths, degrees, the plan's settings) is what every node runs.
        prepared = {k: v for k, v in sub.spec.to_dict().items() if v is not None and k not in ("id", "spec_version")}
        job_id = "check" if check else self.sup._new_id()
        shared = _shared_checkpoints(Path(shared_dir), job_id, check) if shared_dir else None
        port = _free_port(host)
        head_info: dict[str, Any] = {
            "role": "head", "count": count, "endpoint": f"{_bracket(host)}:{port}", "local_addr": host,
            "node": registry.LOCAL, "names": names, "members": [m.public() for m in members],
            "shared_dir": shared_dir, "ranks_per_node": sub.ranks,
        }  # fmt: skip
        if shared is not None:
            head_info["checkpoints"], head_info["output"] = str(shared["folder"]), str(shared["output"])
        # A check creates nothing: the members are asked whether they see a folder that exists already.
        base = self.sup.job_dir(job_id) if not check else self.sup.jobs_root
        checkpoints = str(shared["folder"]) if shared else str(base / "checkpoints" if not check else base)
        output = str(shared["output"]) if shared else str(base / "output" if not check else base)
        member_infos = {
            m.name: {
                "role": "member", "count": count, "endpoint": head_info["endpoint"], "node": m.name,
                "local_addr": "127.0.0.1" if hellos[m.name].get("host_id") == me else m.host,
                "head": host, "ranks_per_node": sub.ranks, "checkpoints": checkpoints, "output": output,
                **({"shared_marker": {"path": str(shared["marker"]), "nonce": shared["nonce"]}}
                   if shared and shared["marker"] else {}),
            }
            for m in members
        }  # fmt: skip
        if check:
            lines = submission.describe(sub)
            for m in members:
                with registry.client(m) as c:
                    c.request("check_member", job=job_id, spec=prepared, nodes=member_infos[m.name])
                lines.append(f"node {m.name} ({m.address}): would run {sub.ranks} ranks too")
            lines.append(f"{count} nodes × {sub.ranks} ranks; rendezvous at {head_info['endpoint']}")
            return {"ok": True, "lines": lines, "would_run": {**submission.would_run(sub), "nodes": count}}
        done: list[registry.Node] = []
        if shared is None:  # the members link to them before the head's own job exists
            for folder in (checkpoints, output):
                Path(folder).mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            for m in members:
                with registry.client(m) as c:
                    c.request("submit_member", job=job_id, spec=prepared, nodes=member_infos[m.name])
                done.append(m)
            view = self.sup.submit(prepared, plan, cwd, job_id=job_id, nodes=head_info)
        except BaseException as e:
            for m in done:  # no half-submitted job left on the nodes that took it
                with contextlib.suppress(Exception), registry.client(m, timeout=5) as c:
                    c.request("cancel", job=job_id)
                    c.request("delete", job=job_id)
            if self.sup.store.get(job_id) is None:
                shutil.rmtree(self.sup.job_dir(job_id), ignore_errors=True)
            if isinstance(e, UserError) and m not in done and "node" not in e.fields:
                raise _on_node(e, m.name, f"node {m.name}: {e}") from None
            raise
        self._watch(self.sup.resolve(job_id))
        return view

    def cancel(self, ref: str) -> dict[str, Any]:
        rec = self.sup.resolve(ref)
        view = self.sup.cancel(ref)
        if _role(rec) == "head":
            self._tell_members(rec, "cancel")
        return view

    def delete(self, ref: str) -> dict[str, Any]:
        """Delete a job; a head's job goes from every node, with its folder in the shared one."""
        rec = self.sup.resolve(ref)
        reply = self.sup.delete(ref)
        if _role(rec) == "head" and rec.nodes is not None:
            self._tell_members(rec, "delete")
            folder = Path(rec.nodes.get("checkpoints") or "/").parent
            if rec.nodes.get("shared_dir") and folder.name == f"rigpilot-{rec.id}":  # only what this job made
                shutil.rmtree(folder, ignore_errors=True)
        return reply

    def resume(self, ref: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        rec = self.sup.resolve(ref)
        role = _role(rec)
        if role == "member":
            raise UserError(
                f"job {rec.id} is node {rec.nodes.get('node')}'s part of a multi-node job led by the engine at "
                f"{rec.nodes.get('head')}; resume it there"
            )  # type: ignore[union-attr]
        if role != "head":
            return self.sup.resume(ref, env)
        assert rec.nodes is not None
        info = dict(rec.nodes)
        host = info["local_addr"]
        port = _free_port(host)
        info["endpoint"] = f"{_bracket(host)}:{port}"
        info.pop("failure", None)
        run = rec.run + 1
        members = [registry.get(m["name"]) for m in info["members"]]
        for m in members:
            try:
                with registry.client(m) as c:
                    c.request("resume_member", job=rec.id, run=run, endpoint=info["endpoint"], env=env or {})
            except (UserError, OSError, TimeoutError) as e:
                raise UserError(f"cannot resume {rec.id}: node {m.name}: {e}") from None
        with self.sup._lock:
            self.sup.store.update(self.sup.resolve(rec.id), nodes=info)
            view = self.sup.resume(rec.id, env)
        with self._lock:
            self._failures.pop(rec.id, None)
        self._watch(self.sup.resolve(rec.id))
        return view

    # -- a member: take part in a job the head leads -------------------------------------------

    def check_member(self, job: str, spec: dict[str, Any], nodes: dict[str, Any]) -> dict[str, Any]:
        _check_member_id(job)
        info = _member_info(nodes)
        ranks = self.sup.check(spec, None, None, info["count"])["would_run"]["ranks"]
        _member_checks(info, ranks)
        return {"ok": True, "ranks": ranks}

    def submit_member(self, job: str, spec: dict[str, Any], nodes: dict[str, Any]) -> dict[str, Any]:
        _check_member_id(job)
        info = _member_info(nodes)
        ranks = self.sup.check(spec, None, None, info["count"])["would_run"]["ranks"]
        _member_checks(info, ranks)
        return {"job": self.sup.submit(spec, None, None, job_id=job, nodes=info)}

    def resume_member(self, job: str, run: int, endpoint: str, env: dict[str, str] | None) -> dict[str, Any]:
        with self.sup._lock:  # the scheduler must not start it before its run number and endpoint are set
            rec = self.sup.resolve(job)
            if _role(rec) != "member":
                raise UserError(f"job {rec.id} is not part of a multi-node job on this engine")
            assert rec.nodes is not None
            self.sup.store.update(rec, nodes={**rec.nodes, "endpoint": endpoint})
            view = self.sup.resume(rec.id, env)
            live = self.sup.resolve(rec.id)
            self.sup.store.update(live, run=run)
            view["run"] = run
        return view

    # -- watching the members -------------------------------------------------------------------

    def _watch(self, rec: JobRecord) -> None:
        assert rec.nodes is not None
        members = [_Member(m["name"], m["address"]) for m in rec.nodes.get("members", [])]
        w = _Watch(rec.id, members)
        with contextlib.suppress(OSError, ValueError):
            w.cursors = json.loads((self.sup.job_dir(rec.id) / PULL_FILE).read_text())
        with self._lock:
            old = self._watches.get(rec.id)
            if old is not None:
                w.cursors = old.cursors
                for m in old.members:
                    if m.client is not None:
                        m.client.close()
            self._watches[rec.id] = w

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                watches = list(self._watches.values())
            for w in watches:
                try:
                    self._pass(w)
                    self._conditions.cleared(w.job_id, f"watching the nodes of job {w.job_id} works again")
                except Exception as e:
                    self._conditions.failing(w.job_id, f"watching the nodes of job {w.job_id} failed: {e}", e,
                                             cause=repr(e))  # fmt: skip

    def _pass(self, w: _Watch) -> None:
        rec = self.sup.store.get(w.job_id)
        if rec is None:
            self._unwatch(w)
            return
        ended = rec.state in TERMINAL_STATES
        w.passes += 1
        ended_before = [m.state in TERMINAL_STATES for m in w.members]
        for m in w.members:
            # The ranks share the CPUs with the engines on a small machine: logs every other pass, metrics each.
            self._pull(w, m, rec, logs=ended or w.passes % 2 == 1)
        self._save_cursors(w)
        # A part that had ended before this pass wrote its last records before that: this pass brought them.
        w.final = all(before or m.unreachable for before, m in zip(ended_before, w.members, strict=True))
        with self._lock:
            current = self._watches.get(w.job_id) is w
        if not current:
            # A resume replaced this watch while it pulled: its members' states are the last run's, and acting on
            # them would stop the new run on every node.
            return
        if not ended and rec.state != QUEUED:
            # A state from a pull that failed is stale; a node that stays unreachable is `lost` below.
            failed = next((m for m in w.members if m.unreachable is None and m.state in (FAILED, CANCELLED, "interrupted")), None)
            lost = next((m for m in w.members if m.unreachable and time.monotonic() - m.last_ok > self.lost_after_s), None)
            if failed is not None and not rec.cancel_requested:
                self._fail(rec, f"node {failed.name}: its part {failed.state}: {failed.exit_reason or 'no reason given'}")
            elif lost is not None and not rec.cancel_requested:
                self._fail(rec, f"node {lost.name} went away (its engine cannot be reached: {lost.unreachable})")
        if ended:
            if w.done_at is None:
                w.done_at = time.monotonic()
                if rec.state != COMPLETED:
                    self._tell_members(rec, "cancel")
            elif all(m.state in TERMINAL_STATES or m.unreachable for m in w.members) or (
                time.monotonic() - w.done_at > 30
            ):
                self._unwatch(w)

    def _pull(self, w: _Watch, m: _Member, rec: JobRecord, *, logs: bool = True) -> None:
        job_dir = self.sup.job_dir(w.job_id)
        cur = w.cursors.setdefault(m.name, {"metrics": {}, "logs": {}})
        try:
            node = registry.get(m.name)
            if m.client is None:
                m.client = registry.client(node, timeout=10)
                m.client.connect()
            got = False
            while True:
                r = m.client.request("metrics", job=w.job_id, since_cursor=cur["metrics"])
                _append_records(job_dir / "metrics", r["records"], m.name)
                got = got or bool(r["records"])
                cur["metrics"] = r["cursor"]
                state = r["state"]
                if not r["more"]:
                    break
            if logs:
                # The node's GPUs as its engine last sampled them: the head's view of the job shows every node's.
                recent = m.client.request("telemetry_history", since=time.time() - 10, limit=1000)["samples"]
                m.telemetry = recent[-1] if recent else m.telemetry
            if logs or state in TERMINAL_STATES:
                said = m.client.request("logs", job=w.job_id, rank=-1, since_offset=cur["logs"].get("-1", 0))
                _append_text(job_dir / "logs" / f"launcher-{m.name}.log", said["text"])
                cur["logs"]["-1"] = said["next_offset"]
                for rank in said["ranks"]:
                    key = str(rank)
                    r = m.client.request("logs", job=w.job_id, rank=rank, since_offset=cur["logs"].get(key, 0))
                    _append_text(job_dir / "logs" / f"rank{rank}.log", r["text"])
                    cur["logs"][key] = r["next_offset"]
                if said["ranks"] != m.ranks:
                    m.ranks = list(said["ranks"])
                    self._record_ranks(w)
            # Why it ended, only once it has: the job request reads the job's folder.
            m.exit_reason = m.client.request("job", job=w.job_id)["job"].get("exit_reason") if state in TERMINAL_STATES else None
            m.state, m.unreachable = state, None
            m.last_ok = time.monotonic()
            if got:
                self.sup._on_metrics(w.job_id)
        except UserError as e:  # an error reply (the job is gone there) or no such node any more
            if getattr(e, "code", None) == protocol.NOT_FOUND:
                m.state, m.exit_reason = FAILED, "the job is gone from that engine"
            else:
                m.unreachable = str(e)
            self._drop_client(m)
        except (OSError, TimeoutError, ConnectionError, ValueError) as e:
            m.unreachable = str(e) or type(e).__name__
            self._drop_client(m)

    def annotate(self, view: dict[str, Any]) -> dict[str, Any]:
        """A head job's view with each member's latest GPU sample (`nodes.telemetry`), while it is watched."""
        with self._lock:
            w = self._watches.get(view.get("id", ""))
        if w is not None and isinstance(view.get("nodes"), dict):
            view["nodes"] = {**view["nodes"], "telemetry": {m.name: m.telemetry for m in w.members if m.telemetry}}
        return view

    def _record_ranks(self, w: _Watch) -> None:
        with self.sup._lock:
            rec = self.sup.resolve(w.job_id)
            if rec.nodes is None:
                return
            local = sorted(int(f.stem[4:]) for f in (self.sup.job_dir(w.job_id) / "ranks").glob("rank*.json")
                           if f.stem[4:].isdigit())  # fmt: skip
            ranks = {registry.LOCAL: local, **{m.name: m.ranks for m in w.members}}
            self.sup.store.update(rec, nodes={**rec.nodes, "ranks": ranks})

    def _save_cursors(self, w: _Watch) -> None:
        with contextlib.suppress(OSError):
            paths.write_private(self.sup.job_dir(w.job_id) / PULL_FILE, json.dumps(w.cursors))

    def _drop_client(self, m: _Member) -> None:
        if m.client is not None:
            with contextlib.suppress(Exception):
                m.client.close()
            m.client = None

    def _unwatch(self, w: _Watch) -> None:
        with self._lock:
            if self._watches.get(w.job_id) is w:
                del self._watches[w.job_id]
        for m in w.members:
            self._drop_client(m)

    def _fail(self, rec: JobRecord, reason: str) -> None:
        with self._lock:
            if rec.id in self._failures:
                return
            self._failures[rec.id] = reason
        log.warning("job %s: %s; stopping it on every node", rec.id, reason)
        self.sup.stop_run(rec.id)
        self._tell_members(rec, "cancel")

    def _tell_members(self, rec: JobRecord, what: str) -> None:
        for m in (rec.nodes or {}).get("members", []):
            try:
                with registry.client(registry.get(m["name"]), timeout=5) as c:
                    c.request(what, job=rec.id)
            except (UserError, OSError, TimeoutError) as e:
                log.info("job %s: could not %s it on node %s: %s", rec.id, what, m["name"], e)

    def _ready_to_finish(self, rec: JobRecord, waited_s: float) -> bool:
        """Whether a job whose ranks here have ended may end: a head job waits (FINAL_WAIT_S at most, so a
        node that went away cannot hold it) until every member's part has ended and its last metric records
        and logs are here, so the job's outcome and figures are the whole job's, not this node's part."""
        if _role(rec) != "head" or waited_s > FINAL_WAIT_S:
            return True
        with self._lock:
            w = self._watches.get(rec.id)
        return w is None or w.final

    def _finished(self, rec: JobRecord, outcome: dict[str, Any]) -> dict[str, Any]:
        """The supervisor's finish hook: a head job that failed because of a node says which node."""
        if _role(rec) != "head" or outcome.get("state") in (COMPLETED, CANCELLED):
            return outcome
        with self._lock:
            reason = self._failures.get(rec.id)
            w = self._watches.get(rec.id)
        if reason is None and w is not None:
            culprit = next((m for m in w.members if m.state in (FAILED, CANCELLED, "interrupted")), None)
            if culprit is not None:
                reason = f"node {culprit.name}: its part {culprit.state}: {culprit.exit_reason or 'no reason given'}"
            else:
                culprit = next((m for m in w.members if _gone(m.name)), None)
                if culprit is not None:
                    reason = f"node {culprit.name} went away (its engine cannot be reached)"
        if reason is None:
            return outcome
        with self._lock:
            self._failures[rec.id] = reason
        before = outcome.get("exit_reason")
        return {**outcome, "state": FAILED, "resumable": True, "exit_reason": reason + (f" (here: {before})" if before else "")}


# -- helpers ---------------------------------------------------------------------------------------


def _role(rec: JobRecord) -> str | None:
    return (rec.nodes or {}).get("role")


def _spread_over_nodes(spec: dict[str, Any], plan: dict[str, Any], count: int) -> dict[str, Any]:
    """A one-node plan over `count` nodes: every node runs the plan's layout, data parallel across them.

    Tensor and pipeline groups stay inside a node (ranks are node-major); only the replicas multiply.
    Degrees the submission gave for the whole job are left as they are."""
    from rigpilot.engine.layout import Layout

    if spec.get("kind") == "script":
        return spec
    planned = submission.parse_plan(plan)
    par_plan = planned.parallelism if planned is not None else None
    par = dict(spec.get("parallelism") or {})
    degrees = [par.get(k, 1) for k in ("dp_replicate", "dp_shard", "tp", "pp")]
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in degrees):
        return spec  # prepare names what is wrong
    product = degrees[0] * degrees[1] * degrees[2] * degrees[3]
    per_node = len(spec.get("gpus") or (par_plan.gpu_indices if par_plan is not None else []))
    if product == 1 and planned is not None:
        lt = Layout.from_plan(planned)
        par.update(dp_replicate=lt.dp_replicate * count, dp_shard=lt.dp_shard, tp=lt.tp, pp=lt.pp,
                   sequence_parallel=lt.sequence_parallel, reshard_after_forward=lt.reshard_after_forward,
                   cpu_offload=lt.cpu_offload)  # fmt: skip
    elif product > 1 and product == per_node:
        par["dp_replicate"] = degrees[0] * count
    else:
        return spec
    return {**spec, "parallelism": par}


def _node_names(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        n = n.strip()
        if not n:
            continue
        if n in out:
            raise UserError(f"node {n} is named twice in --nodes")
        out.append(n)
    if registry.LOCAL not in out:
        raise UserError("--nodes must name 'local': this engine leads the job and runs its first node")
    if len(out) > MAX_NODES:
        raise UserError(f"at most {MAX_NODES} nodes per job")
    return out


def _hello_of(node: registry.Node) -> dict[str, Any]:
    try:
        with registry.client(node, timeout=10) as c:
            return c.hello
    except UserError as e:
        raise _on_node(e, node.name, f"node {node.name} ({node.address}): {e}; {registry.REMOTE_HINT}") from None
    except (OSError, TimeoutError) as e:
        raise UserError(f"node {node.name} ({node.address}) cannot be reached: {e}; {registry.REMOTE_HINT}",
                        reason="node_unreachable", node=node.name) from None  # fmt: skip


def _on_node(e: UserError, node: str, line: str) -> UserError:
    """A node's refusal said on the head: the same reason and fields, and the node it came from."""
    said = UserError(line, reason=e.reason)
    said.fields = {**e.fields, "node": node}
    return said


def _gone(name: str) -> bool:
    try:
        with registry.client(registry.get(name), timeout=2) as c:
            c.request("hello")
        return False
    except (UserError, OSError, TimeoutError):
        return True


def _check_member_id(job: str) -> None:
    """The head's job id becomes a folder name here: only the engine's own form (a few hex digits) is taken,
    so no id ("../x", "/", 300 characters) can name a folder outside the jobs folder, nor one too long."""
    if not re.fullmatch(r"[0-9a-z]{1,32}", job):
        raise UserError(f"{job[:40]!r} is not a job id (a head engine sends the id it gave the job)")


def _member_info(nodes: dict[str, Any]) -> dict[str, Any]:
    """The node facts a head sends a member, checked: nothing here may reach a command line unchecked."""
    if nodes.get("role") != "member":
        raise UserError("submit_member: nodes.role must be 'member'")
    count = nodes.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or not 2 <= count <= MAX_NODES:
        raise UserError(f"submit_member: nodes.count must be from 2 to {MAX_NODES}")
    for key in ("endpoint", "local_addr", "node", "checkpoints", "output", "head"):
        if not isinstance(nodes.get(key), str) or not nodes[key] or len(nodes[key]) > protocol.MAX_PATH:
            raise UserError(f"submit_member: nodes.{key} is missing")
    registry.split_address(nodes["endpoint"])
    registry.split_address(f"{_bracket(nodes['local_addr'])}:1")
    for key in ("checkpoints", "output"):
        if not Path(nodes[key]).is_absolute():
            raise UserError(f"submit_member: nodes.{key} must be an absolute path")
    return dict(nodes)


def _member_checks(info: dict[str, Any], ranks: int) -> None:
    want = info.get("ranks_per_node")
    if ranks != want:
        raise UserError(
            f"node {info['node']} would run {ranks} ranks and the head {want}: every node runs the same number "
            "(its GPUs for the job, or on a simulated machine its CPU-rank cap)"
        )
    marker = info.get("shared_marker")
    if isinstance(marker, dict):
        try:  # a path from the request: checked, so a FIFO there cannot block this engine
            with open_given_file(str(marker.get("path")), "shared marker") as f:
                seen: str | None = f.read(4096).decode("utf-8", errors="replace").strip()
        except (OSError, PathRefused):
            seen = None
        if seen != marker.get("nonce"):
            raise UserError(
                f"node {info['node']} does not see the shared folder ({marker.get('path')} is missing or different "
                "there): mount it at the same path on every node"
            )
    for key in ("checkpoints", "output"):
        folder = str(info.get(key))
        if not is_given_folder(folder):
            raise UserError(f"node {info['node']} cannot see the job's {key} folder {shown(folder)}")


def _shared_checkpoints(shared: Path, job_id: str, check: bool) -> dict[str, Any]:
    if not shared.is_absolute():
        raise UserError(f"--shared-dir {shared} is not an absolute path (give the path every node mounts)")
    check_given_path(shared, "--shared-dir", expect=FOLDER)
    if not os.access(shared, os.W_OK):
        raise UserError(f"--shared-dir {shared} is not writable")
    folder = shared / f"rigpilot-{job_id}"
    nonce = secrets.token_hex(16)
    if check:
        return {"folder": shared, "output": shared, "marker": None, "nonce": nonce}
    for sub_dir in ("checkpoints", "output"):
        (folder / sub_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    marker = folder / "shared-marker"
    paths.write_private(marker, nonce + "\n")
    return {"folder": folder / "checkpoints", "output": folder / "output", "marker": marker, "nonce": nonce}


def _append_records(metrics_dir: Path, records: list[dict[str, Any]], node: str) -> None:
    by_rank: dict[int, list[str]] = {}
    for r in records:
        rank = r.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1 << 20:
            continue
        by_rank.setdefault(rank, []).append(json.dumps({**r, "node": node}) + "\n")
    for rank, lines in by_rank.items():
        with paths.open_private(metrics_dir / f"rank{rank}.jsonl", "ab") as f:
            f.write("".join(lines).encode())  # whole lines in one write: a reader never sees half of one


def _append_text(path: Path, text: str) -> None:
    if text:
        with paths.open_private(path, "ab") as f:
            f.write(text.encode())


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

