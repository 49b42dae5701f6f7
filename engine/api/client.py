"""Talking to the engine service: connect (starting it when none runs), request, follow events.

    with EngineClient() as engine:
        jobs = engine.request("jobs")["jobs"]
        engine.request("subscribe", topics=["jobs", f"metrics:{job_id}"])
        for ev in engine.events():
            ...

Not thread-safe: use one client per thread. Read-only requests are retried
once over a fresh connection when the old one broke (the service restarted),
so a GUI poller rides over a restart without noticing.

Over TCP (`tcp="HOST:PORT"`) the connection is TLS and the login proves the
token without sending it (engine.api.tls); the engine's certificate must
match the fingerprint pinned for it (given, or remembered in
engine.api.pins the first time that engine proved it holds the token).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import select
import socket
import ssl
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rigpilot.engine import paths
from rigpilot.engine.api import pins, protocol, tls
from rigpilot.engine.diskspace import disk_full, no_room
from rigpilot.engine.errors import UserError

_IDEMPOTENT = frozenset(
    {"hello", "machine", "topology", "telemetry_history", "jobs", "job", "logs", "metrics", "cancel", "plan"}
)
# A client waits this long for a service it started to come up (discovery, SQLite, sockets).
START_TIMEOUT_S = 30.0
RESTART_GAP_S = 0.5  # between starts while a stopping service still holds the lock (each start is a process)
TOKEN_ENV = "RIGPILOT_ENGINE_TOKEN"  # a remote client's copy of the service machine's token
# A TCP login the engine cut short to make room (a flood of connections from this host) is tried again this long.
LOGIN_RETRY_S = 10.0


class EngineError(UserError):
    """An error reply from the service: `code` says which class (protocol.NOT_FOUND, ...), `reason` which
    refusal ("seq_too_long"; the class where the engine gave none) and `fields` its facts (a `bad_path`
    error's `path` and `problem`, a `seq_too_long` one's `setting`, `value` and `limit`)."""

    def __init__(self, code: str, message: str, fields: dict[str, Any] | None = None, reason: str | None = None):
        super().__init__(message, reason=reason or code)
        self.code = code
        self.fields = dict(fields or {})

    @classmethod
    def of_reply(cls, err: dict[str, Any], default: str = "unknown error") -> EngineError:
        """The error of an error reply's `error` object, from this engine or an older one (whose fields stood
        beside `code`, without `reason`)."""
        err = err if isinstance(err, dict) else {}
        beside = {k: v for k, v in err.items() if k not in ("code", "message", "reason", "fields")}
        given = err.get("fields")
        fields = {**beside, **(given if isinstance(given, dict) else {})}
        reason = err.get("reason")
        return cls(str(err.get("code", protocol.INTERNAL)), str(err.get("message", default)), fields,
                   reason if isinstance(reason, str) else None)  # fmt: skip


class EngineUnavailable(UserError):
    """No service could be reached or started."""


class EngineRemoved(EngineUnavailable):
    """Rigpilot itself is gone (the package removed, or uninstalled with pip): no service can be started again.

    Clients stop reconnecting on this: retrying cannot help until Rigpilot is installed again.
    """


class FingerprintMismatch(EngineUnavailable):
    """The engine at an address presented another certificate than the one pinned for it."""

    def __init__(self, address: str, seen: str, pinned: str, fix: str):
        super().__init__(
            f"the engine at {address} presents certificate {seen}, not {pinned} as pinned: someone may be "
            "intercepting the connection, or that engine's certificate was replaced. Run 'rigpilot engine "
            f"--fingerprint' on that machine; only if it prints {seen}, {fix}"
        )
        self.address, self.seen, self.pinned = address, seen, pinned


class _LoginCut(Exception):
    """The engine ended a TCP login half-way (it made room for newer connections): worth another try."""


class EngineClient:
    def __init__(
        self,
        *,
        autostart: bool = True,
        tcp: str | None = None,
        token: str | None = None,
        fingerprint: str | None = None,
        pin: Callable[[str], None] | None = None,
        pin_fix: str | None = None,
        client_name: str = "cli",
        timeout: float = 60.0,
        on_notice: Callable[[dict[str, Any]], None] | None = None,
    ):
        """`tcp`: an engine's HOST:PORT (TLS, `token` or RIGPILOT_ENGINE_TOKEN), else this user's local engine.

        `fingerprint`: the certificate fingerprint the engine must present. Without it, `pin(seen)` is
        called once the engine proved it holds the token (the node registry pins that way), or, without
        `pin`, the known-engines file (engine.api.pins) pins it. `pin_fix` ends the refusal of a
        changed certificate with what to do about it ({seen} stands for the certificate presented)."""
        self.autostart = autostart and tcp is None
        self.tcp = tcp
        self.token = token
        self.fingerprint = fingerprint  # given, or the one pinned or seen on the last login
        self.pin = pin
        self.pin_fix = pin_fix
        self.client_name = client_name
        self.timeout = timeout
        self.hello: dict[str, Any] = {}
        # What the engine did by itself and tells each client name once ({code, message, …}: a damaged
        # database it rebuilt); `on_notice` hears each as it comes.
        self.notices: list[dict[str, Any]] = []
        self.on_notice = on_notice
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._events: deque[dict[str, Any]] = deque()
        self._ids = itertools.count(1)

    def __enter__(self) -> EngineClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connection -----------------------------------------------------------

    def connect(self) -> dict[str, Any]:
        self.close()
        if self.tcp:
            self.hello = self._login_with_retries()
            return self.hello
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._sock = self._open()
            self._buf.clear()
            try:
                hello = {"versions": list(protocol.SUPPORTED_VERSIONS), "client": self.client_name}
                self.hello = self._call("hello", hello)
                return self.hello
            except ConnectionError:
                # A service that is stopping still accepts on its socket for a moment, then hangs up:
                # wait for it to go, and (autostart) for the one that takes its place.
                self.close()
                if not self.autostart or time.monotonic() > deadline:
                    raise EngineUnavailable(
                        "the engine service hung up before it answered: it is stopping; run the command again"
                    ) from None
                time.sleep(0.1)

    # -- TCP: TLS and the login --------------------------------------------------

    def _login_with_retries(self) -> dict[str, Any]:
        deadline = time.monotonic() + LOGIN_RETRY_S
        delay = 0.05
        while True:
            try:
                return self._login()
            except _LoginCut as e:
                self.close()
                if time.monotonic() + delay > deadline:
                    raise EngineUnavailable(
                        f"the engine at {self.tcp} kept ending the login early for {LOGIN_RETRY_S:g} s ({e}): it "
                        "serves too many connections, or something on this computer floods it with them"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except BaseException:
                self.close()
                raise

    def _login(self) -> dict[str, Any]:
        assert self.tcp
        address = self.tcp
        host, port = protocol.parse_address(address)
        try:
            raw = socket.create_connection((host, port), timeout=min(10, self.timeout))
        except OSError as e:
            raise EngineUnavailable(f"cannot reach the engine service at {host}:{port}: {e.strerror}") from None
        sock = tls.client_context().wrap_socket(raw, do_handshake_on_connect=False)
        self._sock = sock
        self._buf.clear()
        try:
            sock.do_handshake()
        except (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError) as e:
            raise _LoginCut(str(e) or type(e).__name__) from None
        except ssl.SSLError as e:
            raise EngineUnavailable(
                f"the engine at {address} did not answer in TLS ({e.reason or e}): it may run an older Rigpilot "
                "(update it there) or be another program"
            ) from None
        except OSError as e:
            raise EngineUnavailable(f"no TLS handshake with the engine at {address}: {e.strerror or e}") from None
        seen = tls.fingerprint_of(sock.getpeercert(binary_form=True) or b"")
        expected = self.fingerprint or (None if self.pin else pins.pinned(address))
        if expected and seen != expected:
            if self.pin_fix:
                fix = self.pin_fix.format(seen=seen)
            else:
                fix = "use that fingerprint instead" if self.fingerprint else pins.forget_hint(address)
            raise FingerprintMismatch(address, seen, expected, fix)
        try:
            challenge = self._read(self.timeout)
        except ConnectionError as e:
            raise _LoginCut(str(e)) from None
        if challenge is None:
            raise EngineUnavailable(f"the engine at {address} sent no login challenge within {self.timeout:.0f} s")
        if challenge.get("ok") is False:
            err = challenge.get("error") or {}
            if err.get("code") == protocol.BUSY:
                raise _LoginCut(err.get("message", "busy"))
            raise EngineError.of_reply(err, "refused")
        ch = challenge.get("challenge")
        if not isinstance(ch, dict) or ch.get("auth") != tls.AUTH or not tls.is_nonce(ch.get("nonce")):
            raise EngineUnavailable(
                f"the engine at {address} does not log in as this Rigpilot does; update Rigpilot there"
            )
        token = self.token or _read_token()
        mine = tls.new_nonce()
        args = {
            "versions": list(protocol.SUPPORTED_VERSIONS), "client": self.client_name, "nonce": mine,
            "proof": tls.login_proof(token, "client", ch["nonce"], mine, seen),
        }  # fmt: skip
        try:
            hello = self._call("hello", args)
        except EngineError as e:
            if e.code == protocol.BUSY:
                raise _LoginCut(str(e)) from None
            raise
        except (ConnectionError, BrokenPipeError) as e:
            raise _LoginCut(str(e) or type(e).__name__) from None
        if not tls.proof_matches(hello.get("proof"), tls.login_proof(token, "engine", ch["nonce"], mine, seen)):
            raise EngineUnavailable(
                f"the engine at {address} let this client in without proving it holds the token: it is not the "
                "engine the token belongs to; not using it"
            )
        if not expected:
            (self.pin or (lambda fp: pins.remember(address, fp)))(seen)
        self.fingerprint = seen
        sock.settimeout(10)  # as a local socket's writes: a reply's wait is the request's own timeout
        return hello

    def _open(self) -> socket.socket:
        path = paths.socket_path()
        try:
            return _connect_unix(path)
        except OSError as e:
            if not self.autostart or e.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                raise EngineUnavailable(f"cannot reach the engine service at {path}: {e.strerror}") from None
        return self._start_and_connect(path)

    def _start_and_connect(self, path: Path) -> socket.socket:
        log_start = _size(paths.service_log_path())  # what this start writes is what explains its failure
        proc, started = start_service(), time.monotonic()
        deadline = started + START_TIMEOUT_S
        while True:
            try:
                return _connect_unix(path)
            except OSError:
                pass
            # Exit code 0: another service held the lock: another client's start that won the race (its socket
            # comes once it has found the GPUs), or a service that is stopping. Start again only once the lock
            # is free, so a service that is still starting is waited for, not raced every half second.
            now = time.monotonic()
            if proc.poll() == 0 and now < deadline and now - started > RESTART_GAP_S and _lock_free():
                proc, started = start_service(), now  # the one that held the lock (a stopping service) is gone
            elif proc.poll() not in (None, 0) or now > deadline:
                state = paths.engine_state_dir()
                if no_room(state):  # its log is on that disk too, and could not say so
                    raise EngineUnavailable(f"the engine service did not start: {disk_full(state).line()}")
                tail = _tail(paths.service_log_path(), since=log_start)
                raise EngineUnavailable(
                    f"the engine service did not start (see {paths.service_log_path()}){': ' + tail if tail else ''}"
                )
            time.sleep(0.05)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    # -- requests -------------------------------------------------------------

    def request(self, rtype: str, **args: Any) -> Any:
        """Send one request and return its result; raise EngineError on an error reply."""
        if self._sock is None or self._hung_up():
            self.connect()  # safe for any request: this one was not sent yet
        try:
            return self._call(rtype, args)
        except (ConnectionError, BrokenPipeError, EOFError):
            if rtype not in _IDEMPOTENT:
                raise EngineUnavailable("the connection to the engine service broke; check 'rigpilot jobs'") from None
        self.connect()
        return self._call(rtype, args)

    def all_metrics(self, job: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """Every metric record of `job` so far, page by page, and the cursor to follow on from."""
        records: list[dict[str, Any]] = []
        cursor: dict[str, int] = {}
        while True:
            r = self.request("metrics", job=job, since_cursor=cursor)
            records += r["records"]
            cursor = r["cursor"]
            if not r["more"]:
                return records, cursor

    def _call(self, rtype: str, args: dict[str, Any]) -> Any:
        assert self._sock is not None
        rid = next(self._ids)
        try:
            self._sock.sendall(protocol.encode(protocol.request(rid, rtype, **args)))
        except OSError:
            # Refused (`busy`) or timed out: the service said why before it hung up; show that line.
            with contextlib.suppress(OSError, ValueError, protocol.ProtocolError):
                said = self._read(0.5)
                if said and not said.get("ok", True):
                    err = said.get("error") or {}
                    raise EngineError.of_reply(err, "refused") from None
            raise
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._read(deadline - time.monotonic())
            if msg is None:
                raise TimeoutError(f"the engine service did not answer {rtype} within {self.timeout:.0f} s")
            if "event" in msg:
                self._take_event_notice(msg)
                self._events.append(msg)
                continue
            if msg.get("id") not in (rid, None):
                continue  # a reply to an earlier request that timed out
            if rtype != "hello":  # the engine never sends one there, and over TCP it has not yet proved itself
                self._take_notices(msg)
            if msg.get("ok"):
                return msg.get("result")
            raise EngineError.of_reply(msg.get("error") or {})

    def _take_event_notice(self, msg: dict[str, Any]) -> None:
        """A notice pushed to a subscriber as an event (one that sends no request would hear it late)."""
        if msg.get("event") == "notice":
            self._take_notices({"notices": [msg.get("notice")]})

    def _take_notices(self, msg: dict[str, Any]) -> None:
        notices = msg.get("notices")
        for n in notices if isinstance(notices, list) else []:
            if isinstance(n, dict) and isinstance(n.get("message"), str):
                self.notices.append(n)
                if self.on_notice is not None:
                    self.on_notice(n)

    # -- events ---------------------------------------------------------------

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next pushed event, or None after `timeout` seconds without one."""
        if self._events:
            return self._events.popleft()
        msg = self._read(timeout)
        while msg is not None and "event" not in msg:
            msg = self._read(timeout)
        if msg is not None:
            self._take_event_notice(msg)
        return msg

    def events(self) -> Iterator[dict[str, Any]]:
        while True:
            ev = self.next_event(None)
            if ev is not None:
                yield ev

    def _hung_up(self) -> bool:
        """Whether the service closed this connection while it sat idle (a TCP idle timeout, a restart)."""
        assert self._sock is not None
        try:
            while readable(self._sock, 0):
                chunk = self._sock.recv(1 << 16)
                if not chunk:
                    return True
                self._buf += chunk  # events that arrived meanwhile; read in order later
        except OSError:
            return True
        return False

    # -- framing --------------------------------------------------------------

    def _read(self, timeout: float | None) -> dict[str, Any] | None:
        """One message, or None on timeout; raises ConnectionError when the service hung up."""
        assert self._sock is not None
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                return protocol.decode(line)
            if len(self._buf) > protocol.MAX_MESSAGE_BYTES:
                raise ConnectionError("the engine service sent an oversized message")
            wait = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not readable(self._sock, wait):
                return None
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the engine service closed the connection")
            self._buf += chunk


