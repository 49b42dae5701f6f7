"""The warm worker: a process with torch and transformers imported, that forks a job's ranks.

Most of the time between submitting a job and its first step is every rank
importing torch and transformers (seconds, on each rank at once). While the
engine is idle and memory allows, the supervisor starts one warm worker per
user (`python -m rigpilot.engine.launch.warm_worker SOCKET`): it imports what the
ranks import, then listens on a private Unix socket. torchrun stays the
launcher; rankexec, which torchrun starts for each rank, asks the warm worker
to fork the rank instead of starting a new interpreter, and falls back to
starting one when no warm worker answers or it declines.

What makes forking safe here:
- The warm worker never runs a torch op, so no OpenMP/intra-op thread pool and
  no CUDA context exist to be inherited; CUDA_VISIBLE_DEVICES is empty in it.
  The child sets its thread count from the job's OMP_NUM_THREADS, as a fresh
  interpreter would have read it.
- The child gets exactly the job's environment, working folder, session and
  stdio (the rank log's descriptors, passed over the socket), and the job's
  environment is also written over the child's /proc environ block, so the
  service finds it by its run token like any other process of the job.
- Variables read while torch and transformers are imported (HF_*, TORCH_*,
  PYTHON*, ...) must be the same in the job as in the warm worker, or it
  declines: the imported modules would otherwise hold the wrong values.

Who may use it: the socket is 0600 in the user's private runtime folder, and
every connection's peer is checked with SO_PEERCRED (same uid, or refused).
Messages are JSON lines; nothing received is unpickled or evaluated.

Exit status: the warm worker waits for the child and sends its status; the
child also sends its own exit code before it exits, so when the warm worker
was killed meanwhile the rank still ends with its code (the job is not lost).
When rankexec goes away (torchrun killed the rank's group) the warm worker
kills the child's group, as if it had been in that group.

The warm worker itself (the part that imports torch) is engine.launch.warm_worker;
this module is the protocol, the rank's side and the engine's side, kept to
the standard library: rankexec imports it in every rank, the service too.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigpilot.engine import priority

SOCKET_ENV = "RIGPILOT_WARM_SOCKET"  # set in a job's environment when a warm worker is ready
# In the engine's environment: the socket of a warm worker it did not start, used while its own is not ready
# (the test suite keeps one for all its engines, which would otherwise each import torch for a job or two).
SHARED_ENV = "RIGPILOT_WARM_SHARED"
ENABLE_ENV = "RIGPILOT_WARM_WORKER"  # "0" in the engine's environment turns warm workers off
SOCKET_NAME = "warm.sock"
# "Memory allows": the warm worker holds about 0.5-1 GiB (torch and transformers imported); it is started
# only when this much is available, and stopped when availability falls below half of it.
MIN_AVAILABLE_BYTES = 4 << 30
# Room reserved in the warm worker's environ block, so a child can write the job's environment over it.
ENV_ROOM_VAR = "RIGPILOT_WARM_ENV_ROOM"
ENV_ROOM_BYTES = 96 * 1024
# Variables read while torch, transformers and huggingface_hub are imported: a job may use the warm
# worker only when it agrees with the warm worker on all of them.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "PYTORCH_",
    "LD_", "MKL_", "KMP_", "GOMP_",
    "XDG_CACHE_HOME", "HOME", "TOKENIZERS_", "USE_TORCH", "USE_TF", "USE_JAX", "DISABLE_",
)  # fmt: skip
# Set by the engine for every rank, or used only after start-up: they may differ.
IMPORT_TIME_EXEMPT = frozenset({"PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM"})
# Set by torchrun for each rank and read when the process group is made, in the child.
RUN_TIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")
WORKER_MODULE = "rigpilot.engine.workers"
# Hugging Face model families imported ahead, beyond torch and transformers: the ones the examples and
# most jobs use. A family the warm worker did not import is imported by the child, as a fresh rank would.
PREIMPORT = (
    "rigpilot.engine.workers.train", "rigpilot.engine.workers.infer", "rigpilot.engine.workers.calibrate",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral",
)  # fmt: skip
_MAX_LINE = 1 << 20


def enabled(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    value = (env if env is not None else os.environ).get(ENABLE_ENV, "1")
    return value.strip().lower() not in ("0", "no", "false", "off")


def import_time_mismatch(job_env: dict[str, str], warm_env: dict[str, str]) -> str | None:
    """The first variable read at import time on which the job and the warm worker differ, or None."""
    keys = {
        k for k in (*job_env, *warm_env)
        if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(RUN_TIME_PREFIXES) and k not in IMPORT_TIME_EXEMPT
    }  # fmt: skip
    keys.discard(ENV_ROOM_VAR)
    for k in sorted(keys):
        if job_env.get(k) != warm_env.get(k):
            return k
    return None


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


class _Lines:
    """JSON-line reader over a socket; refuses lines over _MAX_LINE bytes."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.buf = b""

    def read(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message, or None at end of stream (or on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.conn], [], [], left)[0]:
                    return None
            try:
                chunk = self.conn.recv(65536)
            except InterruptedError:
                continue
            except OSError:
                return None
            if not chunk:
                return None
            self.buf += chunk
            if len(self.buf) > _MAX_LINE:
                raise ValueError("message too long")
        line, self.buf = self.buf.split(b"\n", 1)
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("not a JSON object")
        return message


# -- the rank's side (rankexec) ------------------------------------------------------------------------------


