"""A serve job's worker run as one process by a test, until it reports that it listens (its "serving" status)."""

from __future__ import annotations

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
from support.worker_jobs import job_env, records

START_TIMEOUT_S = 180  # importing torch and loading the model, on a machine the other test process keeps busy


@contextmanager
def serve_worker(job: Path) -> Iterator[tuple[subprocess.Popen, dict[str, Any]]]:
    """(the worker's process, its serving status record); the worker is killed on the way out."""
    log = (job / "worker.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rigpilot.engine.workers", str(job)], cwd=REPO, env=job_env(job),
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        yield proc, _wait_for_serving(job, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
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
