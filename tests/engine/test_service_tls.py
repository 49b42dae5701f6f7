"""The engine's TCP port: TLS, a login that proves the token without sending it, pinned certificates, and
a flood of connections from one host that does not lock out a real client of that host.

One real engine service (simulated 4×RTX 4090, XDG folders in a temporary directory) listens on loopback;
every check talks to it over real sockets.
"""

from __future__ import annotations

import json
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest

from rigpilot.engine import paths
from rigpilot.engine.api import pins, protocol, tls
from rigpilot.engine.api.client import EngineClient, EngineError, FingerprintMismatch
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.service import nodes

from support.engine import Engine

OTHER_FINGERPRINT = "SHA256:" + "A" * 43


@pytest.fixture(scope="module")
def tcp_engine(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("tls")
    (base / "r").mkdir(mode=0o700)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(base / "r"))
        mp.setenv("XDG_STATE_HOME", str(base / "state"))
        mp.setenv("XDG_CONFIG_HOME", str(base / "config"))
        mp.setenv("RIGPILOT_SIMULATE", "4x-rtx4090")
        engine = Engine(base)
        engine.start("--tcp", "127.0.0.1:0")
        try:
            with engine.client() as c:
                hello = c.request("hello")
            host, port = hello["tcp"]
            yield engine, f"{host}:{port}", paths.token_path().read_text().strip(), hello["fingerprint"]
        finally:
            engine.stop()


def tls_connect(address: str) -> tuple[ssl.SSLSocket, object, dict, str]:
    """A TLS connection by hand: the socket, its line reader, the engine's challenge, the certificate seen."""
    host, port = address.rsplit(":", 1)
    s = tls.client_context().wrap_socket(socket.create_connection((host, int(port)), timeout=10))
    f = s.makefile("rb")
    challenge = json.loads(f.readline())["challenge"]
    return s, f, challenge, tls.fingerprint_of(s.getpeercert(binary_form=True))


def engine_log(engine: Engine) -> str:
    return (engine.tmp / "engine.log").read_text(errors="replace")


def test_the_certificate_is_made_once_kept_private_and_is_what_the_port_presents(tcp_engine, capsys):
    engine, address, token, fingerprint = tcp_engine
    folder = engine.tmp / "state" / "rigpilot" / "tls"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {
        tls.CERT_FILE: 0o600, tls.KEY_FILE: 0o600
    }  # fmt: skip
    assert cli_main(["engine", "--fingerprint"]) == 0
    assert capsys.readouterr().out.strip() == fingerprint  # the same certificate, not a new one
    s, _, _, seen = tls_connect(address)
    assert seen == fingerprint and s.version() in ("TLSv1.2", "TLSv1.3")
    s.close()
    with EngineClient(tcp=address, token=token, timeout=10) as c:
        assert c.fingerprint == fingerprint and c.request("jobs")["jobs"] == []
    # The first login pinned it for this address, in a file only this user can read.
    assert pins.pinned(address) == fingerprint
    assert stat.S_IMODE(pins.pins_path().stat().st_mode) == 0o600
    # The forms a user may paste (openssl's hex with colons, or without the prefix) are one fingerprint.
    der = ssl.PEM_cert_to_DER_cert((folder / tls.CERT_FILE).read_text())
    import hashlib

    hexed = ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())
    assert tls.parse_fingerprint(hexed) == tls.parse_fingerprint(fingerprint.removeprefix("SHA256:")) == fingerprint
    for bad in ("SHA256:short", "", "MD5:" + "0" * 32):
        with pytest.raises(Exception, match="not a certificate fingerprint"):
            tls.parse_fingerprint(bad)


