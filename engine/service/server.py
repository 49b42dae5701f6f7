"""The engine service process: socket server, telemetry fan-out, and the job supervisor.

One per user, guarded by an fcntl lock in the runtime dir: whoever holds the
lock owns the socket, so a socket file left by a killed service is stale by
definition and is replaced. Each client connection gets a reader thread (it
answers requests in order) and a writer thread (replies and pushed events), so
a slow subscriber never holds up the sampler or the supervisor: telemetry
beyond its backlog is dropped for that client, and metrics are read from disk
at the client's own cursor, so those are never lost.

The TCP listener speaks only TLS (engine.service.tls): each connection's
handshake, then a login that proves the token without sending it. A client that
speaks plain text there (an older Rigpilot sending its token in clear) gets one
`tls_required` line telling it to upgrade.

Nothing a client sends can hold the service's resources without bound:
- connections are capped per listener and per remote host (two threads each,
  so the cap is what bounds memory; the excess is closed, on the local socket
  with a `busy` line: before TLS nothing can be said on TCP);
- logins in progress are capped per remote host too, but a new connection is
  never turned away for them: the one that has kept the engine waiting longest
  (silent ones before any that sent something) makes room. A flood of idle
  connections from one host so only ever displaces itself, and a real client of
  that host, which answers each step at once, logs in while it lasts;
- a TCP client that has not logged in within the login timeout, or that sent
  nothing for the idle timeout while subscribed to nothing, is closed;
- a client that does not read first stops being read (its replies queue up to
  a soft cap), and is cut off when pushed events pass a hard byte cap or a
  write stalls;
- the one request whose work grows with its input, `plan`, runs in a planner
  process (engine.service.planworker) that is killed at its deadline or when
  its client hangs up; every other request is bounded by construction (paged
  reads, LIMITs, ranges checked by the protocol).

Stopping the service (SIGTERM, Ctrl-C, `shutdown`) leaves jobs running; the
next service re-adopts them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import selectors
import signal
import socket
import sqlite3
import ssl
import struct
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigpilot.engine import __version__, paths
from rigpilot.engine.diskspace import disk_full, is_disk_full, no_room
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.discovery import open_backend
from rigpilot.engine.hardware.sampler import Sampler
from rigpilot.engine.hardware.simulated import SimulatedBackend
from rigpilot.engine.jobs import calibration_store
from rigpilot.engine.jobs.conditions import Conditions
from rigpilot.engine.jobs.metrics import read_records
from rigpilot.engine.jobs.resilient_store import Recovery, ResilientJobStore, ResilientTelemetryStore
from rigpilot.engine.jobs.results import RESULTS_FILE, read_results
from rigpilot.engine.jobs.scaling import Studies
from rigpilot.engine.jobs.store import ALL_STATES, COMPLETED
from rigpilot.engine.jobs.supervisor import Supervisor, SupervisorOptions
from rigpilot.engine.service import nodes, protocol, tls
from rigpilot.engine.service.multinode import MultiNode
from rigpilot.engine.service.planworker import ClientGone, PlannerBug, PlannerPool, PlanTimeout
from rigpilot.engine.service.protocol import ProtocolError, Request

log = logging.getLogger(__name__)

SAMPLES_IN_MEMORY = 16
_TELEMETRY_BACKLOG = 64  # queued telemetry events per client before new ones are dropped
# A client's replies queue up to this before its next request is read (it then waits, as TCP would).
_SOFT_QUEUE_BYTES = 1 << 20
# Pushed events cannot wait: past this the client is not reading and its connection is closed.
_HARD_QUEUE_BYTES = 8 << 20
_REAP_PERIOD_S = 0.5
_SILENT_S = 1.0  # a TCP connection that sent nothing for this long is no client at work (see _stalest_login)


class AlreadyRunning(Exception):
    """Another engine service of this user holds the lock."""


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


class Connection:
    """One client: an outbox drained by a writer thread, its subscriptions and metric cursors."""

    def __init__(
        self, service: EngineService, sock: socket.socket, peer: str, *, needs_auth: bool, listener: str, host: str
    ):
        self.service = service
        self.sock = sock
        self.peer = peer
        self.listener = listener  # "unix" or "tcp": the connection counts against that listener's cap
        self.host = host  # the remote address, for the per-host cap ("" on the unix socket)
        self.remote = needs_auth
        self.authenticated = not needs_auth
        self.client = ""  # the name the client gave in hello: each name hears each notice once
        # What replies are written to: the socket itself, or (TCP) its TLS channel once the handshake is done.
        self.stream: Any = None if needs_auth else sock
        self.nonce = ""  # TCP: this connection's login challenge
        self.client_nonce = ""
        # A login in progress: since when it waits for its client, whether its client ever sent a byte,
        # and whether the engine is busy with what it sent (then it is not the client's wait).
        self.waiting_since = time.monotonic()
        self.spoke = False
        self.working = False
        self.topics: set[str] = set()
        self.metrics_cursors: dict[str, dict[str, int]] = {}
        self.dropped = 0
        self.created = self.last_request = time.monotonic()
        self.busy = False  # a request is being answered
        self.kill_at: float | None = None  # a closing connection is cut off here if its writer has not finished
        self._outbox: deque[tuple[bytes, bool]] = deque()
        self._droppable_queued = 0
        self._queued_bytes = 0
        self.sending_since: float | None = None
        self._pokes: dict[str, None] = {}  # jobs whose metric files grew, in order, each once
        self._cond = threading.Condition()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name=f"engine-writer-{peer}", daemon=True)
        self._writer.start()

    def send(self, message: dict[str, Any]) -> None:
        self.send_bytes(protocol.encode(message))

    def send_bytes(self, data: bytes, *, droppable: bool = False) -> None:
        with self._cond:
            if self._closing or self.stream is None:
                return  # before TLS is up there is no way to say anything
            if droppable and self._droppable_queued >= _TELEMETRY_BACKLOG:
                self.dropped += 1  # live telemetry: the history on disk has the rest
                return
            if self._outbox and self._queued_bytes + len(data) > _HARD_QUEUE_BYTES:
                log.warning("client %s is not reading (%d bytes queued); closing its connection", self.peer,
                            self._queued_bytes)  # fmt: skip
                self._abort_locked()
                return
            self._outbox.append((data, droppable))
            self._droppable_queued += droppable
            self._queued_bytes += len(data)
            self._cond.notify_all()

    def wait_for_room(self) -> None:
        """Hold the reader while this client's replies are unread: pipelining cannot queue without end."""
        with self._cond:
            while self._queued_bytes > _SOFT_QUEUE_BYTES and not self._closing:
                self._cond.wait(1.0)

    def poke_metrics(self, job_id: str) -> None:
        with self._cond:
            self._pokes[job_id] = None
            self._cond.notify_all()

    @property
    def closing(self) -> bool:
        return self._closing

    def refuse(self, code: str, message: str, *, in_plain_text: bool = False) -> None:
        """End a connection, saying why wherever the client can read it.

        Before TLS is up a line can only go in plain text, and only `in_plain_text` when the client has said
        nothing for long (a TLS client whose first bytes are still on their way would take it for garbage)."""
        if self.stream is not None:
            self.send(protocol.error_reply(None, code, message))
            self.close(grace_s=1.0)
            return
        if in_plain_text and not self.spoke:
            with contextlib.suppress(OSError):
                self.sock.send(protocol.encode(protocol.error_reply(None, code, message)), socket.MSG_DONTWAIT)
        self.abort()

    def waiting_for_client(self) -> bool:
        """Whether a login in progress waits on its client, not on the engine (nothing of its left unread)."""
        if self.working:
            return False
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return True
        except OSError:
            return True

    def on_login_wait(self) -> None:
        self.working = False
        self.waiting_since = time.monotonic()

    def close(self, grace_s: float = 5.0) -> None:
        """Close once everything queued so far has been written (cut off after `grace_s` if it is not read)."""
        with self._cond:
            self._closing = True
            if self.kill_at is None:
                self.kill_at = time.monotonic() + grace_s
            self._cond.notify_all()

    def abort(self) -> None:
        """Close now, dropping whatever is queued: a blocked write or read returns at once."""
        with self._cond:
            self._abort_locked()

    def _abort_locked(self) -> None:
        self._closing = True
        self._outbox.clear()
        self._pokes.clear()
        self._queued_bytes = self._droppable_queued = 0
        self._cond.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the writer in sendall and the reader in recv

    def _write_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._outbox and not self._pokes and not self._closing:
                        self._cond.wait()
                    if self._pokes:
                        # Metrics first: a job's last records then always precede its "ended" event.
                        job_id = next(iter(self._pokes))
                        del self._pokes[job_id]
                        data = None
                    elif self._outbox:
                        data, droppable = self._outbox.popleft()
                        self._droppable_queued -= droppable
                        self._queued_bytes -= len(data)
                        self._cond.notify_all()  # the reader may be waiting for room
                        job_id = None
                    else:
                        break
                self.sending_since = time.monotonic()
                if job_id is not None:
                    self._push_metrics(job_id)
                elif data is not None:
                    self.stream.sendall(data)
                self.sending_since = None
        except OSError:
            pass  # the client went away
        except Exception:
            log.exception("writing to client %s failed", self.peer)
        finally:
            self.sending_since = None
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
            with self._cond:
                self._closing = True
                self._outbox.clear()
                self._queued_bytes = 0
                self._cond.notify_all()

    def client_gone(self) -> bool:
        """Whether the client hung up (checked while a long request runs; pipelined bytes are left unread)."""
        if self._closing:
            return True
        if self.stream is not self.sock:
            return tls.peer_gone(self.sock)  # what is unread may be a TLS alert: ask the kernel instead
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _push_metrics(self, job_id: str) -> None:
        if f"metrics:{job_id}" not in self.topics:
            return
        metrics_dir = self.service.supervisor.job_dir(job_id) / "metrics"
        cursor = self.metrics_cursors.get(job_id, {})
        records, cursor, more = read_records(metrics_dir, cursor, max_bytes=protocol.REPLY_BUDGET_BYTES)
        self.metrics_cursors[job_id] = cursor
        if records:
            self.stream.sendall(protocol.encode(protocol.event("metrics", job=job_id, records=records, cursor=cursor)))
        if more:
            self.poke_metrics(job_id)


