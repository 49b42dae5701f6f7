"""Other Rigpilot engines a job may span: the registry (`rigpilot nodes`, Settings → Nodes) and how to reach them.

A node is another machine's engine service, reached over its TCP listener
(`rigpilot engine --tcp ADDR:PORT` there; the token is that machine's
`~/.config/rigpilot/engine-token`) in TLS, with a login that proves the token
without sending it (engine.api.tls). Each node's certificate fingerprint is
pinned here: the one given when it was added (`--fingerprint`), else the first
one it presented while proving it holds the token; another one is then refused.
The registry is `nodes.json` in this user's config folder: a 0600 file in a 0700
folder, because it holds the tokens. Tokens never go into job folders, job
records or logs; a job names its nodes and their addresses only, and the engine
looks the token up when it talks to them.

`check_node` is the one validation of a node, used by the CLI, the GUI and the
socket alike.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import socket
import stat
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.settings import config_dir

LOCAL = "local"  # this engine, in `--nodes local,box2`
NODES_FILE = "nodes.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_HOST = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_TOKEN = re.compile(r"^[A-Za-z0-9_\-.~+/=]{16,512}$")
REMOTE_HINT = "on that machine run: rigpilot engine --tcp 0.0.0.0:PORT (its token is in ~/.config/rigpilot/engine-token)"
_registry_lock = threading.Lock()  # adds, removes and first pins come from request and probe threads at once


@dataclass(frozen=True)
class Node:
    name: str
    address: str  # host:port of its engine's TCP listener
    token: str
    fingerprint: str | None = None  # its TLS certificate's, pinned (None: pinned on the first login)

    @property
    def host(self) -> str:
        return split_address(self.address)[0]

    def public(self) -> dict[str, Any]:
        """What may be shown or stored with a job: never the token."""
        return {"name": self.name, "address": self.address, "fingerprint": self.fingerprint}


def split_address(address: str) -> tuple[str, int]:
    m = re.fullmatch(r"\[(?P<v6>[^\]]+)\]:(?P<p6>\d{1,5})|(?P<host>[^:\s\[\]]+):(?P<port>\d{1,5})", address.strip())
    if not m:
        raise UserError(f"a node's address is HOST:PORT (e.g. box2.lan:7860), not {address!r}")
    host, port = (m["v6"], int(m["p6"])) if m["v6"] else (m["host"], int(m["port"]))
    if not 1 <= port <= 65535:
        raise UserError(f"the port of {address!r} must be from 1 to 65535")
    if m["v6"]:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UserError(f"{host!r} is not an IPv6 address") from None
    elif not _HOST.match(host):
        raise UserError(f"{host!r} is not a host name or IP address")
    return host, port


def check_node(name: Any, address: Any, token: Any, fingerprint: Any = None) -> Node:
    """A valid node, or one UserError line saying what is wrong (CLI, GUI and socket use this alone)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(
            f"a node name is 1–63 letters, digits, '.', '_' or '-', starting with a letter or digit, not {name!r}"
        )
    if name.lower() == LOCAL:
        raise UserError(f"'{LOCAL}' means this engine itself; choose another name")
    if not isinstance(address, str):
        raise UserError("a node's address is HOST:PORT")
    host, port = split_address(address)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    token = token.strip() if isinstance(token, str) else token
    if not isinstance(token, str) or not token:
        raise UserError(f"node {name} needs its engine's token; {REMOTE_HINT}")
    if not _TOKEN.match(token):
        raise UserError(f"that is not an engine token (16–512 characters of letters, digits and -_.~+/=); {REMOTE_HINT}")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise UserError("a node's certificate fingerprint is text like SHA256:…")
    if fingerprint is not None and fingerprint.strip():
        from rigpilot.engine.api.tls import parse_fingerprint

        fingerprint = parse_fingerprint(fingerprint)
    return Node(name, address, token, fingerprint or None)


# -- the registry ----------------------------------------------------------------------------


def registry_path() -> Path:
    return config_dir() / NODES_FILE


def load() -> dict[str, Node]:
    """The registered nodes by name; a file that cannot be read is refused in one line, never overwritten."""
    p = registry_path()
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise UserError(f"the node registry {p} is unreadable ({e}); fix or remove it") from None
    entries = raw.get("nodes") if isinstance(raw, dict) else None
    if not isinstance(entries, dict):
        raise UserError(f"the node registry {p} is not a Rigpilot node list; fix or remove it")
    out = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise UserError(f"the node registry {p}: node {name!r} is not an object")
        try:
            out[name] = check_node(name, entry.get("address"), entry.get("token"), entry.get("fingerprint"))
        except UserError as e:
            raise UserError(f"the node registry {p}: {e}") from None
    return out