def test_a_captured_login_replayed_on_a_new_connection_fails(tcp_engine):
    engine, address, token, fingerprint = tcp_engine
    s1, f1, challenge1, seen = tls_connect(address)
    mine = tls.new_nonce()
    captured = protocol.encode(protocol.request(
        1, "hello", client="test", nonce=mine, proof=tls.login_proof(token, "client", challenge1["nonce"], mine, seen)
    ))  # fmt: skip
    assert token.encode() not in captured  # the token itself never crosses the wire
    s1.sendall(captured)
    reply = json.loads(f1.readline())
    assert reply["ok"], reply
    # The engine proved it holds the token too, for this connection only.
    assert reply["result"]["proof"] == tls.login_proof(token, "engine", challenge1["nonce"], mine, fingerprint)
    s1.sendall(protocol.encode(protocol.request(2, "jobs")))
    assert json.loads(f1.readline())["ok"]

    # The same bytes on a new connection: a new challenge, so they prove nothing.
    s2, f2, challenge2, _ = tls_connect(address)
    assert challenge2["nonce"] != challenge1["nonce"]
    s2.sendall(captured)
    refused = json.loads(f2.readline())
    assert refused["error"]["code"] == protocol.UNAUTHORIZED and "wrong token" in refused["error"]["message"]
    assert f2.readline() == b""  # and the connection is closed: no second try on it

    # A proof made for another certificate (what a man in the middle would relay) does not match either.
    s3, f3, challenge3, _ = tls_connect(address)
    relayed = tls.login_proof(token, "client", challenge3["nonce"], mine, OTHER_FINGERPRINT)
    s3.sendall(protocol.encode(protocol.request(1, "hello", nonce=mine, proof=relayed)))
    assert json.loads(f3.readline())["error"]["code"] == protocol.UNAUTHORIZED
    # Nor does anything but a hello first, or a hello that brings the token itself.
    s4, f4, _, _ = tls_connect(address)
    s4.sendall(protocol.encode(protocol.request(1, "jobs")))
    assert json.loads(f4.readline())["error"]["code"] == protocol.UNAUTHORIZED and f4.readline() == b""
    s5, f5, _, _ = tls_connect(address)
    s5.sendall(protocol.encode({"v": 1, "id": 1, "type": "hello", "args": {"token": token}}))
    assert not json.loads(f5.readline())["ok"] and f5.readline() == b""
    for s in (s1, s2, s3, s4, s5):
        s.close()
    with pytest.raises(EngineError, match="wrong token") as e:
        EngineClient(tcp=address, token="y" * 43, timeout=10).connect()
    assert e.value.code == protocol.UNAUTHORIZED
    assert "Traceback" not in engine_log(engine)


def test_a_certificate_other_than_the_pinned_one_is_refused_in_one_line(tcp_engine):
    _, address, token, fingerprint = tcp_engine
    # Given by the caller.
    with pytest.raises(FingerprintMismatch) as e:
        EngineClient(tcp=address, token=token, fingerprint=OTHER_FINGERPRINT, timeout=10).connect()
    said = str(e.value)
    assert len(said.splitlines()) == 1 and fingerprint in said and OTHER_FINGERPRINT in said
    assert "rigpilot engine --fingerprint" in said
    # Pinned in the known-engines file: the line says which file to fix, and nothing is silently re-pinned.
    port = address.rsplit(":", 1)[1]
    other_address = f"localhost:{port}"  # the same engine under another name, pinned to another certificate
    paths.write_private(pins.pins_path(), json.dumps({"version": 1, "engines": {other_address: OTHER_FINGERPRINT}}))
    with pytest.raises(FingerprintMismatch, match=str(pins.pins_path())):
        EngineClient(tcp=other_address, token=token, timeout=10).connect()
    assert pins.pinned(other_address) == OTHER_FINGERPRINT

    # A node: pinned on its first login, kept when it is added again, refused when it changes.
    nodes.add("box", address, token)
    assert nodes.load()["box"].fingerprint is None
    probed = nodes.probe(nodes.get("box"))
    assert probed["reachable"] and probed["fingerprint"] == fingerprint
    assert nodes.load()["box"].fingerprint == fingerprint
    nodes.add("box", address, token)
    assert nodes.load()["box"].fingerprint == fingerprint
    nodes.add("box", address, token, OTHER_FINGERPRINT)
    probed = nodes.probe(nodes.get("box"))
    assert not probed["reachable"] and len(probed["error"].splitlines()) == 1
    assert f"rigpilot nodes add box {address} --fingerprint {fingerprint}" in probed["error"]
    assert nodes.load()["box"].fingerprint == OTHER_FINGERPRINT  # never silently replaced
    # Added with the right one, as the refusal says: it answers again.
    nodes.add("box", address, token, fingerprint)
    assert nodes.probe(nodes.get("box"))["reachable"]
    nodes.remove("box")


def test_plain_text_on_the_tls_port_is_refused_cleanly(tcp_engine):
    engine, address, token, _ = tcp_engine
    host, port = address.rsplit(":", 1)
    # An older Rigpilot: its hello with the token in clear gets one coded line saying to upgrade, then the end.
    old = socket.create_connection((host, int(port)), timeout=10)
    old.sendall(protocol.encode({"v": 1, "id": 1, "type": "hello", "args": {"token": "x" * 43}}))
    f = old.makefile("rb")
    line = json.loads(f.readline())
    assert line["error"]["code"] == protocol.TLS_REQUIRED and "update Rigpilot" in line["error"]["message"]
    assert "replace it" in line["error"]["message"]  # that token crossed the network in clear
    assert f.readline() == b""
    old.close()
    # Something else altogether (a browser, a port scanner): the same line, then the end.
    http = socket.create_connection((host, int(port)), timeout=10)
    http.sendall(b"GET / HTTP/1.1\r\nHost: rigpilot\r\n\r\n")
    f = http.makefile("rb")
    assert json.loads(f.readline())["error"]["code"] == protocol.TLS_REQUIRED and f.readline() == b""
    http.close()
    # A TLS record header followed by junk: the handshake fails and the connection ends, nothing more.
    junk = socket.create_connection((host, int(port)), timeout=10)
    junk.sendall(b"\x16\x03\x01\x00\x05hello" + b"\x00" * 64)
    answer = b""
    try:
        while chunk := junk.recv(4096):
            answer += chunk
    except ConnectionResetError:
        pass
    assert b"{" not in answer  # at most a TLS alert: no reply in plain text to a TLS client
    junk.close()
    # None of it disturbed the engine.
    with EngineClient(tcp=address, token=token, timeout=10) as c:
        assert c.request("machine")["machine"]["label"] == "simulated: 4×RTX 4090"
    text = engine_log(engine)
    assert "Traceback" not in text and "sent a token in clear" in text


