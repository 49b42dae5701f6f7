"""One client connection of the engine service: what it has queued, what it follows, and how it ends.

Each connection has a writer thread that drains its outbox, so a slow client never holds up the sampler or the
supervisor: live telemetry beyond its backlog is dropped for that client, and metrics are read from disk at the
client's own cursor, so those are never lost. A client that does not read first stops being read (its replies
queue up to a soft cap), and is cut off when pushed events pass a hard byte cap.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rigpilot.engine.api import protocol, tls
from rigpilot.engine.jobs.metrics import read_records

log = logging.getLogger(__name__)

_TELEMETRY_BACKLOG = 64  # queued telemetry events per client before new ones are dropped
# A client's replies queue up to this before its next request is read (it then waits, as TCP would).
_SOFT_QUEUE_BYTES = 1 << 20
# Pushed events cannot wait: past this the client is not reading and its connection is closed.
_HARD_QUEUE_BYTES = 8 << 20
_SILENT_S = 1.0  # a TCP connection that sent nothing for this long is no client at work (see stalest_login)


class Connection:
    """One client: an outbox drained by a writer thread, its subscriptions and metric cursors."""

    def __init__(
        self, sock: socket.socket, peer: str, *, needs_auth: bool, listener: str, host: str,
        job_dir: Callable[[str], Path],
    ) -> None:  # fmt: skip
        self.job_dir = job_dir  # where a followed job's metrics are read from
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
        metrics_dir = self.job_dir(job_id) / "metrics"
        cursor = self.metrics_cursors.get(job_id, {})
        records, cursor, more = read_records(metrics_dir, cursor, max_bytes=protocol.REPLY_BUDGET_BYTES)
        self.metrics_cursors[job_id] = cursor
        if records:
            self.stream.sendall(protocol.encode(protocol.event("metrics", job=job_id, records=records, cursor=cursor)))
        if more:
            self.poke_metrics(job_id)


def stalest_login(logging_in: list[Connection]) -> Connection:
    """The login in progress to end for a new connection: one waiting on its client, not on the engine;
    of those, one silent since it connected over a second ago (a client sends its TLS hello at once), else
    the one waiting longest (a real client answers each step of the login at once)."""
    waiting = [c for c in logging_in if c.waiting_for_client()] or logging_in
    mute_since = time.monotonic() - _SILENT_S
    return min(waiting, key=lambda c: (c.spoke or c.created > mute_since, c.waiting_since))

