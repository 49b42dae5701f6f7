"""The engine service process: its start-up and shutdown, its listeners, and the events it pushes.

One per user, guarded by an fcntl lock in the runtime dir: whoever holds the
lock owns the socket, so a socket file left by a killed service is stale by
definition and is replaced. Each client connection gets a reader thread here (it
answers requests in order) and a writer thread (engine.service.connection:
replies and pushed events), so a slow subscriber never holds up the sampler or
the supervisor. What each request does is declared with its arguments in
engine/service/handlers/ (gathered by engine.service.requests); this module
reads, checks and answers them, and words what went wrong.

The TCP listener speaks only TLS: each connection's handshake, then a login that
proves the token without sending it (engine.service.login).

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
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from rigpilot.engine import __version__, paths
from rigpilot.engine.api import protocol, tls
from rigpilot.engine.api.protocol import ProtocolError, Request
from rigpilot.engine.diskspace import disk_full, is_disk_full, no_room
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.discovery import open_backend
from rigpilot.engine.hardware.sampler import Sampler
from rigpilot.engine.jobs import calibration_store, doctor_store
from rigpilot.engine.jobs.conditions import Conditions
from rigpilot.engine.jobs.notify import Notifier
from rigpilot.engine.jobs.resilient_store import Recovery, ResilientJobStore, ResilientTelemetryStore
from rigpilot.engine.jobs.scaling import Studies
from rigpilot.engine.jobs.store import COMPLETED
from rigpilot.engine.jobs.supervisor import Supervisor, SupervisorOptions
from rigpilot.engine.schema import TERMINAL_STATES
from rigpilot.engine.service import login, requests
from rigpilot.engine.service.connection import Connection, stalest_login
from rigpilot.engine.service.login import TcpLogin
from rigpilot.engine.service.multinode import MultiNode
from rigpilot.engine.service.options import ServiceOptions
from rigpilot.engine.service.planworker import ClientGone, PlannerBug, PlannerPool, PlanTimeout

log = logging.getLogger(__name__)

SAMPLES_IN_MEMORY = 16
_REAP_PERIOD_S = 0.5


class AlreadyRunning(Exception):
    """Another engine service of this user holds the lock."""


class EngineService:
    """The running service: what a request's handler may use of it (engine.service.handling.Engine), its
    listeners and connections, and the events it pushes to subscribers."""

    def __init__(self, options: ServiceOptions | None = None) -> None:
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
        self.token = ""  # TCP only: what a remote client proves it holds
        self.login: TcpLogin | None = None
        self.planners: PlannerPool | None = None
        self._machine_lock = threading.Lock()  # one machine switch at a time
        # A switch Settings asked for while jobs used the machine: made when the last of them ends.
        self._switch_pending = False
        self.doctor_kept: set[str] = set()  # doctor jobs whose report the engine has stored (or given up on)
        self.doctor_keeping: set[str] = set()
        self.notifier = Notifier()  # a job's end, failure or restart, to the webhook or command in Settings
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
                warm_worker=_setting_warm_worker(), job_niceness=_setting_job_niceness(),
            ),
            on_job=self._publish_job, on_metrics=self._publish_metrics, telemetry=self.telemetry,
        )  # fmt: skip
        # Jobs on a pair the machine check found broken run with NCCL's P2P off (engine.jobs.machine_check).
        self.supervisor.stored_check = lambda machine: doctor_store.latest(machine, paths.doctor_dir())[0]
        self.multinode = MultiNode(self.supervisor)
        self.sampler = self._new_sampler(self.discovery.backend)
        self._listen_unix()
        if self.options.tcp:
            self.token = paths.read_or_create_token()
            self.identity = tls.load_or_create_identity()
            self.login = TcpLogin(
                tls.server_context(self.identity), self.identity, self.token, self.options.login_timeout_s, self._say_once
            )
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
                return {"changed": False, **self.machine_message()}
            try:
                self.supervisor.replace_machine(discovery.machine, discovery.backend)
            except UserError as e:
                discovery.backend.close()
                if e.reason != "machine_busy":
                    raise
                # The settings file names the new machine already; the switch waits for the jobs, not for a user
                # who would have to come back and save again.
                self._switch_pending = True
                jobs = e.fields.get("jobs") or []
                raise UserError(
                    f"{str(e).split('; let them')[0]}; it switches to {discovery.machine.label} when "
                    f"{'it ends' if len(jobs) == 1 else 'they end'} (cancel {'it' if len(jobs) == 1 else 'them'} "
                    "to switch now)",
                    reason="machine_switch_deferred", jobs=jobs, to=discovery.machine.label,
                ) from None
            except BaseException:
                discovery.backend.close()
                raise
            self._switch_pending = False
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
        return {"changed": True, **self.machine_message()}

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
        # New clients then start the next service instead of greeting this one as it goes.
        self._remove_socket_file()

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

    def _accept(self, listening: socket.socket) -> None:
        try:
            sock, addr = listening.accept()
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
                    make_room = stalest_login(logging_in)
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
            conn = Connection(
                sock, peer, needs_auth=not is_unix, listener=listener, host=host, job_dir=self.supervisor.job_dir
            )
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
                login.timed_out(c, o.login_timeout_s)
            elif c.remote and not c.busy and not c.topics and now - c.last_request > o.idle_timeout_s:
                c.send(protocol.error_reply(None, protocol.TIMEOUT, f"closed after {o.idle_timeout_s:g} s without a request"))
                c.close(grace_s=1.0)

    # -- requests -------------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        rfile = None
        try:
            if conn.remote and (self.login is None or not self.login.open(conn)):
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

    def _answer(self, conn: Connection, rid: Any, msg: dict[str, Any]) -> bool:
        """Handle one message; False when the connection must end."""
        try:
            try:
                req = requests.parse_request(msg)
            except ProtocolError as e:
                if conn.authenticated:
                    raise
                raise ProtocolError(e.code, e.message, fatal=True) from None  # no second try at a login
            if not conn.authenticated:
                assert self.login is not None  # only TCP connections start unauthenticated
                self.login.authenticate(conn, req)
            result = requests.answer(self, conn, req)
            self._reply(conn, req, protocol.reply(rid, result))
        except ProtocolError as e:
            conn.send(protocol.error_reply(rid, e.code, e.message, reason=e.reason, fields=e.fields))
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
                filename = getattr(e, "filename", None)
                full = disk_full(paths.engine_state_dir() if filename is None else Path(filename).parent)
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

    def machine_message(self) -> dict[str, Any]:
        """The `machine` request's answer, and the `machine` event's."""
        d = self.discovery
        return {"machine": self.machine.to_dict(), "notes": d.notes, "details": d.details}

    def _plan_for_study(self, args: dict[str, Any]) -> dict[str, Any]:
        assert self.planners is not None
        args = {**args, "calibration": calibration_store.stored(paths.calibration_path()),
                "doctor": doctor_store.latest(self.machine, paths.doctor_dir())[0]}  # fmt: skip
        return self.planners.plan(args, time.monotonic() + self.options.plan_deadline_s, lambda: False)

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
        data = protocol.encode(protocol.event("machine", **self.machine_message()))
        for c in subs:
            c.send_bytes(data)

    def _publish_job(self, job: dict[str, Any]) -> None:
        self.notifier.observe(job)
        if job.get("kind") == "calibrate" and job.get("state") == COMPLETED and job.get("job_dir"):
            calibration_store.keep(Path(job["job_dir"]), paths.calibration_path())
        if job.get("kind") == "doctor" and job.get("state") in TERMINAL_STATES and job.get("job_dir"):
            if job["id"] not in self.doctor_kept:
                self.doctor_keeping.add(job["id"])
                # nvidia-smi can take seconds: off the supervisor's thread, and told again once kept.
                threading.Thread(target=self._keep_doctor, args=(job,), name="doctor-keep", daemon=True).start()
        if self._switch_pending and job.get("state") in TERMINAL_STATES:
            # Off the supervisor's thread, which holds its lock while it tells us: the switch asks it again.
            threading.Thread(target=self._switch_when_free, name="machine-switch", daemon=True).start()
        subs = self._subscribers("jobs") + [
            c for c in self._subscribers(f"metrics:{job.get('id')}") if "jobs" not in c.topics
        ]
        if subs:
            data = protocol.encode(protocol.event("job", job=job))
            for c in subs:
                c.send_bytes(data)

    def _keep_doctor(self, job: dict[str, Any]) -> None:
        try:
            doctor_store.keep(Path(job["job_dir"]), self.machine, self.discovery.backend, paths.doctor_dir())
        except Exception:  # a report that cannot be completed is logged; the job itself has ended either way
            log.exception("machine check %s not kept", job.get("id"))
        finally:
            self.doctor_kept.add(job["id"])
            self.doctor_keeping.discard(job["id"])
        self._publish_job(job)  # clients that saw it end ask for the report again

    def _switch_when_free(self) -> None:
        """The switch Settings asked for while jobs ran, now that one ended: made if none is left, else still
        pending (the next job to end tries again)."""
        for _ in range(3):  # the job that ended may be a moment from leaving the store's active states
            try:
                self.reload_machine()
                return
            except UserError as e:
                if e.reason != "machine_switch_deferred":
                    self._switch_pending = False
                    log.warning("the machine switch asked for while jobs ran was not made: %s", e)
                    return
            except Exception:
                self._switch_pending = False
                log.exception("the machine switch asked for while jobs ran failed")
                return
            time.sleep(0.5)

    def _publish_metrics(self, job_id: str) -> None:
        for c in self._subscribers(f"metrics:{job_id}"):
            c.poke_metrics(job_id)


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


def _setting_job_niceness() -> int:
    from rigpilot.engine.settings import Settings

    return Settings.load().job_niceness


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