def _silent(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _handshaken(address: str) -> socket.socket:
    """A connection that completes TLS and then says nothing: the costlier kind of flood."""
    s, _, _, _ = tls_connect(address)
    return s


@pytest.mark.slow
@pytest.mark.parametrize("kind", [_silent, _handshaken], ids=["silent", "after-tls"])
def test_a_flood_from_one_host_does_not_lock_out_a_real_client_of_that_host(tcp_engine, kind):
    engine, address, token, _ = tcp_engine
    held: list[socket.socket] = []
    stop = threading.Event()

    def flood() -> None:
        for _ in range(300):  # bounded: a few seconds of connections that never log in
            if stop.is_set():
                return
            try:
                held.append(kind(address))
            except (OSError, ValueError, KeyError):
                pass  # one the engine made room with before it was done

    for _ in range(40):  # more than the host may have logging in (16)
        held.append(kind(address))
    flooders = [threading.Thread(target=flood) for _ in range(2)]
    for t in flooders:
        t.start()
    try:
        logins = during = 0
        while logins < 6 or any(t.is_alive() for t in flooders):  # as long as the flood goes on, from 127.0.0.1 too
            with EngineClient(tcp=address, token=token, timeout=30) as c:
                assert c.request("hello")["pid"] == engine.proc.pid
            logins += 1
            during += any(t.is_alive() for t in flooders)
        assert during >= 3, "the flood ended before the real client could try"
    finally:
        stop.set()
        for t in flooders:
            t.join()
        for s in held:
            s.close()
    text = engine_log(engine)
    assert "Traceback" not in text and "the stalest make room" in text
    with EngineClient(tcp=address, token=token, timeout=10) as c:
        assert c.request("jobs")["jobs"] == []


def test_the_tls_channel_reads_and_writes_from_two_threads_at_once(tmp_path, monkeypatch):
    """The engine's reader and writer threads share one TLS connection: many messages each way at once arrive
    whole and in order (OpenSSL's objects are not thread-safe; the channel serialises them)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    identity = tls.load_or_create_identity()
    assert tls.load_or_create_identity() == identity  # made once
    a, b = socket.socketpair()
    channel = tls.ServerChannel(a, tls.server_context(identity))
    client = tls.client_context().wrap_socket(b, do_handshake_on_connect=False)
    hs = threading.Thread(target=client.do_handshake)
    hs.start()
    import time

    channel.handshake(time.monotonic() + 10)
    hs.join()
    n = 2000
    got_by_engine: list[bytes] = []
    got_by_client: list[bytes] = []

    def engine_reads() -> None:
        f = tls.reader(channel)
        for _ in range(n):
            got_by_engine.append(f.readline())

    def engine_writes() -> None:
        for i in range(n):
            channel.sendall(b"to client %d %s\n" % (i, b"x" * (i % 700)))

    def client_reads() -> None:
        f = client.makefile("rb")
        for _ in range(n):
            got_by_client.append(f.readline())

    threads = [threading.Thread(target=t) for t in (engine_reads, engine_writes, client_reads)]
    for t in threads:
        t.start()
    for i in range(n):  # the client writes from this thread while its reader thread reads
        client.sendall(b"to engine %d %s\n" % (i, b"y" * (i % 500)))
    for t in threads:
        t.join(60)
    assert got_by_engine == [b"to engine %d %s\n" % (i, b"y" * (i % 500)) for i in range(n)]
    assert got_by_client == [b"to client %d %s\n" % (i, b"x" * (i % 700)) for i in range(n)]
    client.close()
    assert tls.reader(channel).read() == b""  # the client's leaving reads as the end
    a.close()


def test_a_certificate_that_cannot_be_read_is_refused_not_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    identity = tls.load_or_create_identity()
    Path(identity.cert).write_text("not a certificate")
    with pytest.raises(Exception, match="remove that folder to make a new one"):
        tls.load_or_create_identity()
    assert Path(identity.cert).read_text() == "not a certificate"
