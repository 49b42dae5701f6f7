"""The finished training jobs a client serves or compares, and the wait for a serve job's URL: torch-free, and
free of the CLI's commands, so that the app runs them too (through engine.cli.comparison)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.schema import TERMINAL_STATES
from rigpilot.engine.workers.serve_setup import serving_status

WAIT_FOR_URL_S = 600.0  # loading a large model from a slow disk; the job's own failure ends the wait sooner
LORA_BASE_NAME = "base"  # what the base of a served LoRA job is called in requests


def job_by_ref(client: Any, ref: str) -> dict[str, Any] | None:
    from rigpilot.engine.api import protocol
    from rigpilot.engine.api.client import EngineError

    try:
        return dict(client.request("job", job=ref)["job"])
    except EngineError as e:
        if e.code == protocol.NOT_FOUND:
            return None
        raise


def finished_output(job: dict[str, Any]) -> Path:
    if job.get("kind") != "train":
        raise UserError(f"job {job['id']} is a {job.get('kind')} job: only a training job has a model to serve",
                        reason="serve_job_not_trained", job=job["id"], kind=job.get("kind"))  # fmt: skip
    out = Path(job.get("job_dir") or "") / "output"
    if job.get("state") != "completed" or not out.is_dir():
        raise UserError(f"job {job['id']} has not finished training ({job.get('state')}): serve it once it has",
                        reason="serve_job_not_finished", job=job["id"], state=job.get("state"))  # fmt: skip
    return out


def lora_base(job: dict[str, Any], out: Path) -> str:
    """The model a LoRA job trained on: its job.json's (as the engine resolved it), else the adapter's own note."""
    for file, key in ((Path(job.get("job_dir") or "") / "job.json", "model"),
                      (out / "adapter_config.json", "base_model_name_or_path")):  # fmt: skip
        try:
            model = json.loads(file.read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(model, str) and model:
            return model
    raise UserError(f"job {job['id']}: its base model is named neither in its job.json nor in its adapter",
                    reason="serve_adapter_invalid", job=job["id"])  # fmt: skip


def wait_for_url(client: Any, job_id: str) -> dict[str, Any] | None:
    """The status record the job reports once it listens (its url, model, adapters, api_key_file); None when it
    ended first."""
    deadline = time.monotonic() + WAIT_FOR_URL_S
    client.request("subscribe", topics=[f"metrics:{job_id}"], metrics_cursors={job_id: {}})
    while time.monotonic() < deadline:
        ev = client.next_event(1.0)
        if ev is not None and ev.get("event") == "metrics":
            found = serving_status(ev.get("records") or [])
            if found is not None:
                return dict(found)
        if ev is None and client.request("job", job=job_id)["job"]["state"] in TERMINAL_STATES:
            return None
    raise UserError(f"job {job_id} reported no URL in {WAIT_FOR_URL_S:.0f} s; see rigpilot logs {job_id}")
