"""A serve job's worker run as one process by a test, until it reports that it listens (its "serving" status)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from rigpilot.engine.workers.serve_setup import serving_status

from support.paths import REPO
from support.worker_jobs import job_env, records, torchrun, warm_socket

START_TIMEOUT_S = 180  # importing torch and loading the model, on a machine the other test process keeps busy


@contextmanager
def serve_worker(job: Path, ranks: int = 1) -> Iterator[tuple[subprocess.Popen, dict[str, Any]]]:
    """(the worker's process, its serving status record); the worker is killed on the way out.

    `ranks` > 1: torchrun over that many ranks (tensor parallel), in a session of its own as the engine starts
    it, so that a signal to its process group reaches every rank as the engine's cancel does."""
    log = (job / "worker.log").open("w")
    env = job_env(job)
    cmd = [sys.executable, "-m", "rigpilot.engine.workers", str(job)]
    if ranks > 1:
        socket_path = warm_socket()
        cmd = torchrun(job, ranks, warm=socket_path is not None)
        env.update({"RIGPILOT_WARM_SOCKET": socket_path} if socket_path else {})
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, _wait_for_serving(job, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _wait_for_serving(job: Path, proc: subprocess.Popen) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited {proc.returncode}:\n{(job / 'worker.log').read_text()[-4000:]}")
        found = serving_status(records(job)) if (job / "metrics" / "rank0.jsonl").exists() else None
        if found is not None:
            return found
        time.sleep(0.2)
    pytest.fail("the server reported no URL")
