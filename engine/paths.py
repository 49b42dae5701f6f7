"""Where the service keeps its socket, lock, token, database and job folders.

Runtime files (socket, lock) live in the user's runtime dir, which the OS
keeps private and wipes at logout; without XDG_RUNTIME_DIR they go in a 0700
folder under /tmp that this user must own, so no one else can plant a socket
there. State (database, job folders, telemetry) lives in the XDG state dir.

Everything the engine keeps is its user's alone: `make_private()` (called once
when the service starts) sets the umask to 077 for the service and every rank
it launches, and brings the state, config, data and cache folders to 0700 and
the files under the state folder to 0600, so files left by an older version or
written under a looser umask are tightened too.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

import platformdirs

from rigpilot.engine.errors import UserError
from rigpilot.engine.settings import APP, cache_dir, config_dir, data_dir, state_dir

PRIVATE_UMASK = 0o077

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
    _private_dir(d)
    return d


def private_dirs() -> list[Path]:
    """The folders Rigpilot keeps per user; each is made 0700 when it exists (state and config always do)."""
    return [
        state_dir(),
        config_dir(),
        data_dir(),
        cache_dir(),
    ]


def make_private() -> None:
    """umask 077 for this process and its children; the engine's folders 0700 and its state files 0600."""
    os.umask(PRIVATE_UMASK)
    state, config, data, cache = private_dirs()
    _private_dir(state)
    _private_dir(config)
    for d in (data, cache):
        if d.is_dir():
            with contextlib.suppress(OSError):
                os.chmod(d, 0o700)
    # Everything written since the first private start is 0600 already: walk the old files once, not every start.
    marker = state / ".private"
    if not marker.exists():
        tighten_tree(state)
        write_private(marker, "state files tightened to 0600/0700\n")


def tighten_tree(root: Path) -> None:
    """Drop group and other permissions from everything under `root` (symlinks are left alone)."""
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(top, name)
            with contextlib.suppress(OSError):
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
                    continue
                if stat.S_IMODE(st.st_mode) & 0o077:
                    os.chmod(p, stat.S_IMODE(st.st_mode) & 0o700)


def open_private(path: Path, mode: str = "ab"):
    """Open for writing, creating the file 0600 whatever the umask (an existing file is tightened too)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    with contextlib.suppress(OSError):
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically as a 0600 file."""
    tmp = path.with_name(path.name + ".tmp")
    with open_private(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def database_path() -> Path:
    return engine_state_dir() / "engine.db"


def telemetry_path() -> Path:
    return engine_state_dir() / "telemetry.db"


def calibration_path() -> Path:
    """The latest calibration of this machine (a finished calibrate job's output), which the planner applies."""
    return engine_state_dir() / "calibration.json"


def doctor_dir() -> Path:
    """The machine checks' reports, one per machine and driver (engine.jobs.doctor_store)."""
    d = engine_state_dir() / "doctor"
    _private_dir(d)
    return d


def jobs_dir() -> Path:
    d = engine_state_dir() / "jobs"
    _private_dir(d)
    return d


def service_log_path() -> Path:
    return engine_state_dir() / "engine.log"


def token_path() -> Path:
    """The shared secret remote (TCP) clients must present; readable by this user only."""
    return config_dir() / "engine-token"


def read_or_create_token() -> str:
    import secrets

    p = token_path()
    _private_dir(p.parent)
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


def private_dir(d: Path) -> None:
    """Make `d` (and its parents) if need be; refuse it unless it is this user's own folder; bring it to 0700."""
    _private_dir(d)
