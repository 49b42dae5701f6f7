"""Talking to the engine service: connect (starting it when none runs), request, follow events.

    with EngineClient() as engine:
        jobs = engine.request("jobs")["jobs"]
        engine.request("subscribe", topics=["jobs", f"metrics:{job_id}"])
        for ev in engine.events():
            ...

Not thread-safe: use one client per thread. Read-only requests are retried
once over a fresh connection when the old one broke (the service restarted),
so a GUI poller rides over a restart without noticing.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import select
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rigpilot.engine.diskspace import disk_full, no_room
from rigpilot.engine.errors import UserError
from rigpilot.engine.service import paths, protocol

_IDEMPOTENT = frozenset(
    {"hello", "machine", "topology", "telemetry_history", "jobs", "job", "logs", "metrics", "cancel", "plan"}
)
# A client waits this long for a service it started to come up (discovery, SQLite, sockets).
START_TIMEOUT_S = 30.0
TOKEN_ENV = "RIGPILOT_ENGINE_TOKEN"  # a remote client's copy of the service machine's token


class EngineError(UserError):
    """An error reply from the service; `code` says which kind (protocol.NOT_FOUND, ...)."""

    def __init__(self, code: str, message: str, fields: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.fields = fields or {}  # what the error carries besides its line (protocol.DISK_FULL: folder, bytes)


class EngineUnavailable(UserError):
    """No service could be reached or started."""


class EngineClient:
    def __init__(
        self,
        *,
        autostart: bool = True,
        tcp: str | None = None,
        token: str | None = None,
        client_name: str = "cli",
        timeout: float = 60.0,
    ):
        self.autostart = autostart and tcp is None
        self.tcp = tcp
        self.token = token
        self.client_name = client_name
        self.timeout = timeout
        self.hello: dict[str, Any] = {}
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
        self._sock = self._open()
        self._buf.clear()
        args: dict[str, Any] = {"versions": list(protocol.SUPPORTED_VERSIONS), "client": self.client_name}
        if self.tcp:
            args["token"] = self.token or _read_token()
        self.hello = self._call("hello", args)
        return self.hello

    def _open(self) -> socket.socket:
        if self.tcp:
            host, port = protocol.parse_address(self.tcp)
            try:
                return socket.create_connection((host, port), timeout=10)
            except OSError as e:
                raise EngineUnavailable(f"cannot reach the engine service at {host}:{port}: {e.strerror}") from None
        path = paths.socket_path()
        try:
            return _connect_unix(path)
        except OSError as e:
            if not self.autostart or e.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                raise EngineUnavailable(f"cannot reach the engine service at {path}: {e.strerror}") from None
        return self._start_and_connect(path)

    def _start_and_connect(self, path: Path) -> socket.socket:
        proc = start_service()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                return _connect_unix(path)
            except OSError:
                pass
            # Exit code 0 means another client's service won the race; keep waiting for its socket.
            if proc.poll() not in (None, 0) or time.monotonic() > deadline:
                state = paths.engine_state_dir()
                if no_room(state):  # its log is on that disk too, and could not say so
                    raise EngineUnavailable(f"the engine service did not start: {disk_full(state).line()}")
                tail = _tail(paths.service_log_path())
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
                    raise EngineError(err.get("code", protocol.INTERNAL), err.get("message", "refused")) from None
            raise
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._read(deadline - time.monotonic())
            if msg is None:
                raise TimeoutError(f"the engine service did not answer {rtype} within {self.timeout:.0f} s")
            if "event" in msg:
                self._events.append(msg)
                continue
            if msg.get("id") not in (rid, None):
                continue  # a reply to an earlier request that timed out
            if msg.get("ok"):
                return msg.get("result")
            err = msg.get("error") or {}
            extra = {k: v for k, v in err.items() if k not in ("code", "message")}
            raise EngineError(err.get("code", protocol.INTERNAL), err.get("message", "unknown error"), extra)

    # -- events ---------------------------------------------------------------

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next pushed event, or None after `timeout` seconds without one."""
        if self._events:
            return self._events.popleft()
        msg = self._read(timeout)
        while msg is not None and "event" not in msg:
            msg = self._read(timeout)
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
    p = select.poll()
    p.register(source, select.POLLIN)
    return bool(p.poll(None if timeout is None else timeout * 1000))


def _connect_unix(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        raise
    return s


def start_service(extra_args: list[str] | None = None) -> subprocess.Popen:
    """Start the service detached from this process (its own session, output to engine.log)."""
    log_path = paths.service_log_path()
    with log_path.open("ab") as log:
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
        raise EngineUnavailable(f"remote access needs the token from the service machine's {paths.token_path()}") from None


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-n:])
