"""What torchrun starts for each rank of the tests' own jobs (support.worker_jobs): the rank, forked from the
run's warm worker when one is ready, else started as a new interpreter.

    python warm_rank.py PYTHON -u -m rigpilot.engine.workers JOB_DIR

Most of a tiny test job's time is each rank importing torch and transformers; the engine's warm worker
(engine.launch.warm) exists to skip that, and the tests' jobs go through it too (their ranks then run the way
users' ranks do by default). Like rankexec, but the rank's output stays on torchrun's pipes (tests read it) and
nothing is written in the job folder. Standard library and engine.launch.warm only, as rankexec.
"""

from __future__ import annotations

import os
import signal
import sys

from rigpilot.engine.launch import warm


def main(command: list[str]) -> int:
    socket_path = os.environ.get(warm.SOCKET_ENV)
    child = warm.fork_rank(socket_path, command, dict(os.environ), os.getcwd()) if socket_path else None
    if child is None:
        os.execv(command[0], command)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.signal(s))
    rc = child.wait()
    if rc < 0:  # killed by a signal: end the same way, so torchrun reports what it would for a plain rank
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