def _save(found: dict[str, Node]) -> None:
    p = registry_path()
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if stat.S_IMODE(p.parent.stat().st_mode) & 0o077:
            os.chmod(p.parent, 0o700)
    data = {"version": 1, "nodes": {n.name: _entry(n) for n in found.values()}}
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # born 0600: the tokens are secrets
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, p)


def _entry(n: Node) -> dict[str, str]:
    return {"address": n.address, "token": n.token, **({"fingerprint": n.fingerprint} if n.fingerprint else {})}


def add(name: Any, address: Any, token: Any, fingerprint: Any = None) -> Node:
    """Register (or replace) a node. Added again at the same address without a fingerprint, it keeps its pin:
    a certificate that changed is accepted only by giving the new fingerprint."""
    node = check_node(name, address, token, fingerprint)
    with _registry_lock:
        found = load()
        old = found.get(node.name)
        if node.fingerprint is None and old is not None and old.address == node.address:
            node = replace(node, fingerprint=old.fingerprint)
        found[node.name] = node
        _save(found)
    return node


def pin(node: Node, fingerprint: str) -> None:
    """Pin the certificate `node` presented when it first proved it holds the token (unless it changed meanwhile)."""
    with _registry_lock:
        found = load()
        now = found.get(node.name)
        if now is not None and now.address == node.address and now.token == node.token and now.fingerprint is None:
            found[node.name] = replace(now, fingerprint=fingerprint)
            _save(found)


def remove(name: str) -> None:
    with _registry_lock:
        found = load()
        if name not in found:
            raise UserError(f"no node {name!r}; the nodes are: {', '.join(found) or 'none yet'}")
        del found[name]
        _save(found)


def get(name: str) -> Node:
    found = load()
    if name not in found:
        known = ", ".join(found) or "none yet"
        raise UserError(f"no node {name!r} (nodes: {known}); add it with: rigpilot nodes add {name} HOST:PORT")
    return found[name]


# -- talking to a node -------------------------------------------------------------------------


def client(node: Node, timeout: float = 15.0):  # -> EngineClient
    from rigpilot.engine.api.client import EngineClient

    return EngineClient(
        tcp=node.address, token=node.token, fingerprint=node.fingerprint, client_name="rigpilot-head", timeout=timeout,
        pin=None if node.fingerprint else (lambda seen: pin(node, seen)),
        pin_fix=f"add the node again with it: rigpilot nodes add {node.name} {node.address} --fingerprint {{seen}}",
    )  # fmt: skip


def probe(node: Node, timeout: float = 5.0) -> dict[str, Any]:
    """Whether the node answers with its token, and its machine: what `nodes list` and Settings show."""
    from rigpilot.engine.api.client import EngineError, EngineUnavailable

    out: dict[str, Any] = {**node.public(), "reachable": False}
    try:
        with client(node, timeout) as c:
            hello = c.hello
            out["fingerprint"] = c.fingerprint  # pinned now if it was not
            machine = c.request("machine")["machine"]
    except EngineError as e:
        out["error"] = f"refused: {e}" + (" (wrong token?)" if e.code == "unauthorized" else "")
        return out
    except (EngineUnavailable, OSError, TimeoutError, ConnectionError) as e:
        out["error"] = str(e) or type(e).__name__
        return out
    gpus = machine.get("gpus") or []
    out.update(
        reachable=True, version=hello.get("version"), protocol=hello.get("protocol"), label=machine.get("label"),
        simulated=bool(hello.get("simulated")), gpus=len(gpus), host_id=hello.get("host_id"),
    )  # fmt: skip
    return out


def probe_all(found: list[Node], timeout: float = 5.0) -> list[dict[str, Any]]:
    """`probe` of every node at once, in their order: one unreachable node costs its timeout once, not per node."""
    if len(found) <= 1:
        return [probe(n, timeout) for n in found]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(found), 16), thread_name_prefix="node-probe") as pool:
        return list(pool.map(lambda n: probe(n, timeout), found))


def host_id() -> str:
    """Which computer this is: two engines with the same id share a file system (loopback nodes).

    RIGPILOT_HOST_ID overrides it: containers cloned with one machine-id, or two engines on one
    computer that should be treated as separate machines (each then needs --shared-dir)."""
    if os.environ.get("RIGPILOT_HOST_ID"):
        return os.environ["RIGPILOT_HOST_ID"]
    import hashlib

    for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            text = Path(p).read_text().strip()
            if text:
                # Hashed: the machine-id itself is meant to stay on the machine (machine-id(5)).
                return hashlib.sha256(f"rigpilot-host:{text}@{socket.gethostname()}".encode()).hexdigest()[:32]
    return socket.gethostname()


def local_address_towards(node: Node, timeout: float = 5.0) -> str:
    """This machine's address as `node` reaches it: the source address of a connection to it."""
    host, port = split_address(node.address)
    with socket.create_connection((host, port), timeout=timeout) as s:
        return str(s.getsockname()[0])