class EngineService:
    def __init__(self, options: ServiceOptions | None = None):
        self.options = options or ServiceOptions()
        self._stop = threading.Event()
        self._lock_file: Any = None
        self._connections: set[Connection] = set()
        self._conn_lock = threading.Lock()
        self._listeners: list[socket.socket] = []
        self._socket_path: Path | None = None
        self._socket_inode: int | None = None
        self.tcp_address: tuple[str, int] | None = None
        self.started = time.time()
        self.log_location = _log_location()
        self._refused = 0  # connections refused since the last log line about it
        self._refused_logged = 0.0
        self._said: dict[str, float] = {}  # log lines said at most once per 10 s, by kind: when each last was
        self.identity: tls.Identity | None = None
        self.tls_context: ssl.SSLContext | None = None
        self.planners: PlannerPool | None = None
        self._machine_lock = threading.Lock()  # one machine switch at a time
        self._ended_since_trim = 0  # connections ended since memory was last handed back
        self._trimmed = 0.0
        # What the engine did by itself that its users should hear of (a damaged database it rebuilt): each
        # notice rides on the next reply to each client name once, so the CLI says it once, not at every command.
        self._notices: list[dict[str, Any]] = []
        self._told: dict[str, int] = {}  # client name -> how many notices it has been given
        self._notice_lock = threading.Lock()
        self._conditions = Conditions(log)  # lasting problems (telemetry on a full disk): one log line each

    # -- lifetime -------------------------------------------------------------

    def acquire_lock(self) -> None:
        path = paths.lock_path()
        f = path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise AlreadyRunning(f"the engine service is already running (pid {holder or '?'})") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock_file = f

    def setup(self) -> None:
        """Everything but serving: lock, machine, stores, supervisor, sockets. Raises AlreadyRunning."""
        paths.make_private()  # before anything is written: the service's files and its ranks' are 0600
        self.acquire_lock()
        self.discovery = open_backend(simulate=self.options.simulate)
        self.machine = self.discovery.machine
        for detail in self.discovery.details:
            log.info("%s", detail)
        try:
            self.store = ResilientJobStore(paths.database_path(), paths.jobs_dir(), on_recovery=self._recovered)
            self.telemetry = ResilientTelemetryStore(
                paths.telemetry_path(), min_interval=max(1.0, self.options.telemetry_period), on_recovery=self._recovered
            )
        except (OSError, sqlite3.Error) as e:
            # SQLite says "disk I/O error" when it cannot even make its WAL files: the free space decides.
            if is_disk_full(e) or no_room(paths.engine_state_dir()):
                raise disk_full(paths.engine_state_dir(), None, "the engine cannot open its databases") from None
            raise
        self.supervisor = Supervisor(
            self.store, paths.jobs_dir(), self.machine, self.discovery.backend,
            SupervisorOptions(
                grace_s=self.options.grace_s, failure_grace_s=self.options.failure_grace_s,
                max_cpu_ranks=self.options.max_cpu_ranks or _setting_max_cpu_ranks(),
                warm_worker=_setting_warm_worker(),
            ),
            on_job=self._publish_job, on_metrics=self._publish_metrics, telemetry=self.telemetry,
        )  # fmt: skip
        self.multinode = MultiNode(self.supervisor)
        self.sampler = self._new_sampler(self.discovery.backend)
        self._listen_unix()
        if self.options.tcp:
            self.token = paths.read_or_create_token()
            self.identity = tls.load_or_create_identity()
            self.tls_context = tls.server_context(self.identity)
            self._listen_tcp(self.options.tcp)
        self.planners = PlannerPool(self.machine, size=self.options.planners)
        self.studies = Studies(paths.engine_state_dir() / "scaling", self.supervisor, self._plan_for_study, paths.write_private)
        self.supervisor.start()
        self.multinode.start()
        self.sampler.start()
        threading.Thread(target=self._reap_loop, name="engine-reaper", daemon=True).start()

    def _recovered(self, recovery: Recovery) -> None:
        """One of the databases was damaged and the engine recovered: said once in the log, once to each client."""
        notice = {**recovery.notice(), "time": time.time()}
        log.warning("%s", notice["message"])
        subs = self._subscribers("jobs")  # a window that only listens (the app's stream) hears it now
        with self._notice_lock:
            self._notices.append(notice)
            for c in subs:
                if self._told.get(c.client, 0) == len(self._notices) - 1:
                    self._told[c.client] = len(self._notices)
        data = protocol.encode(protocol.event("notice", notice=notice))
        for c in subs:
            c.send_bytes(data)

    def _untold(self, conn: Connection) -> list[dict[str, Any]]:
        with self._notice_lock:
            told = self._told.get(conn.client, 0)
            self._told[conn.client] = len(self._notices)
            return self._notices[told:]

    def _new_sampler(self, backend: Any) -> Sampler:
        period = self.options.telemetry_period
        # The telemetry store on disk answers history requests; in memory only the latest few samples are kept
        # (an hour of them held about 8 MiB for nothing, and made a long-running engine's RSS climb for that hour).
        sampler = Sampler(backend, period=period, slow_period=max(5.0, period), history=SAMPLES_IN_MEMORY)
        sampler.subscribe(self._on_sample)
        return sampler

    def reload_machine(self, simulated_profile: str | None = None) -> dict[str, Any]:
        """Serve the machine the settings name now, without a restart; every subscriber is told.

        `simulated_profile`, when given, is stored in this engine's settings first (a remote GUI
        cannot write them). The machine is found exactly as at start-up (`open_backend`), which is
        also what the CLI does when no engine runs. The CPU-rank cap applies at once; the machine
        only when no job is queued or running, else the refusal names those jobs.
        """
        from rigpilot.engine.hardware.discovery import SIMULATE_ENV
        from rigpilot.engine.hardware.simulated import load_profile
        from rigpilot.engine.settings import Settings

        with self._machine_lock:
            settings = Settings.load()
            if simulated_profile is not None and simulated_profile != settings.simulated_profile:
                load_profile(simulated_profile)  # an unknown one is refused here, naming the known ones
                settings.simulated_profile = simulated_profile
                settings.save()
            if self.options.max_cpu_ranks is None:
                self.supervisor.options.max_cpu_ranks = _setting_max_cpu_ranks()
            pinned = self.options.simulate or os.environ.get(SIMULATE_ENV)
            if pinned:
                how = "--simulate" if self.options.simulate else SIMULATE_ENV
                raise UserError(
                    f"this engine was started on the simulated profile {pinned!r} ({how}), which wins over "
                    "Settings; stop it and start it without that to follow Settings"
                )
            discovery = open_backend()
            if discovery.machine.to_dict() == self.machine.to_dict():
                discovery.backend.close()
                self.discovery.notes, self.discovery.details = discovery.notes, discovery.details
                return {"changed": False, **self._machine_message()}
            try:
                self.supervisor.replace_machine(discovery.machine, discovery.backend)
            except BaseException:
                discovery.backend.close()
                raise
            old, old_sampler, old_planners = self.discovery, self.sampler, self.planners
            old_sampler.stop()
            self.discovery, self.machine = discovery, discovery.machine
            self.sampler = self._new_sampler(discovery.backend)
            # A plan in flight finishes in its old process, which then goes; the next plans see the new machine.
            self.planners = PlannerPool(self.machine, size=self.options.planners)
            if old_planners is not None:
                old_planners.close()
            self.sampler.start()
            old.backend.close()
            log.info("now serving %s (was %s)%s", self.machine.label, old.machine.label, "".join(f"; {x}" for x in discovery.details))
        self._publish_machine()
        return {"changed": True, **self._machine_message()}

    def serve_forever(self) -> None:
        sel = selectors.DefaultSelector()
        for s in self._listeners:
            sel.register(s, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.5):
                    self._accept(key.fileobj)  # type: ignore[arg-type]
        finally:
            sel.close()
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        for s in self._listeners:
            with contextlib.suppress(OSError):
                s.close()
        self._listeners.clear()
        self._remove_socket_file()
        with self._conn_lock:
            conns = list(self._connections)
        for c in conns:
            c.close()
        if self.planners is not None:
            self.planners.close()
        with contextlib.suppress(AttributeError):
            self.sampler.stop()
        with contextlib.suppress(AttributeError):
            self.multinode.stop()
        with contextlib.suppress(AttributeError):
            self.supervisor.stop()
        with contextlib.suppress(AttributeError):
            self.telemetry.close()
        with contextlib.suppress(AttributeError):
            self.store.close()
        with contextlib.suppress(AttributeError):
            self.discovery.backend.close()
        if self._lock_file:
            self._lock_file.close()
            self._lock_file = None

    # -- sockets --------------------------------------------------------------

    def _listen_unix(self) -> None:
        path = paths.socket_path()
        # We hold the lock, so any socket file here was left by a service that died.
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            s.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        s.listen(256)
        self._listeners.append(s)
        self._socket_path = path
        self._socket_inode = path.stat().st_ino

    def _listen_tcp(self, spec: str) -> None:
        host, port = protocol.parse_address(spec)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            s.close()
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        s.listen(256)  # a burst of idle connections must not keep a real client out of the queue
        self._listeners.append(s)
        self.tcp_address = s.getsockname()[:2]
        assert self.identity is not None
        log.info(
            "listening for remote clients on %s:%s over TLS (certificate %s; token in %s)", *self.tcp_address,
            self.identity.fingerprint, paths.token_path(),
        )  # fmt: skip

    def _remove_socket_file(self) -> None:
        # Only our own socket: a newer service may already have replaced it.
        p = self._socket_path
        if p is not None:
            with contextlib.suppress(OSError):
                if p.stat().st_ino == self._socket_inode:
                    p.unlink()
            self._socket_path = None

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except OSError:
            return
        is_unix = sock.family == socket.AF_UNIX
        if is_unix and not _same_user(sock):
            sock.close()
            return
        listener, host = ("unix", "") if is_unix else ("tcp", str(addr[0]))
        peer = "unix" if is_unix else f"{addr[0]}:{addr[1]}"
        make_room = None
        with self._conn_lock:
            on_listener = sum(1 for c in self._connections if c.listener == listener)
            from_host = [c for c in self._connections if host and c.host == host and not c.closing]
            logging_in = [c for c in from_host if not c.authenticated]
            if on_listener >= self.options.max_connections:
                why = f"the engine already serves {on_listener} connections, its limit; close some and try again"
            elif host and len(from_host) >= self.options.max_connections_per_host:
                why = f"{host} already has {len(from_host)} connections to the engine, the limit per host"
            else:
                why = None
                if host and len(logging_in) >= self.options.max_logins_per_host:
                    make_room = _stalest_login(logging_in)
        if why is not None:
            self._refuse(sock, why)
            return
        if make_room is not None:
            make_room.refuse(protocol.BUSY, (
                f"{host} has {len(logging_in)} connections logging in at once, the limit per host, and this one "
                "kept the engine waiting longest; try again"
            ))  # fmt: skip
            self._say_once("room", f"{host} opens connections that do not log in; the stalest make room for new ones")
        # Only this thread adds connections, so the counts above still hold.
        try:
            conn = Connection(self, sock, peer, needs_auth=not is_unix, listener=listener, host=host)
        except RuntimeError:  # "can't start new thread": the system's limit, below ours
            self._refuse(sock, "the engine cannot start another thread now; close some connections")
            return
        with self._conn_lock:
            self._connections.add(conn)
        try:
            threading.Thread(target=self._serve, args=(conn,), name=f"engine-client-{peer}", daemon=True).start()
        except RuntimeError:
            with self._conn_lock:
                self._connections.discard(conn)
            conn.abort()

    def _say_once(self, kind: str, line: str) -> None:
        """Log `line` unless a line of this kind was logged in the last 10 s (a flood is not a log flood)."""
        now = time.monotonic()
        if now - self._said.get(kind, -1e9) > 10:
            self._said[kind] = now
            log.warning("%s", line)

    def _refuse(self, sock: socket.socket, why: str) -> None:
        # On TCP nothing can be said before TLS is up (a TLS client would take a plain line for a broken
        # handshake): the connection just ends, and the client tries again for a while.
        with contextlib.suppress(OSError):
            sock.setblocking(False)  # one short line into an empty buffer; never wait on this client
            if sock.family == socket.AF_UNIX:
                sock.send(protocol.encode(protocol.error_reply(None, protocol.BUSY, why)))
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged > 10:  # a flood of refusals is one log line per 10 s
            log.warning("refused %d connection(s): %s", self._refused, why)
            self._refused, self._refused_logged = 0, now

    def _reap_loop(self) -> None:
        """Close connections that never logged in, idle ones, and ones whose client stopped reading."""
        while not self._stop.wait(_REAP_PERIOD_S):
            try:
                now = time.monotonic()
                self._reap(now)
                if self.planners is not None:
                    self.planners.trim()
                if self._ended_since_trim and now - self._trimmed > 5:
                    self._ended_since_trim, self._trimmed = 0, now
                    _LIBC.release_memory()
            except Exception:
                log.exception("the connection reaper failed")

    def _reap(self, now: float) -> None:
        o = self.options
        with self._conn_lock:
            conns = list(self._connections)
        for c in conns:
            if c.kill_at is not None and now > c.kill_at:
                c.abort()
            elif c.closing:
                continue
            elif c.sending_since is not None and now - c.sending_since > o.send_stall_s:
                log.warning("client %s has not read for %.0f s; closing its connection", c.peer, o.send_stall_s)
                c.abort()
            elif c.remote and not c.authenticated and now - c.created > o.login_timeout_s:
                self._login_timed_out(c)
            elif c.remote and not c.busy and not c.topics and now - c.last_request > o.idle_timeout_s:
                c.send(protocol.error_reply(None, protocol.TIMEOUT, f"closed after {o.idle_timeout_s:g} s without a request"))
                c.close(grace_s=1.0)

    def _login_timed_out(self, conn: Connection) -> None:
        msg = f"no login within {self.options.login_timeout_s:g} s; closing"
        conn.refuse(protocol.UNAUTHORIZED, msg, in_plain_text=True)

    # -- requests -------------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        rfile = None
        try:
            if conn.remote and not self._open_tls(conn):
                return
            rfile = conn.sock.makefile("rb") if conn.stream is conn.sock else tls.reader(conn.stream)
            while not self._stop.is_set() and not conn.closing:
                conn.wait_for_room()
                try:
                    msg = protocol.read_message(rfile)
                except ProtocolError as e:
                    conn.send(protocol.error_reply(None, e.code, e.message))
                    if e.fatal:
                        break
                    continue
                if msg is None:
                    break
                conn.working = not conn.authenticated  # a login being checked waits on the engine, not its client
                conn.last_request = time.monotonic()
                rid = msg.get("id") if isinstance(msg.get("id"), int | str) and not isinstance(msg.get("id"), bool) else None
                conn.busy = True
                try:
                    if not self._answer(conn, rid, msg):
                        break
                finally:
                    conn.busy = False
                    conn.last_request = time.monotonic()
        except OSError:
            pass
        except Exception as e:  # a bug in the framing itself: say so, then end this connection only
            with contextlib.suppress(Exception):
                conn.send(protocol.error_reply(None, protocol.INTERNAL, self._bug(e, "reading a request")))
        finally:
            if rfile is not None:
                rfile.close()
            with self._conn_lock:
                self._connections.discard(conn)
                self._ended_since_trim += 1
            conn.close()

    def _open_tls(self, conn: Connection) -> bool:
        """A TCP connection's TLS handshake and login challenge; False when it ends here."""
        assert self.tls_context is not None
        deadline = conn.created + self.options.login_timeout_s
        try:
            if not tls.wait_readable(conn.sock, deadline):
                self._login_timed_out(conn)
                return False
            first = conn.sock.recv(1, socket.MSG_PEEK)
            if not first:
                return False
            conn.spoke = conn.working = True
            if first[0] != tls.HANDSHAKE_RECORD:
                self._refuse_plain_text(conn, deadline)
                return False
            channel = tls.ServerChannel(conn.sock, self.tls_context)
            channel.handshake(deadline, on_wait=conn.on_login_wait)
        except (OSError, TimeoutError) as e:  # ssl.SSLError is an OSError: a client that is not TLS, or left
            if not conn.closing:
                self._say_once("tls", f"TLS handshake with {conn.peer} failed: {e}")
            return False
        conn.nonce = tls.new_nonce()
        conn.stream = channel
        conn.on_login_wait()
        conn.send({"v": protocol.PROTOCOL_VERSION, "challenge": {"nonce": conn.nonce, "auth": tls.AUTH}})
        return True

    def _refuse_plain_text(self, conn: Connection, deadline: float) -> None:
        """Plain text on the TLS port, e.g. an older Rigpilot's hello with its token in clear: one line saying why.

        What the client sent is read first (a line at most), so that closing does not reset the
        connection before the client has read the answer."""
        sock = conn.sock
        got = b""
        until = min(deadline, time.monotonic() + 2.0)
        with contextlib.suppress(OSError, TimeoutError):
            while b"\n" not in got and len(got) < protocol.MAX_MESSAGE_BYTES and tls.wait_readable(sock, until):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                got += chunk
        sent_token = b"token" in got
        line = protocol.encode(protocol.error_reply(None, protocol.TLS_REQUIRED, (
            f"this engine takes only TLS on its TCP port: update Rigpilot on this computer to {__version__} or later"
            + ("; the token it sent crossed the network in clear: replace it (see 'Remote engines' in the README)"
               if sent_token else "")
        )))  # fmt: skip
        with contextlib.suppress(OSError):
            sock.settimeout(2.0)
            sock.sendall(line)
            sock.shutdown(socket.SHUT_WR)
            while tls.wait_readable(sock, time.monotonic() + 1.0) and sock.recv(1 << 16):
                pass  # until the client closes too
        self._say_once("plain", (
            f"{conn.host} spoke plain text to the TLS port{' and sent a token in clear (an older Rigpilot?)' if sent_token else ''}"
        ))  # fmt: skip

    def _answer(self, conn: Connection, rid: Any, msg: dict[str, Any]) -> bool:
        """Handle one message; False when the connection must end."""
        try:
            try:
                req = protocol.parse_request(msg)
            except ProtocolError as e:
                if conn.authenticated:
                    raise
                raise ProtocolError(e.code, e.message, fatal=True) from None  # no second try at a login
            if not conn.authenticated:
                self._authenticate(conn, req)
            result = self.handle(conn, req)
            self._reply(conn, req, protocol.reply(rid, result))
        except ProtocolError as e:
            conn.send(protocol.error_reply(rid, e.code, e.message))
            return not e.fatal
        except UserError as e:  # a missing job, a bad path and a full disk among them: each says its reason
            self._reply(conn, req, protocol.refusal_reply(rid, e))
        except PlanTimeout:
            self._reply(conn, req, protocol.error_reply(rid, protocol.TIMEOUT, (
                "the plan search ran past its deadline and was stopped; "
                "ask for fewer GPUs, a smaller batch or a shorter sequence"
            )))  # fmt: skip
        except ClientGone:
            return False
        except PlannerBug as e:
            conn.send(protocol.error_reply(rid, protocol.INTERNAL, f"Rigpilot hit a bug: {e} (logged in {self.log_location})"))
        except Exception as e:
            if is_disk_full(e):  # a write any request may make (settings, a plan, a job folder) found no room
                full = disk_full(paths.engine_state_dir() if getattr(e, "filename", None) is None else Path(e.filename).parent)
                conn.send(protocol.refusal_reply(rid, full))
            else:
                conn.send(protocol.error_reply(rid, protocol.INTERNAL, self._bug(e, f"request {str(msg.get('type'))[:40]!r}")))
        return True

    def _reply(self, conn: Connection, req: Request, message: dict[str, Any]) -> None:
        # Not on hello: a client that only checks the engine is up (a start-up probe) must not use up the notice.
        if req.type != "hello":
            notices = self._untold(conn)
            if notices:
                message["notices"] = notices
        conn.send(message)

    def _bug(self, e: BaseException, during: str) -> str:
        """Log an unexpected exception with its traceback; the one line a client is told about it."""
        log.error("bug while %s:\n%s", during, "".join(traceback.format_exception(e)))
        line = (str(e).splitlines() or [""])[0][:200]
        return f"Rigpilot hit a bug: {type(e).__name__}{': ' + line if line else ''} (logged in {self.log_location})"

    def _authenticate(self, conn: Connection, req: Request) -> None:
        # No path in these lines: the client is not yet known to be this user.
        proof, nonce = req.args.get("proof"), req.args.get("nonce")
        if req.type != "hello" or not tls.is_nonce(nonce) or not isinstance(proof, str):
            raise ProtocolError(protocol.UNAUTHORIZED, (
                "remote clients must start with hello and the login proof (the engine's token is never sent); "
                "update Rigpilot on this computer if it sent something else"
            ), fatal=True)  # fmt: skip
        assert self.identity is not None
        expected = tls.login_proof(self.token, "client", conn.nonce, nonce, self.identity.fingerprint)
        if not tls.proof_matches(proof, expected):
            raise ProtocolError(protocol.UNAUTHORIZED, (
                "wrong token: the login does not match this engine's token (set RIGPILOT_ENGINE_TOKEN, or the "
                "node's token, to the one in the engine machine's Rigpilot config folder)"
            ), fatal=True)  # fmt: skip
        conn.client_nonce = nonce
        conn.authenticated = True

    def handle(self, conn: Connection, req: Request) -> Any:
        handler = getattr(self, f"_do_{req.type}")
        return handler(conn, **req.args)

    def _do_hello(
        self, conn: Connection, versions: list[int] | None = None, client: str = "", proof: str = "", nonce: str = ""
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
            "started": self.started,
            "machine": self.machine.label,
            "simulated": self.machine.simulated,
            "notes": self.discovery.notes,
            "telemetry_period": self.sampler.period,
            "tcp": list(self.tcp_address) if self.tcp_address else None,
            "host_id": nodes.host_id(),  # engines with the same id share this computer's files (multi-node jobs)
            "fingerprint": self.identity.fingerprint if self.identity else None,  # of the TLS certificate on `tcp`
            # The engine's half of the login: it holds the token too (the client checks before it trusts the reply).
            "proof": tls.login_proof(self.token, "engine", conn.nonce, conn.client_nonce, self.identity.fingerprint)
            if conn.remote and self.identity else None,
        }

    def _do_machine(self, conn: Connection) -> Any:
        return self._machine_message()

    def _machine_message(self) -> dict[str, Any]:
        d = self.discovery
        return {"machine": self.machine.to_dict(), "notes": d.notes, "details": d.details}

    def _do_topology(self, conn: Connection) -> Any:
        from rigpilot.engine.hardware.topology import describe, summarize

        m = self.machine
        gpus = [g.index for g in m.gpus]
        cells = [[("X" if a == b else (m.pair(a, b).topo_code if m.pair(a, b) else None)) for b in gpus] for a in gpus]
        return {"matrix": {"gpus": gpus, "cells": cells}, "summary": summarize(m).to_dict(), "description": describe(m)}

    def _do_telemetry_history(self, conn: Connection, since: float | None = None, limit: int = 3600) -> Any:
        since = None if since is None else float(since)  # SQLite takes any float, not any int
        samples, more = self.telemetry.since(
            since, limit=max(1, min(limit, 100_000)), max_bytes=protocol.REPLY_BUDGET_BYTES
        )
        return {"samples": samples, "more": more, "next_since": samples[-1]["time"] if samples else since}

    def _do_plan(
        self, conn: Connection, model: str, workload: dict[str, Any] | None = None, gpus: list[int] | None = None,
        options: dict[str, Any] | None = None, trust_remote_code: bool = False, deadline_s: float | None = None,
        machine: str | dict[str, Any] | None = None, node_machines: list[str | dict[str, Any]] | None = None,
        recheck: dict[str, Any] | None = None,
    ) -> Any:  # fmt: skip
        # In a planner process: a search cannot be stopped inside this one, and it may run a model's own code.
        assert self.planners is not None
        budget = min(deadline_s or self.options.plan_deadline_s, self.options.plan_deadline_s)
        args = {"model": model, "workload": workload, "gpus": gpus, "options": options, "trust_remote_code": trust_remote_code}
        # Another machine (a simulated profile, an imported one) is checked and planned in the planner process;
        # this machine's latest calibration travels with each request for it, so a new one counts from the next plan on.
        args["machine"], args["node_machines"] = machine, node_machines
        if recheck is not None:
            args["recheck"] = recheck
        other = machine is not None or bool(node_machines)
        args["calibration"] = None if other else calibration_store.stored(paths.calibration_path())
        return {"result": self.planners.plan(args, time.monotonic() + budget, conn.client_gone)}

    def _do_submit(
        self, conn: Connection, spec: dict[str, Any], plan: dict[str, Any] | None = None, cwd: str | None = None,
        slurm: dict[str, Any] | None = None, nodes: list[str] | None = None, shared_dir: str | None = None,
    ) -> Any:  # fmt: skip
        if nodes:
            if slurm is not None:
                raise UserError("a job goes to SLURM or across nodes, not both: SLURM chooses a SLURM job's nodes itself")
            return {"job": self.multinode.submit(spec, plan, cwd, nodes, shared_dir)}
        return {"job": self.supervisor.submit(spec, plan, cwd, slurm)}

    def _plan_for_study(self, args: dict[str, Any]) -> dict[str, Any]:
        assert self.planners is not None
        args = {**args, "calibration": calibration_store.stored(paths.calibration_path())}
        return self.planners.plan(args, time.monotonic() + self.options.plan_deadline_s, lambda: False)

    def _do_scaling_start(self, conn: Connection, gpus: list[int], cwd: str | None = None, **request: Any) -> Any:
        return {"study": self.studies.start({"gpus": gpus, **request}, cwd)}

    def _do_scaling_study(self, conn: Connection, study: str) -> Any:
        return {"study": self.studies.get(study)}

    def _do_scaling_cancel(self, conn: Connection, study: str) -> Any:
        return {"study": self.studies.cancel(study)}

    def _do_scaling_studies(self, conn: Connection, job: str | None = None) -> Any:
        return {"studies": self.studies.list(job)}

    def _do_check(
        self, conn: Connection, spec: dict[str, Any], plan: dict[str, Any] | None = None, cwd: str | None = None,
        nodes: list[str] | None = None, shared_dir: str | None = None, slurm: dict[str, Any] | None = None,
    ) -> Any:  # fmt: skip
        if nodes:
            if slurm is not None:
                raise UserError("a job goes to SLURM or across nodes, not both: SLURM chooses a SLURM job's nodes itself")
            return self.multinode.submit(spec, plan, cwd, nodes, shared_dir, check=True)
        return self.supervisor.check(spec, plan, cwd, slurm_options=slurm)

    # One engine's part of a job another engine (the head) leads; reached with the token or this user's socket.
    def _do_submit_member(self, conn: Connection, job: str, spec: dict[str, Any], nodes: dict[str, Any]) -> Any:
        return self.multinode.submit_member(job, spec, nodes)

    def _do_check_member(self, conn: Connection, job: str, spec: dict[str, Any], nodes: dict[str, Any]) -> Any:
        return self.multinode.check_member(job, spec, nodes)

    def _do_resume_member(
        self, conn: Connection, job: str, run: int, endpoint: str, env: dict[str, str] | None = None
    ) -> Any:
        return {"job": self.multinode.resume_member(job, run, endpoint, env)}

    def _do_nodes(self, conn: Connection, probe: bool = True) -> Any:
        found = nodes.load()
        listed = nodes.probe_all(list(found.values())) if probe else [n.public() for n in found.values()]
        return {"nodes": listed, "path": str(nodes.registry_path()), "host_id": nodes.host_id()}

    def _do_node_add(
        self, conn: Connection, name: str, address: str, token: str, fingerprint: str | None = None
    ) -> Any:
        node = nodes.add(name, address, token, fingerprint)
        return {"node": nodes.probe(node)}

    def _do_node_remove(self, conn: Connection, name: str) -> Any:
        nodes.remove(name)
        return {"removed": name}

    def _do_jobs(self, conn: Connection, states: list[str] | None = None, limit: int = 200) -> Any:
        unknown = sorted(set(states or []) - ALL_STATES)
        if unknown:
            raise ProtocolError(protocol.INVALID, f"jobs.states: unknown state {unknown[0]!r}; states: {', '.join(sorted(ALL_STATES))}")
        return {"jobs": self.supervisor.jobs(states, max(1, limit))}

    def _do_job(self, conn: Connection, job: str) -> Any:
        return {"job": self.multinode.annotate(self.supervisor.detail(job))}

    def _do_cancel(self, conn: Connection, job: str) -> Any:
        return {"job": self.multinode.cancel(job)}

    def _do_resume(self, conn: Connection, job: str, env: dict[str, str] | None = None) -> Any:
        return {"job": self.multinode.resume(job, env)}

    def _do_delete(self, conn: Connection, job: str) -> Any:
        return self.multinode.delete(job)

    def _do_simulate_fault(self, conn: Connection, gpu: int, fault: str | None = None) -> Any:
        backend = self.discovery.backend
        if not isinstance(backend, SimulatedBackend):
            raise UserError("only a simulated machine's GPUs can be given a fault; this engine runs on real GPUs")
        try:
            backend.set_fault(gpu, fault)
        except KeyError:
            raise UserError(f"GPU {gpu} does not exist on {self.machine.label}") from None
        except ValueError as e:
            raise UserError(str(e)) from None
        return {"gpu": gpu, "fault": fault, "health": backend.health().get(gpu)}

    def _do_rename(self, conn: Connection, job: str, name: str) -> Any:
        return {"job": self.supervisor.rename(job, name)}

    def _do_results(
        self, conn: Connection, job: str, start: int = 0, limit: int = 1000, max_bytes: int = 512 * 1024
    ) -> Any:
        rec = self.supervisor.resolve(job)
        if rec.kind != "infer":
            raise UserError(f"job {rec.id} is a {rec.kind} job; only inference jobs write completions")
        budget = max(4096, min(max_bytes, protocol.REPLY_BUDGET_BYTES // 2))  # escaping can double the size
        reply = read_results(self.supervisor.job_dir(rec.id) / RESULTS_FILE, start=start, limit=limit, max_bytes=budget)
        return {"job": rec.id, "state": rec.state, **reply}

    def _do_logs(
        self, conn: Connection, job: str, rank: int | None = None, since_offset: int = 0, max_bytes: int = 256 * 1024
    ) -> Any:
        rec = self.supervisor.resolve(job)
        logs_dir = self.supervisor.job_dir(rec.id) / "logs"
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

    def _do_metrics(
        self, conn: Connection, job: str, since_cursor: dict[str, int] | None = None, max_bytes: int = 512 * 1024
    ) -> Any:
        rec = self.supervisor.resolve(job)
        records, cursor, more = read_records(
            self.supervisor.job_dir(rec.id) / "metrics", since_cursor,
            max_bytes=max(4096, min(max_bytes, protocol.REPLY_BUDGET_BYTES)),
        )  # fmt: skip
        return {"job": rec.id, "records": records, "cursor": cursor, "more": more, "state": rec.state}

    def _do_subscribe(self, conn: Connection, topics: list[str], metrics_cursors: dict[str, dict[str, int]] | None = None) -> Any:
        resolved = []
        cursors = {}
        for t in topics:
            if t in protocol.TOPICS:
                resolved.append(t)
            elif t.startswith("metrics:"):
                rec = self.supervisor.resolve(t.removeprefix("metrics:"))
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

    def _do_unsubscribe(self, conn: Connection, topics: list[str] | None = None) -> Any:
        conn.topics -= set(topics) if topics is not None else set(conn.topics)
        return {"topics": sorted(conn.topics)}

    def _do_reload_machine(self, conn: Connection, simulated_profile: str | None = None) -> Any:
        return self.reload_machine(simulated_profile)

    def _do_shutdown(self, conn: Connection) -> Any:
        threading.Timer(0.2, self.stop).start()  # after the reply is on its way
        return {"stopping": True, "jobs_keep_running": True}

    # -- fan-out --------------------------------------------------------------

    def _subscribers(self, topic: str) -> list[Connection]:
        with self._conn_lock:
            return [c for c in self._connections if topic in c.topics]

    def _on_sample(self, sample: Any) -> None:
        try:
            self.telemetry.add(sample)
            self._conditions.cleared("telemetry", "telemetry is stored again")
        except Exception as e:
            line = f"{disk_full(paths.telemetry_path().parent).line()}: " if is_disk_full(e) else ""
            self._conditions.failing("telemetry", f"cannot store telemetry: {line}{type(e).__name__}: {e}", e, cause=repr(e))
        subs = self._subscribers("telemetry")
        if subs:
            data = protocol.encode(protocol.event("telemetry", sample=sample.to_dict()))
            for c in subs:
                c.send_bytes(data, droppable=True)

    def _publish_machine(self) -> None:
        # Every subscriber: a telemetry sample of the new machine means nothing against the old one's GPUs.
        with self._conn_lock:
            subs = [c for c in self._connections if c.topics]
        data = protocol.encode(protocol.event("machine", **self._machine_message()))
        for c in subs:
            c.send_bytes(data)

    def _publish_job(self, job: dict[str, Any]) -> None:
        if job.get("kind") == "calibrate" and job.get("state") == COMPLETED and job.get("job_dir"):
            calibration_store.keep(Path(job["job_dir"]), paths.calibration_path())
        subs = self._subscribers("jobs") + [
            c for c in self._subscribers(f"metrics:{job.get('id')}") if "jobs" not in c.topics
        ]
        if subs:
            data = protocol.encode(protocol.event("job", job=job))
            for c in subs:
                c.send_bytes(data)

    def _publish_metrics(self, job_id: str) -> None:
        for c in self._subscribers(f"metrics:{job_id}"):
            c.poke_metrics(job_id)


def _stalest_login(logging_in: list[Connection]) -> Connection:
    """The login in progress to end for a new connection: one waiting on its client, not on the engine;
    of those, one silent since it connected over a second ago (a client sends its TLS hello at once), else
    the one waiting longest (a real client answers each step of the login at once)."""
    waiting = [c for c in logging_in if c.waiting_for_client()] or logging_in
    mute_since = time.monotonic() - _SILENT_S
    return min(waiting, key=lambda c: (c.spoke or c.created > mute_since, c.waiting_since))


def _same_user(sock: socket.socket) -> bool:
    # The socket is 0600 in a 0700 folder; this is the second lock on the door (e.g. root-run tools).
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return True
    _, uid, _ = struct.unpack("3i", creds)
    return uid in (os.getuid(), 0)


class _Libc:
    """glibc's allocator knobs, where there is glibc: big frames must not leave the heap big."""

    def __init__(self) -> None:
        try:
            self._libc: Any = ctypes.CDLL("libc.so.6")
            self._libc.malloc_trim  # noqa: B018  (present: glibc)
        except (OSError, AttributeError):
            self._libc = None

    def limit_arenas(self, n: int) -> None:
        # Each thread may otherwise get its own arena (up to 8 per core), each keeping the high-water
        # mark of what its client sent; two arenas serve the service's handful of busy threads.
        if self._libc is not None:
            self._libc.mallopt(-8, n)  # M_ARENA_MAX

    def release_memory(self) -> None:
        if self._libc is not None:
            self._libc.malloc_trim(0)


_LIBC = _Libc()


def _log_location() -> str:
    """Where this process's log lines go, for "logged in …": the file behind stderr, else the service log."""
    try:
        target = os.readlink("/proc/self/fd/2")
    except OSError:
        target = ""
    if target.startswith("/") and os.path.isfile(target):
        return target
    return f"the engine's output (normally {paths.service_log_path()})"


def _setting_max_cpu_ranks() -> int:
    from rigpilot.engine.settings import Settings

    value = Settings.load().max_cpu_ranks
    return value if isinstance(value, int) and value > 0 else 4


def _setting_warm_worker() -> bool:
    from rigpilot.engine.settings import Settings

    return Settings.load().warm_worker is not False


def run_service(options: ServiceOptions | None = None, *, quiet_if_running: bool = False) -> int:
    """Run the service in the foreground until SIGTERM/SIGINT or a `shutdown` request."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _LIBC.limit_arenas(2)
    service = EngineService(options)
    try:
        service.setup()
    except AlreadyRunning as e:
        if quiet_if_running:
            return 0
        raise UserError(str(e)) from None
    except BaseException:
        service.close()
        raise
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: service.stop())
    log.info(
        "engine service %s ready: pid %d, %s, socket %s", __version__, os.getpid(), service.machine.label,
        paths.socket_path(),
    )  # fmt: skip
    print(f"engine service ready on {paths.socket_path()} ({service.machine.label})", file=sys.stderr, flush=True)
    service.serve_forever()
    log.info("engine service stopped; running jobs keep running")
    return 0

