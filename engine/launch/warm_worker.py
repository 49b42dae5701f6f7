"""`python -m rigpilot.engine.launch.warm_worker SOCKET`: the warm worker itself (see engine.launch.warm).

Imports torch, transformers and the worker modules, then forks a rank for
each request from this user's rankexec; the protocol, the checks and the
engine's handle on this process live in engine.launch.warm.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.launch.warm import (
    PREIMPORT,
    WORKER_MODULE,
    _decline,
    _environ_block,
    _environ_span,
    _Lines,
    _peer_uid,
    _send,
    _target,
)

_cpu_only = False  # set when an import initialised CUDA (see serve)


def _cuda_touched() -> bool:
    """Whether the CUDA driver library was loaded into this process (it is only on a first CUDA call)."""
    try:
        return "libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return True


def _rewrite_environ(env: dict[str, str]) -> None:
    """Write `env` over the environ block the kernel shows as /proc/PID/environ.

    A forked child keeps its parent's block; the service finds a job's processes (and kills leftovers)
    by the run token in it, so the child must show the job's environment there, as an exec'd rank does.
    Nothing points into the old block any more: os.environ was cleared (unsetenv) and refilled (setenv
    copies) before this runs. Like setproctitle does for argv.
    """
    block = _environ_block(env)
    start, end = _environ_span()
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(block + b"\0" * (end - start - len(block)))


def _run_child(conn: socket.socket, fds: list[int], request: dict[str, Any], closing: list[Any]) -> None:
    """In the forked child: become the rank and run it; never returns."""
    code = 70  # EX_SOFTWARE: the child could not become the rank
    try:
        for c in closing:
            with contextlib.suppress(OSError):
                c.close()
        os.setsid()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import io

        # As `python -u` would: the binary layers unbuffered, text written through.
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        env, argv = request["env"], _target(request["args"])
        assert argv is not None
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        _rewrite_environ(env)
        sys.argv = [WORKER_MODULE, *argv]
        sys.path[0] = request["cwd"]  # `python -m` puts the working folder first
        import random

        import torch

        random.seed()  # a fresh interpreter seeds from the OS; the warm worker's state is shared by every child
        cpus = len(os.sched_getaffinity(0))
        try:
            threads = int(env.get("OMP_NUM_THREADS", "")) or cpus
        except ValueError:
            threads = cpus
        torch.set_num_threads(max(threads, 1))
        from rigpilot.engine.workers import __main__ as worker

        code = worker.main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        if not worker._skip_interpreter_teardown:
            import atexit

            atexit._run_exitfuncs()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            _send(conn, {"child_exit": code})
        os._exit(code)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _die_with_parent() -> None:
    """SIGTERM this process when the engine that started it dies (children are not affected)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve(socket_path: Path) -> int:
    parent = os.getppid()
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    started = time.perf_counter()
    own_env = dict(os.environ)
    import importlib

    import torch  # noqa: F401
    import transformers  # noqa: F401

    for name in PREIMPORT:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    if os.getppid() != parent:
        return 0
    # Some imports set variables (a fresh rank would have them too, set by the same imports).
    added = {k: v for k, v in os.environ.items() if k not in own_env}
    # An import that asked CUDA anything (torch.cuda.is_available() in some library) loaded the driver with no
    # GPU visible, and a forked child cannot start CUDA over again: such a warm worker serves CPU ranks only.
    global _cpu_only
    if _cuda_touched():
        _cpu_only = True
        print("warm worker: an import initialised CUDA; only CPU ranks will be forked", flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = socket_path.with_name(f".{socket_path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    old = os.umask(0o177)
    try:
        listener.bind(str(tmp))
    finally:
        os.umask(old)
    os.chmod(tmp, 0o600)
    listener.listen(16)
    os.replace(tmp, socket_path)  # appears only once the imports are done: its presence means "ready"
    inode = os.stat(socket_path).st_ino
    print(f"warm worker ready in {time.perf_counter() - started:.1f} s on {socket_path}", flush=True)
    children: dict[int, socket.socket] = {}  # pidfd -> connection
    pids: dict[int, int] = {}  # pidfd -> pid
    by_conn: dict[socket.socket, int] = {}  # connection -> pidfd
    try:
        installed = _installed_stamp()
        while True:
            if os.getppid() != parent or not _still_ours(socket_path, inode):
                return 0
            if _installed_stamp() != installed:
                print("warm worker: the engine environment changed; leaving for a fresh one", flush=True)
                return 0
            waiting: list[socket.socket | int] = [listener, *children, *by_conn]
            ready = select.select(waiting, [], [], 1.0)[0]
            for r in ready:
                if r is listener:
                    _accept(listener, own_env, added, children, pids, by_conn)
                elif isinstance(r, int):  # a child exited
                    conn = children.pop(r)
                    pid = pids.pop(r)
                    by_conn.pop(conn, None)
                    os.close(r)
                    try:
                        _, status = os.waitpid(pid, 0)
                        with contextlib.suppress(OSError):
                            _send(conn, {"exit": _exit_code(status)})
                    except ChildProcessError:
                        pass
                    conn.close()
                else:  # the rank's launcher closed its end: torchrun killed it; the child goes too
                    fd = by_conn.pop(r)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pids[fd], signal.SIGKILL)
    finally:
        if _still_ours(socket_path, inode):  # a newer warm worker's socket stays
            with contextlib.suppress(OSError):
                socket_path.unlink()


def _installed_stamp() -> tuple[float, ...]:
    """Changes when packages are installed, upgraded or removed where torch and transformers live."""
    import torch
    import transformers

    stamps = []
    for module in (torch, transformers):
        site = Path(module.__file__ or "").resolve().parents[1]
        with contextlib.suppress(OSError):
            stamps.append(site.stat().st_mtime)
    return tuple(stamps)


def _still_ours(socket_path: Path, inode: int) -> bool:
    """Whether the socket file is still this process's (removed or replaced: time to go)."""
    try:
        return os.stat(socket_path).st_ino == inode
    except OSError:
        return False


def _accept(
    listener: socket.socket, own_env: dict[str, str], added: dict[str, str], children: dict, pids: dict, by_conn: dict
) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:
        return
    fds: list[int] = []
    try:
        conn.settimeout(10.0)
        if _peer_uid(conn) != os.getuid():
            _send(conn, {"declined": "another user"})
            conn.close()
            return
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        request = _Lines(conn).read(timeout=10.0)
        if request is None or len(fds) != 3:
            raise ValueError("incomplete request")
        reason = _decline(request, own_env)
        if not reason and _cpu_only and request["env"].get("CUDA_VISIBLE_DEVICES", "") != "":
            reason = "CUDA was initialised in the warm worker"
        request["env"] = {**added, **request["env"]}
        if reason:
            _send(conn, {"declined": reason})
            raise ValueError(reason)
        conn.settimeout(None)
        closing = [listener, *by_conn, *(conn2 for conn2 in children.values() if conn2 not in by_conn)]
        pid = os.fork()
        if pid == 0:
            for fd in children:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _run_child(conn, fds, request, closing)
        pidfd = os.pidfd_open(pid)
        children[pidfd] = conn
        pids[pidfd] = pid
        by_conn[conn] = pidfd
        _send(conn, {"pid": pid})
    except (OSError, ValueError):
        conn.close()
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rigpilot.engine.launch.warm_worker SOCKET", file=sys.stderr)
        return 2
    return serve(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