@dataclass
class WarmChild:
    """A rank forked by the warm worker: its pid, and the connection its exit status arrives on."""

    pid: int
    conn: socket.socket
    lines: _Lines

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)  # the child leads its own session; dataloader workers share its group

    def wait(self) -> int:
        """The child's return code as subprocess reports it (negative: killed by that signal)."""
        own_code: int | None = None
        while True:
            try:
                message = self.lines.read()
            except ValueError:
                message = None
            if message is None:
                break
            if isinstance(message.get("exit"), int):
                return message["exit"]
            if isinstance(message.get("child_exit"), int):
                own_code = message["child_exit"]
        # The warm worker is gone and the child, which held the other end too, has exited (or closed it).
        _wait_gone(self.pid)
        if own_code is not None:
            return own_code
        print(f"rigpilot: the warm worker went away and rank process {self.pid} ended without a status", flush=True)
        return -signal.SIGKILL


def _wait_gone(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        while Path(f"/proc/{pid}").exists():
            time.sleep(0.1)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def fork_rank(socket_path: str, command: list[str], env: dict[str, str], cwd: str) -> WarmChild | None:
    """Ask the warm worker at `socket_path` to fork `command` as this rank; None when it cannot (then exec).

    Prints one line to the rank's log when a warm worker was there but declined.
    """
    if not command or not os.path.isabs(command[0]) or _target(command[1:]) is None:
        return None  # user scripts expect a fresh interpreter of their own
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(5.0)
        conn.connect(socket_path)
        conn.settimeout(None)
        # The rank's stdin, stdout and stderr (the rank log) travel with one byte; the request follows.
        socket.send_fds(conn, [b"F"], [0, 1, 2])
        _send(conn, {"python": command[0], "args": command[1:], "env": env, "cwd": cwd})
        lines = _Lines(conn)
        reply = lines.read(timeout=30.0)
    except (OSError, ValueError):
        conn.close()
        return None  # no warm worker (absent, killed, or busy dying): the plain path
    if not reply or not isinstance(reply.get("pid"), int):
        conn.close()
        reason = (reply or {}).get("declined") or "no answer"
        print(f"rigpilot: started without the warm worker ({reason})", flush=True)
        return None
    return WarmChild(reply["pid"], conn, lines)


# -- the engine's side (supervisor) --------------------------------------------------------------------------


class WarmWorker:
    """The supervisor's handle on its warm worker: started when idle and memory allows, stopped on demand."""

    def __init__(self, runtime_dir: Path, log_path: Path):
        self.socket_path = runtime_dir / SOCKET_NAME
        self.log_path = log_path
        self.popen: Any = None  # subprocess.Popen
        self.python: str | None = None

    def ready(self) -> bool:
        """Running, imports done, socket in place: ranks may be handed to it now."""
        return self.running() and self.socket_path.exists()

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self, python: str, env: dict[str, str], niceness: int = priority.NICENESS) -> None:
        import subprocess

        self.stop()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        env = {**env, "CUDA_VISIBLE_DEVICES": "", ENV_ROOM_VAR: "x" * ENV_ROOM_BYTES}
        with open(self.log_path, "ab") as log:
            os.chmod(self.log_path, 0o600)
            self.popen = subprocess.Popen(
                # The ranks it forks are jobs' ranks: they give way to the desktop as a launched job's do.
                priority.yielding([python, "-m", "rigpilot.engine.launch.warm_worker", str(self.socket_path)], niceness),
                cwd=str(self.socket_path.parent), env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.python = python

    def stop(self) -> None:
        """Stop the warm worker; ranks it forked run on (they are in sessions of their own)."""
        if self.popen is not None:
            if self.popen.poll() is None:
                self.popen.terminate()
                try:
                    self.popen.wait(5)
                except Exception:
                    self.popen.kill()
                    self.popen.wait()
            self.popen = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()


def memory_allows(available: int | None = None) -> bool:
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return available >= MIN_AVAILABLE_BYTES


# -- what the warm worker (engine.launch.warm_worker) checks -------------------------------------------------------


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _target(args: list[str]) -> list[str] | None:
    """The worker's arguments when `args` (after the interpreter) start a Rigpilot rank, else None."""
    rest = [a for a in args if a != "-u"]  # -u: the child's stdio is unbuffered anyway
    if len(rest) == 3 and rest[:2] == ["-m", WORKER_MODULE]:
        return rest[2:]
    return None


def _decline(request: dict[str, Any], own_env: dict[str, str]) -> str | None:
    python = request.get("python")
    if not isinstance(python, str) or os.path.abspath(python) != os.path.abspath(sys.executable):
        return "another Python interpreter"
    if not isinstance(request.get("args"), list) or not all(isinstance(a, str) for a in request["args"]):
        return "bad request"
    if _target(request["args"]) is None:
        return "not a Rigpilot worker rank"  # user scripts expect a fresh interpreter of their own
    env, cwd = request.get("env"), request.get("cwd")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return "bad request"
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        return "bad request"
    if len(_environ_block(env)) > _environ_room():
        return "environment too large"
    differs = import_time_mismatch(env, own_env)
    if differs:
        return f"{differs} differs from the warm worker's"
    return None


def _environ_block(env: dict[str, str]) -> bytes:
    return b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items()) + b"\0"


def _environ_span() -> tuple[int, int]:
    """Start and end addresses of this process's environ block (fields 50 and 51 of /proc/self/stat)."""
    stat = Path("/proc/self/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[47]), int(fields[48])


def _environ_room() -> int:
    start, end = _environ_span()
    return end - start
