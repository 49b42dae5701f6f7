"""TLS for the engine's TCP listener and its clients, and the login that proves the token without sending it.

Every TCP connection to an engine is TLS (1.2 at least, 1.3 where both ends
have it). The engine's certificate is self-signed (an EC P-256 key, made on the
first `--tcp` start and kept 0600 in the engine's private state folder), so
clients do not check it against CA chains or a host name: they pin its SHA-256
fingerprint, as SSH's known_hosts pins host keys, and refuse a different one.

The login, once TLS is up:

    engine → client   {"v": 1, "challenge": {"nonce": N_e, "auth": "hmac-sha256"}}
    client → engine   hello {…, "nonce": N_c, "proof": HMAC(token, "client" | N_e | N_c | F)}
    engine → client   hello's result {…, "proof": HMAC(token, "engine" | N_e | N_c | F)}

F is the fingerprint of the certificate the engine presented. The token never
crosses the wire; a proof is good for one connection only (a fresh N_e each
time), and only to the engine whose certificate the client saw: a man in the
middle presents another certificate, so a proof relayed to the real engine
does not match. The engine's own proof tells the client it reached an engine
that holds the token, which makes pinning the first certificate seen safe
against anyone who does not have the token.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import hashlib
import hmac
import io
import os
import re
import secrets
import select
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from rigpilot.engine import paths
from rigpilot.engine.errors import UserError

CERT_FILE = "engine-cert.pem"
KEY_FILE = "engine-key.pem"
AUTH = "hmac-sha256"
NONCE_BYTES = 32
HANDSHAKE_RECORD = 0x16  # the first byte of every TLS connection: a handshake record (the ClientHello)
_HEX = re.compile(r"^[0-9a-f]{64}$")
_LOGIN_LABEL = b"rigpilot-login/1"


@dataclass(frozen=True)
class Identity:
    """This engine's certificate and key files, and the fingerprint clients pin."""

    cert: Path
    key: Path
    fingerprint: str


# -- fingerprints ------------------------------------------------------------------------------