def readable(source: socket.socket | int, timeout: float | None) -> bool:
    """Whether `source` (a socket or a file descriptor) has data within `timeout` seconds (None: wait).

    poll, not select: a process with over 1024 open files (a GUI, a test, a busy engine) has descriptors
    select cannot take."""
    if isinstance(source, ssl.SSLSocket) and source.pending():
        return True  # decrypted bytes wait in the TLS layer, not in the socket
    p = select.poll()
    p.register(source, select.POLLIN)
    return bool(p.poll(None if timeout is None else timeout * 1000))


def _lock_free() -> bool:
    """Whether no service holds the engine's lock (engine.service.server.acquire_lock), tried without waiting."""
    try:
        with paths.lock_path().open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    except BlockingIOError:
        return False
    except OSError:
        return True  # no lock file to hold: nothing runs
    return True


def _connect_unix(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        raise
    return s


def removed_installation() -> str | None:
    """What of this running Rigpilot's installation is gone (the interpreter, or the engine's code), else None.

    A window left open while the package is removed or purged (or Rigpilot uninstalled with pip) still
    runs, but the service it would start no longer exists on disk.
    """
    # The service this client starts: `python -m rigpilot.engine.service`, beside this package.
    service_main = Path(__file__).resolve().parent.parent / "service" / "__main__.py"
    for what in (sys.executable, str(service_main)):
        if what and not os.path.exists(what):  # an embedding interpreter may leave sys.executable empty
            return what
    return None


def start_service(extra_args: list[str] | None = None) -> subprocess.Popen:
    """Start the service detached from this process (its own session, output to engine.log)."""
    gone = removed_installation()
    if gone is not None:
        raise EngineRemoved(
            f"Rigpilot was removed from this computer ({gone} is gone), so its engine service cannot start again; "
            "install Rigpilot again to go on (your jobs and settings are kept)"
        )
    log_path = paths.service_log_path()
    try:
        log = log_path.open("ab")
    except OSError as e:
        raise EngineUnavailable(
            f"the engine service cannot start: its log {log_path} cannot be written ({e.strerror}); make "
            f"{log_path.parent} writable again (chmod 700 {log_path.parent})"
        ) from None
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "rigpilot.engine.service", "--background", *(extra_args or [])],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, cwd="/",
        )  # fmt: skip


def service_running() -> bool:
    try:
        _connect_unix(paths.socket_path()).close()
        return True
    except OSError:
        return False


def _read_token() -> str:
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    try:
        return paths.token_path().read_text().strip()
    except OSError:
        raise EngineUnavailable(
            f"remote access needs the token from the service machine's {paths.token_path()}"
        ) from None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, n: int = 3, since: int = 0) -> str:
    try:
        with path.open("rb") as f:
            f.seek(since if since <= f.seek(0, 2) else 0)  # a log cut short meanwhile: all of it
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-n:])
