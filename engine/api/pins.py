"""The engines this user's clients have reached over TCP, by address, and the certificate each presented.

The remote-engine connection of the GUI (Settings → Remote engine) and any other
client given an address pins the engine's certificate fingerprint here the first
time the engine proves it holds the token, as SSH's known_hosts does; after
that a different certificate at that address is refused. Nodes keep their pins
in the node registry instead (engine.service.nodes). The file is
`known-engines.json` in the config folder, 0600 (it names the machines this
user drives).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from rigpilot.engine import paths
from rigpilot.engine.errors import UserError
from rigpilot.engine.settings import config_dir

PINS_FILE = "known-engines.json"
_lock = threading.Lock()  # GUI request threads connect side by side


def pins_path() -> Path:
    return config_dir() / PINS_FILE


def _load() -> dict[str, str]:
    p = pins_path()
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise UserError(f"the list of known engines {p} is unreadable ({e}); fix or remove it") from None
    engines = raw.get("engines") if isinstance(raw, dict) else None
    if not isinstance(engines, dict) or not all(isinstance(v, str) for v in engines.values()):
        raise UserError(f"{p} is not a Rigpilot list of known engines; fix or remove it")
    return dict(engines)


def pinned(address: str) -> str | None:
    """The fingerprint pinned for the engine at `address` (HOST:PORT as the client was given it), if any."""
    return _load().get(address)


def remember(address: str, fingerprint: str) -> None:
    """Pin `fingerprint` for `address`, unless one is pinned already (a pin changes only by hand)."""
    with _lock:
        found = _load()
        if address in found:
            return
        found[address] = fingerprint
        paths.private_dir(pins_path().parent)
        paths.write_private(pins_path(), json.dumps({"version": 1, "engines": found}, indent=2, sort_keys=True) + "\n")


def forget_hint(address: str) -> str:
    return f"remove the line for {address} from {pins_path()} and connect again"
