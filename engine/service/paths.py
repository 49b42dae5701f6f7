"""Where the service keeps its socket, lock, token, database and job folders.

Runtime files (socket, lock) live in the user's runtime dir, which the OS
keeps private and wipes at logout; without XDG_RUNTIME_DIR they go in a 0700
folder under /tmp that this user must own, so no one else can plant a socket
there. State (database, job folders, telemetry) lives in the XDG state dir.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import platformdirs

from engine.errors import UserError
from engine.settings import APP, config_dir, state_dir

SOCKET_NAME = "engine.sock"
LOCK_NAME = "engine.lock"
# sun_path holds 108 bytes on Linux, including the terminating NUL.
_MAX_SOCKET_PATH = 107


def runtime_dir(create: bool = True) -> Path:
    if os.environ.get("XDG_RUNTIME_DIR"):
        d = Path(platformdirs.user_runtime_dir(APP))
    else:
        d = Path(tempfile.gettempdir()) / f"{APP}-{os.getuid()}"
    if create:
        _private_dir(d)
    return d


def _private_dir(d: Path) -> None:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise UserError(f"{d} is not a folder owned by you; remove it so Rigpilot can create its own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(d, 0o700)


def socket_path() -> Path:
    p = runtime_dir() / SOCKET_NAME
    if len(os.fsencode(p)) > _MAX_SOCKET_PATH:
        raise UserError(f"socket path too long for a Unix socket ({p}); set XDG_RUNTIME_DIR to a shorter folder")
    return p


def lock_path() -> Path:
    return runtime_dir() / LOCK_NAME


def engine_state_dir() -> Path:
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


def database_path() -> Path:
    return engine_state_dir() / "engine.db"


def telemetry_path() -> Path:
    return engine_state_dir() / "telemetry.db"


def jobs_dir() -> Path:
    d = engine_state_dir() / "jobs"
    d.mkdir(parents=True, exist_ok=True)
    return d


def service_log_path() -> Path:
    return engine_state_dir() / "engine.log"


def token_path() -> Path:
    """The shared secret remote (TCP) clients must present; readable by this user only."""
    return config_dir() / "engine-token"


def read_or_create_token() -> str:
    import secrets

    p = token_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        token = p.read_text().strip()
        if token:
            if stat.S_IMODE(p.stat().st_mode) & 0o077:
                os.chmod(p, 0o600)
            return token
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
