"""How the engine service holds up under connection floods: prints what it held, for how long, at what memory.

    .venv/bin/python benchmarks/engine_limits.py [--idle 1000] [--local 2000] [--stuck 4]

Starts a private engine (simulated 4×RTX 4090, XDG folders in a temporary
directory, TCP on loopback) and measures, each beside the time a `hello`
takes from a well-behaved client at that moment:
- idle TCP connections that never log in: how many stay open, and how long until they are closed;
- N local (unix socket) connections at once: how many are served, the service's RSS and threads;
- clients that subscribe and pipeline requests but never read: RSS, and whether they are cut off.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import psutil
from engine_common import scratch_engine


def hello_time(tcp: tuple[str, int] | None = None, source: str = "127.0.0.2") -> float:
    """A full client's connect + hello; over TCP (TLS and the login) from `source`: 127.0.0.2 is another host
    to the per-host limits, 127.0.0.1 the flooding one."""
    from rigpilot.engine.api import protocol, tls
    from rigpilot.engine.api.client import EngineClient

    t0 = time.perf_counter()
    if tcp is None:
        with EngineClient(autostart=False, timeout=30):
            pass
        return time.perf_counter() - t0
    raw = socket.create_connection(tcp, timeout=30, source_address=(source, 0))
    with tls.client_context().wrap_socket(raw) as s:
        f = s.makefile("rb")
        nonce = protocol.decode(f.readline())["challenge"]["nonce"]
        seen = tls.fingerprint_of(s.getpeercert(binary_form=True))
        mine = tls.new_nonce()
        proof = tls.login_proof(os.environ["RIGPILOT_ENGINE_TOKEN"], "client", nonce, mine, seen)
        s.sendall(protocol.encode(protocol.request(1, "hello", nonce=mine, proof=proof)))
        reply = protocol.decode(f.readline())
    assert reply["ok"], reply
    return time.perf_counter() - t0


def mib(proc: psutil.Process) -> str:
    return f"{proc.memory_info().rss / 2**20:.0f} MiB"


def open_count(socks: list[socket.socket]) -> int:
    """Connections the service has not closed (no EOF pending)."""
    n = 0
    for s in socks:
        try:
            s.setblocking(False)
            data = s.recv(65536, socket.MSG_PEEK)
            n += data != b"" and b'"ok":false' not in data
        except BlockingIOError:
            n += 1
        except OSError:
            pass
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=int, default=1000, help="idle TCP connections without a login")
    ap.add_argument("--local", type=int, default=2000, help="local connections at once")
    ap.add_argument("--stuck", type=int, default=4, help="clients that never read")
    args = ap.parse_args()
    with scratch_engine("--tcp", "127.0.0.1:0") as (engine, tmp):
        measure(engine, args)
        text = (tmp / "engine.log").read_text(errors="replace")
    print(f"engine log: {text.count('Traceback')} tracebacks; warnings: "
          + "; ".join(sorted({line.split(': ', 1)[-1][:90] for line in text.splitlines() if ' WARNING ' in line})[:4]))
    return 0


def measure(engine: subprocess.Popen, args: argparse.Namespace) -> None:
    from rigpilot.engine import paths
    from rigpilot.engine.api import protocol
    from rigpilot.engine.api.client import EngineClient, EngineError

    with EngineClient(autostart=False, timeout=5) as c:
        tcp = tuple(c.hello["tcp"])
    proc = psutil.Process(engine.pid)
    os.environ["RIGPILOT_ENGINE_TOKEN"] = paths.token_path().read_text().strip()
    print(f"engine pid {engine.pid}: {mib(proc)}, {proc.num_threads()} threads; hello {hello_time(tcp) * 1e3:.1f} ms (tcp)")

    # 1. idle TCP connections, no login
    idle = []
    t0 = time.monotonic()
    for _ in range(args.idle):
        try:
            idle.append(socket.create_connection(tcp, timeout=5))
        except OSError:
            break
    time.sleep(0.5)
    held = open_count(idle)
    try:
        same_host = f"{hello_time(tcp, '127.0.0.1') * 1e3:.1f} ms"
    except (OSError, AssertionError, ValueError, KeyError) as e:  # a login cut short by the flood: no retry here
        same_host = f"cut short ({type(e).__name__})"
    print(f"idle TCP, no login, from 127.0.0.1: {len(idle)} opened, {held} held, the rest made room; {mib(proc)}, "
          f"{proc.num_threads()} threads; hello from 127.0.0.2 {hello_time(tcp) * 1e3:.1f} ms, "
          f"from 127.0.0.1 {same_host}, local {hello_time() * 1e3:.1f} ms")  # fmt: skip
    while open_count(idle) and time.monotonic() - t0 < 120:
        time.sleep(0.25)
    print(f"  all closed by the service {time.monotonic() - t0:.1f} s after connecting"
          if not open_count(idle) else "  still open after 120 s")  # fmt: skip
    for s in idle:
        s.close()

    # 2. many local connections
    time.sleep(1)
    local = []
    for _ in range(args.local):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(paths.socket_path()))
        except OSError:
            s.close()
            break
        local.append(s)
    time.sleep(1.0)
    served = open_count(local)
    try:
        local_hello = f"{hello_time() * 1e3:.1f} ms"
    except EngineError as e:
        local_hello = f"refused at once ({e.code}: {e})"
    print(f"{len(local)} local connections: {served} served, {len(local) - served} refused (busy); "
          f"{mib(proc)}, {proc.num_threads()} threads; another local hello: {local_hello}")  # fmt: skip
    for s in local:
        s.close()
    time.sleep(2)
    print(f"  after they closed: {mib(proc)}, {proc.num_threads()} threads")

    # 3. clients that never read: subscribed, and pipelining requests with large replies
    stuck = []
    for _ in range(args.stuck):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(paths.socket_path()))
        s.setblocking(False)
        s.send(protocol.encode(protocol.request(0, "subscribe", topics=["telemetry", "jobs"])))
        stuck.append(s)
    frame = protocol.encode(protocol.request(1, "telemetry_history", limit=100_000))
    sent = [0] * len(stuck)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20:
        for i, s in enumerate(stuck):
            try:
                s.send(frame)
                sent[i] += 1
            except (BlockingIOError, OSError):
                pass
        time.sleep(0.01)
    print(f"{len(stuck)} clients that never read, 20 s: requests taken {sent}; {mib(proc)}, "
          f"{proc.num_threads()} threads; hello {hello_time() * 1e3:.1f} ms")  # fmt: skip
    for s in stuck:
        s.close()
    time.sleep(2)
    print(f"  after they closed: {mib(proc)}, {proc.num_threads()} threads")


if __name__ == "__main__":
    sys.exit(main())
