"""What torchrun starts for each rank: `python -m rigpilot.engine.launch.rankexec JOB_DIR -- COMMAND...`.

It sends the rank's stdout and stderr to `logs/rank<N>.log` (one file, in the
order written), records the rank's pid, process group and start time in
`ranks/rank<N>.json` before COMMAND runs and its exit status after, then exits
with COMMAND's status. The service reads those files to name the rank that
failed first and to find every process of a job, even after it was restarted.

When the engine has a warm worker ready (engine.launch.warm, its socket in
RIGPILOT_WARM_SOCKET), the rank is forked from it, with torch and transformers
already imported, instead of started as a new interpreter; without one, or
when it declines, COMMAND starts as usual.

Kept to the standard library: it runs once per rank, before the real work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.launch import warm


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
    os.replace(tmp, path)


def _record_state(path: Path, data: dict) -> None:
    """The rank's record, whatever the disk: on a full one, written over the one before in place.

    A file's last block has room for the few bytes more an exit adds, so the rewrite needs no new
    block on ext4, XFS or tmpfs; a reader that catches it half-written skips it until the next look.
    """
    try:
        _write_json(path, data)
        return
    except OSError:
        path.with_suffix(".tmp").unlink(missing_ok=True)  # an empty one would only take an inode
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            text = json.dumps(data).encode()
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
        finally:
            os.close(fd)
    except OSError:
        pass  # the exit code still reaches torchrun


def _process_start_time(pid: int) -> float | None:
    """The kernel's start time of `pid` in the same units psutil's create_time() uses."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m rigpilot.engine.launch.rankexec JOB_DIR -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    job_dir, command = Path(argv[0]), argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    log = job_dir / "logs" / f"rank{rank}.log"
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # the job's data is its user's alone
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)

    state_file = job_dir / "ranks" / f"rank{rank}.json"
    state_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    state: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "pgid": os.getpgid(0), "started": time.time()}
    state["create_time"] = _process_start_time(os.getpid())

    # torchrun signals the whole process group of a rank, so COMMAND gets SIGTERM
    # directly; this wrapper only has to outlive it to record how it ended. A
    # Python-level handler (not SIG_IGN) is used because an ignored signal would
    # stay ignored in COMMAND after exec. A rank forked by the warm worker is in
    # a session of its own, so the signal is passed on to it.
    child: subprocess.Popen | warm.WarmChild | None = None

    def pass_on(sig: int, frame: object) -> None:
        if isinstance(child, warm.WarmChild):
            child.signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, pass_on)
    socket_path = os.environ.get(warm.SOCKET_ENV)
    if socket_path:
        child = warm.fork_rank(socket_path, command, dict(os.environ), os.getcwd())
    if child is None:
        try:
            child = subprocess.Popen(command)
        except OSError as e:
            print(f"rigpilot: cannot start rank {rank}: {e}", flush=True)
            _record_state(state_file, {**state, "exit": {"code": 127, "signal": None, "time": time.time()}})
            return 127
    else:
        state["warm"] = True
    state["child_pid"] = child.pid
    _record_state(state_file, state)
    rc = child.wait()
    exit_info = {"code": rc if rc >= 0 else None, "signal": -rc if rc < 0 else None, "time": time.time()}
    _record_state(state_file, {**state, "exit": exit_info})
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
