"""The calling user's Rigpilot folders: what they hold, and deleting them without following links.

`rigpilot forget` and `rigpilot engine-env remove` delete through `delete()`. A link inside Rigpilot's
folders is unlinked, never followed: a link to the user's own dataset or model folder leaves that folder
alone. The folders' parents are taken as they are: with `~/.cache` a link to another disk, what goes is
`~/.cache/rigpilot` on that disk, not the link and not its neighbours. A Rigpilot folder that is itself a
link is unlinked too, and what it points to stays.

Nothing here runs as anyone but the user whose data it is: Debian's maintainer scripts never call it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from rigpilot.engine.settings import APP, cache_dir, config_dir, data_dir, state_dir


@dataclass(frozen=True)
class Item:
    """One thing `forget` deletes."""

    path: Path
    what: str  # in the user's words
    size: int  # bytes on disk it gives back (hard links counted once)
    link_to: str | None = None  # set when `path` is itself a link: the link goes, its target stays


def runtime_dir() -> Path:
    from rigpilot.engine.paths import runtime_dir as service_runtime_dir

    return service_runtime_dir(create=False)


def systemd_files() -> list[Path]:
    """The engine's systemd user unit (`rigpilot engine --install-systemd`) and the links enabling it."""
    from rigpilot.engine.launch.systemd import UNIT_NAME, unit_dir

    units = unit_dir()
    found = [units / UNIT_NAME]
    with contextlib.suppress(OSError):
        found += [d / UNIT_NAME for d in units.iterdir() if d.name.endswith(".wants") and d.is_dir()]
    return [p for p in found if os.path.lexists(p)]


def folders() -> list[tuple[Path, str]]:
    """Every place Rigpilot keeps something for this user, with what it holds."""
    return [
        (config_dir(), "settings and the engine's access token"),
        (state_dir(), "jobs, their logs, checkpoints and outputs; the engine's database and log"),
        (data_dir(), "the engine environment (PyTorch) and anything saved there"),
        (cache_dir(), "downloads and the engine environment's package cache"),
        (runtime_dir(), "the running engine's socket and lock"),
    ]


def plan() -> list[Item]:
    """What `forget` would delete, as it is now (missing folders left out)."""
    seen: set[tuple[int, int]] = set()
    items = [_item(p, what, seen) for p, what in folders() if os.path.lexists(p)]
    items += [_item(p, "starts the engine service at login (systemd user unit)", seen) for p in systemd_files()]
    return items


def _item(path: Path, what: str, seen: set[tuple[int, int]]) -> Item:
    link = os.readlink(path) if path.is_symlink() else None
    return Item(path, what, disk_usage(path, seen), link)


def disk_usage(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes on disk under `path`, links not followed and each inode counted once (uv hard-links its cache)."""
    seen = set() if seen is None else seen
    total = 0
    stack = [str(path)]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            continue
        seen.add(key)
        total += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(OSError), os.scandir(p) as entries:
                stack.extend(e.path for e in entries)
    return total


def delete(path: Path) -> None:
    """Remove `path` and everything under it; links (the path itself included) are unlinked, not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    # rmtree walks by file descriptor and unlinks the links it meets, so no link leads it out of `path`.
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_writable_and_retry)
    else:
        shutil.rmtree(path, onerror=lambda f, p, _exc: _writable_and_retry(f, p, None))


def _writable_and_retry(func: Callable[..., object], path: str, _exc: BaseException | None) -> None:
    # A read-only folder (some packages ship them) cannot have its entries removed until it is writable again.
    for d in (path, os.path.dirname(path)):
        with contextlib.suppress(OSError):
            st = os.lstat(d)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                os.chmod(d, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
    func(path)


def reload_systemd() -> None:
    """Tell the user's systemd its unit is gone (best effort: over ssh there may be no user manager)."""
    import subprocess

    if shutil.which("systemctl"):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["systemctl", "--user", "daemon-reload"], capture_output=True, timeout=15, check=False)


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def total_size(items: Iterable[Item]) -> int:
    return sum(i.size for i in items)


# -- what must stop first ------------------------------------------------------------------------------------


def blockers() -> list[str]:
    """What must end before this user's Rigpilot data can go: running jobs and an open app, in words.

    Only processes of this user that work in these very folders count (their job folder, or the app's state
    folder is this one), so another Rigpilot of the same user under other XDG folders is left alone.
    """
    import psutil

    mine = os.path.realpath(state_dir())
    jobs: dict[str, list[int]] = {}
    apps: list[int] = []
    for p in psutil.process_iter(["pid", "uids"]):
        uids = p.info["uids"]
        if p.pid == os.getpid() or uids is None or uids.real != os.getuid():
            continue
        try:
            env = p.environ()
            cmd = p.cmdline()
        except psutil.Error:
            continue
        job_dir = env.get("RIGPILOT_JOB_DIR")
        if job_dir and _inside(job_dir, mine):
            jobs.setdefault(env.get("RIGPILOT_JOB_ID") or "?", []).append(p.pid)
        elif _is_app(cmd) and os.path.realpath(_state_dir_of(env)) == mine:
            apps.append(p.pid)
    found = [
        f"job {job} is running (pid {', '.join(map(str, sorted(pids)))}): cancel it first with 'rigpilot cancel {job}'"
        for job, pids in sorted(jobs.items())
    ]
    if apps:
        found.append(f"the Rigpilot app is open (pid {', '.join(map(str, sorted(apps)))}): close it first")
    return found


def _inside(path: str, folder: str) -> bool:
    real = os.path.realpath(path)
    return real == folder or real.startswith(folder.rstrip("/") + "/")


def _is_app(cmd: list[str]) -> bool:
    """Whether a command line is the desktop app (`rigpilot` without a subcommand)."""
    args = cmd[1:]
    if len(args) == 1 and os.path.basename(args[0]) == APP:
        return True
    # Interpreter options may come first: the .deb runs `python -I -m rigpilot.app.launcher`.
    module = args[args.index("-m") + 1 :] if "-m" in args else []
    return module in (["rigpilot.app.launcher"], ["rigpilot.app.main"])


def _state_dir_of(env: dict[str, str]) -> str:
    base = env.get("XDG_STATE_HOME", "").strip()
    if not os.path.isabs(base):
        base = os.path.join(env.get("HOME", "/"), ".local", "state")
    return os.path.join(base, APP)


def engine_pid() -> int | None:
    """The running engine service's pid, from the lock it holds (0 when it holds it but wrote no pid)."""
    import fcntl

    try:
        fd = os.open(runtime_dir() / "engine.lock", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 64).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def stop_engine(timeout: float = 20.0) -> int | None:
    """Stop this user's engine service the way `rigpilot engine --stop` does, and wait until it has ended.

    Returns the pid it stopped (None when none ran). Jobs keep running, as with --stop: `blockers()` first.
    """
    import signal
    import time

    from rigpilot.engine.api.client import EngineClient, EngineUnavailable
    from rigpilot.engine.errors import UserError

    pid = engine_pid()
    if pid is None:
        return None
    try:
        with EngineClient(autostart=False, client_name="forget", timeout=10) as client:
            client.request("shutdown")
    except EngineUnavailable:
        # It holds the lock but does not answer: SIGTERM is its other way to stop cleanly.
        if pid > 0:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while engine_pid() is not None:
        if time.monotonic() > deadline:
            raise UserError(f"the engine service (pid {pid or '?'}) did not stop; end it and run this again")
        time.sleep(0.1)
    return pid