def fingerprint_of(der: bytes) -> str:
    """The SHA-256 fingerprint of a DER certificate, written as SSH writes host key fingerprints."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(der).digest()).decode().rstrip("=")


def parse_fingerprint(text: str) -> str:
    """A fingerprint as the user typed it (SHA256:base64, or openssl's hex with colons) in the one form we store."""
    raw = text.strip()
    body = raw.split(":", 1)[1] if raw.upper().startswith("SHA256:") else raw
    digest = None
    hexed = body.replace(":", "")
    if re.fullmatch(r"[0-9A-Fa-f]{64}", hexed):
        digest = bytes.fromhex(hexed)
    else:
        with contextlib.suppress(binascii.Error, ValueError):
            decoded = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
            digest = decoded if len(decoded) == 32 else None
    if digest is None:
        raise UserError(
            f"{raw[:80]!r} is not a certificate fingerprint; it looks like SHA256:… as "
            "'rigpilot engine --fingerprint' prints it on the engine's machine"
        )
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# -- the engine's certificate ------------------------------------------------------------------


def tls_dir() -> Path:
    return paths.engine_state_dir() / "tls"


def load_or_create_identity() -> Identity:
    """This engine's certificate: made once, on the first `--tcp` start, then the same one for good.

    A certificate that exists but cannot be read is refused, never replaced: a new one would change
    the fingerprint every client pinned."""
    d = tls_dir()
    if not d.exists():
        _create_apart(d)
    cert, key = d / CERT_FILE, d / KEY_FILE
    try:
        for p in (d, cert, key):
            if p.stat().st_mode & 0o077:
                os.chmod(p, 0o700 if p == d else 0o600)
        der = ssl.PEM_cert_to_DER_cert(cert.read_text())
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (OSError, ValueError, ssl.SSLError) as e:
        raise UserError(
            f"the engine's TLS certificate in {d} cannot be used ({getattr(e, 'strerror', None) or e}); remove that "
            "folder to make a new one, then pin the new fingerprint on every client and node"
        ) from None
    return Identity(cert, key, fingerprint_of(der))


def _create_apart(d: Path) -> None:
    """Make the certificate in a short-lived child: `cryptography` (about 10 MiB) never sits in the engine for good."""
    r = subprocess.run(
        [sys.executable, "-m", "rigpilot.engine.api.tls", str(d)], capture_output=True, text=True, timeout=120
    )
    if r.returncode != 0:
        said = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise UserError(f"cannot make the engine's TLS certificate in {d}: {said}")


def _create(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"Rigpilot engine on {socket.gethostname()}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        # Pinned, never checked against a clock: RFC 5280's "no well-defined expiration date".
        .not_valid_after(datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Both files in a new folder that is renamed into place: the folder is there with both, or not at all.
    tmp = d.with_name(f"{d.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir(mode=0o700)
    try:
        with paths.open_private(tmp / KEY_FILE, "wb") as f:
            f.write(key_pem)
            os.fsync(f.fileno())
        with paths.open_private(tmp / CERT_FILE, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
            os.fsync(f.fileno())
        try:
            os.rename(tmp, d)
        except OSError:
            if not d.is_dir():  # not another process's certificate made meanwhile: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- contexts --------------------------------------------------------------------------------------


def server_context(identity: Identity) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    ctx.num_tickets = 0  # nothing resumes a session: every connection logs in afresh
    ctx.load_cert_chain(identity.cert, identity.key)
    return ctx


def client_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # The certificate is self-signed: it is checked by its pinned fingerprint after the handshake, not here.
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


# -- the login -------------------------------------------------------------------------------------


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def is_nonce(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(_HEX.match(value))


def login_proof(token: str, role: str, engine_nonce: str, client_nonce: str, fingerprint: str) -> str:
    """HMAC-SHA256 of this connection's transcript under the token; `role` is "client" or "engine"."""
    transcript = b"\n".join(
        (_LOGIN_LABEL, role.encode(), engine_nonce.encode(), client_nonce.encode(), fingerprint.encode())
    )
    return hmac.new(token.encode(), transcript, hashlib.sha256).hexdigest()


def proof_matches(proof: object, expected: str) -> bool:
    return isinstance(proof, str) and hmac.compare_digest(proof.encode(), expected.encode())


# -- the engine's side of one connection ------------------------------------------------------------


class ServerChannel:
    """TLS over one accepted socket, for a reader thread and a writer thread at once.

    OpenSSL's connection objects must not be used by two threads at a time, and a blocking read
    would hold a lock for as long as the client is silent; so the TLS state lives in memory
    (`SSLObject` over two `MemoryBIO`s), every use of it is brief and under `_lock`, and the socket
    itself is read and written outside it. Ciphertext leaves in the order it was made (`_send_lock`
    is taken before `_lock` is let go).
    """

    def __init__(self, sock: socket.socket, context: ssl.SSLContext):
        self.sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=True)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()

    def handshake(self, deadline: float, on_wait: Callable[[], None] | None = None) -> None:
        """Complete the TLS handshake by `deadline` (time.monotonic); raises ssl.SSLError, OSError or TimeoutError.

        `on_wait()`, when given, is called each time the engine has answered and waits for the client."""
        while True:
            with self._lock:
                try:
                    self._tls.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                out = self._take_output_locked()
            self._send_taken(out)
            if done:
                return
            if on_wait is not None:
                on_wait()
            data = self._recv_raw(deadline)
            if not data:
                raise ConnectionError("the client closed the connection during the TLS handshake")
            with self._lock:
                self._in.write(data)

    def recv(self, size: int) -> bytes:
        """Up to `size` bytes of plaintext; b"" once the client has gone."""
        while True:
            with self._lock:
                try:
                    data: bytes | None = self._tls.read(size)
                except ssl.SSLWantReadError:
                    data = None
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    data = b""
                out = self._take_output_locked()
            try:
                self._send_taken(out)  # TLS's own answers (a close_notify back, a key update)
            except OSError:
                if data is None:
                    raise
            if data is not None:
                return data  # what was read counts even when the client is no longer there to answer
            raw = self._recv_raw(None)
            with self._lock:
                if raw:
                    self._in.write(raw)
                else:
                    self._in.write_eof()

    def sendall(self, data: bytes) -> None:
        with self._lock:
            self._tls.write(data)
            out = self._take_output_locked()
        self._send_taken(out)

    def _take_output_locked(self) -> bytes:
        out = self._out.read()
        if out:
            self._send_lock.acquire()  # released by _send_taken, once these bytes are on their way
        return out

    def _send_taken(self, out: bytes) -> None:
        if out:
            try:
                self.sock.sendall(out)
            finally:
                self._send_lock.release()

    def _recv_raw(self, deadline: float | None) -> bytes:
        if deadline is not None and not wait_readable(self.sock, deadline):
            raise TimeoutError("the client sent nothing in time")
        return self.sock.recv(1 << 16)


class _ChannelStream(io.RawIOBase):
    def __init__(self, channel: ServerChannel):
        super().__init__()
        self.channel = channel

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.channel.recv(len(b))
        b[: len(data)] = data
        return len(data)


def reader(channel: ServerChannel) -> io.BufferedReader:
    """The channel's plaintext as a buffered stream, read line by line as requests are."""
    return io.BufferedReader(_ChannelStream(channel), 1 << 16)


def wait_readable(sock: socket.socket, deadline: float) -> bool:
    """Whether `sock` has something to read (or was closed) before `deadline` (time.monotonic)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(max(deadline - time.monotonic(), 0) * 1000))


def peer_gone(sock: socket.socket) -> bool:
    """Whether the other end hung up, even with bytes of its still unread (a TLS close_notify, a pipelined request)."""
    p = select.poll()
    p.register(sock, select.POLLRDHUP)
    try:
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))
    except OSError:
        return True


if __name__ == "__main__":  # _create_apart's child
    _create(Path(sys.argv[1]))
