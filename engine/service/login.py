"""How a remote (TCP) client gets in: the TLS handshake, the login challenge, and its hello's proof of the token.

The token itself never crosses the network: the client proves it holds it by an HMAC over both sides' nonces and
the engine's certificate (engine.api.tls). A client that speaks plain text on the TLS port (an older Rigpilot
sending its token in clear) gets one `tls_required` line telling it to upgrade; one that says nothing within the
login timeout, or fails the proof, is closed.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable

from rigpilot.engine import __version__
from rigpilot.engine.api import protocol, tls
from rigpilot.engine.api.protocol import ProtocolError, Request
from rigpilot.engine.service.connection import Connection


def timed_out(conn: Connection, timeout_s: float) -> None:
    """End a connection that has not logged in within the login timeout."""
    conn.refuse(protocol.UNAUTHORIZED, f"no login within {timeout_s:g} s; closing", in_plain_text=True)


class TcpLogin:
    """The engine's side of a TCP client's login; `say_once(kind, line)` logs a line at most once in a while."""

    def __init__(
        self, context: ssl.SSLContext, identity: tls.Identity, token: str, timeout_s: float,
        say_once: Callable[[str, str], None],
    ) -> None:  # fmt: skip
        self.context = context
        self.identity = identity
        self.token = token
        self.timeout_s = timeout_s
        self.say_once = say_once

    def open(self, conn: Connection) -> bool:
        """A TCP connection's TLS handshake and login challenge; False when it ends here."""
        deadline = conn.created + self.timeout_s
        try:
            if not tls.wait_readable(conn.sock, deadline):
                timed_out(conn, self.timeout_s)
                return False
            first = conn.sock.recv(1, socket.MSG_PEEK)
            if not first:
                return False
            conn.spoke = conn.working = True
            if first[0] != tls.HANDSHAKE_RECORD:
                self._refuse_plain_text(conn, deadline)
                return False
            channel = tls.ServerChannel(conn.sock, self.context)
            channel.handshake(deadline, on_wait=conn.on_login_wait)
        except (OSError, TimeoutError) as e:  # ssl.SSLError is an OSError: a client that is not TLS, or left
            if not conn.closing:
                self.say_once("tls", f"TLS handshake with {conn.peer} failed: {e}")
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
        self.say_once("plain", (
            f"{conn.host} spoke plain text to the TLS port{' and sent a token in clear (an older Rigpilot?)' if sent_token else ''}"
        ))  # fmt: skip

    def authenticate(self, conn: Connection, req: Request) -> None:
        """Check the first request of a TCP client: a hello with the proof that it holds this engine's token."""
        # No path in these lines: the client is not yet known to be this user.
        proof, nonce = req.args.get("proof"), req.args.get("nonce")
        if req.type != "hello" or not tls.is_nonce(nonce) or not isinstance(proof, str):
            raise ProtocolError(protocol.UNAUTHORIZED, (
                "remote clients must start with hello and the login proof (the engine's token is never sent); "
                "update Rigpilot on this computer if it sent something else"
            ), fatal=True)  # fmt: skip
        expected = tls.login_proof(self.token, "client", conn.nonce, nonce, self.identity.fingerprint)
        if not tls.proof_matches(proof, expected):
            raise ProtocolError(protocol.UNAUTHORIZED, (
                "wrong token: the login does not match this engine's token (set RIGPILOT_ENGINE_TOKEN, or the "
                "node's token, to the one in the engine machine's Rigpilot config folder)"
            ), fatal=True)  # fmt: skip
        conn.client_nonce = nonce
        conn.authenticated = True
