"""A served tiny model for tests: a real serve worker (python -m rigpilot.engine.workers) on a loopback socket,
started from a job folder as the engine would, and the URL it reports through its metrics."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from support.paths import REPO
from support.worker_jobs import job_env, records, write_job

START_TIMEOUT_S = 180


@contextmanager
def serve_worker(job_dir: Path, model_dir: Path, **serve: Any) -> Iterator[dict[str, Any]]:
    """Serve `model_dir` (on CPU rank 0) with the ServeSettings `serve`; yields {"url", "proc", "job"}."""
    job = write_job(job_dir, kind="serve", model=str(model_dir), gpus=[0], serve=serve)
    log = (job / "worker.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rigpilot.engine.workers", str(job)], cwd=REPO, env=job_env(job), stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield {"url": wait_for_url(job, proc), "proc": proc, "job": job}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def wait_for_url(job: Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited {proc.returncode}:\n{(job / 'worker.log').read_text()[-4000:]}")
        if (job / "metrics" / "rank0.jsonl").exists():
            for r in records(job):
                if r.get("phase") == "serving":
                    return str(r["url"])
        time.sleep(0.2)
    pytest.fail("the server reported no URL")
