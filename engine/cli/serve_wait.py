"""The wait for a serve job's URL, and why a queued job waits: torch-free and free of the CLI's commands, so that
the app runs them too (through engine.cli.comparison)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.schema import TERMINAL_STATES
from rigpilot.engine.workers.serve_setup import serving_status

WAIT_FOR_URL_S = 600.0  # loading a large model from a slow disk; the job's own failure ends the wait sooner


def waiting(job: dict[str, Any]) -> str:
    """Why a queued job waits, as " (…)", or ""."""
    if job.get("slurm"):
        from rigpilot.engine.jobs.slurm_state import describe

        return f" ({describe(job['slurm'])})"
    busy = job.get("waiting_for")
    return f" (waiting for GPU {gpu_list(busy)} to be free)" if busy else ""


def gpu_list(gpus: list[int]) -> str:
    """GPU indices as the command line writes them: 0,1 (or - for none)."""
    return ",".join(str(g) for g in gpus) or "-"


def wait_for_url(
    client: Any, job_id: str, on_queued: Callable[[str], None] | None = None
) -> dict[str, Any] | None:
    """The status record the job reports once it listens (its url, model, adapters, api_key_file,
    tls_fingerprint); None when it ended first. `on_queued` hears "queued (why)" each time the reason a queued
    job waits changes: a queued server may wait long for its GPUs, and the wait for its URL starts once it runs."""
    deadline = time.monotonic() + WAIT_FOR_URL_S
    client.request("subscribe", topics=[f"metrics:{job_id}"], metrics_cursors={job_id: {}})
    said = ""
    while time.monotonic() < deadline:
        ev = client.next_event(1.0)
        if ev is not None and ev.get("event") == "metrics":
            found = serving_status(ev.get("records") or [])
            if found is not None:
                return dict(found)
        if ev is None:
            job = client.request("job", job=job_id)["job"]
            if job["state"] in TERMINAL_STATES:
                return None
            if job["state"] == "queued":
                deadline = time.monotonic() + WAIT_FOR_URL_S
                note = f"queued{waiting(job)}"
                if note != said and on_queued is not None:
                    on_queued(note)
                said = note
    raise UserError(f"job {job_id} reported no URL in {WAIT_FOR_URL_S:.0f} s; see rigpilot logs {job_id}")
