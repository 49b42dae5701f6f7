"""`rigpilot serve MODEL|JOB`: serve a model, or a finished training job's model, through an OpenAI-compatible
API on this machine's loopback; the job runs in the engine until `rigpilot cancel`.

It submits a "serve" job (engine.workers.serve), waits until the job reports its URL, prints it and returns
(or, with --follow, follows the job as `rigpilot run` does).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import JOB_SETTINGS, SERVE_SETTINGS
from rigpilot.engine.layout import LAYOUT_SETTINGS
from rigpilot.engine.schema import TERMINAL_STATES, add_option, add_options, given
from rigpilot.engine.terminal import printable

WAIT_FOR_URL_S = 600.0  # loading a large model from a slow disk; the job's own failure ends the wait sooner
NOT_YET = "not yet in this version"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="serve a model (or a finished training job's) through an OpenAI-compatible API",
        description="rigpilot serve MODEL|JOB: a preset, a model folder, a Hugging Face repo id, or a finished "
        "training job whose model to serve. Runs as an engine job on one GPU (a CPU rank on a simulated machine) "
        "and listens on 127.0.0.1 only; stop it with rigpilot cancel JOB.",
    )  # fmt: skip
    p.add_argument("model", metavar="MODEL|JOB")
    add_option(p, JOB_SETTINGS["gpus"], help="the GPU to serve on (default: the first; one in this version)")
    add_option(p, JOB_SETTINGS["name"])
    add_options(p, SERVE_SETTINGS)
    for name in ("tp", "pp"):
        add_option(p, LAYOUT_SETTINGS[name])  # the engine says these are for a later version
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code to run")
    p.add_argument("--follow", action="store_true", help="follow the job after it serves (Ctrl-C stops following)")
    p.add_argument("--adapter", action="append", metavar="NAME=FOLDER", help=f"LoRA adapters by name ({NOT_YET})")
    p.add_argument("--listen", metavar="ADDR", help=f"listen beyond loopback, with an API key ({NOT_YET})")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from rigpilot.engine.api.client import EngineClient
    from rigpilot.engine.cli.commands import follow, print_notice

    for flag, value in (("--adapter", args.adapter), ("--listen", args.listen)):
        if value:
            raise UserError(f"rigpilot serve {flag}: {NOT_YET}", reason="serve_not_yet", feature=flag.lstrip("-"))
    if not args.model.strip():
        raise UserError("serve what? name a model (a preset, a folder, a repo id) or a finished training job")
    with EngineClient(on_notice=print_notice) as client:
        model, name = _what_to_serve(client, args.model)
        spec: dict[str, Any] = {"kind": "serve", "model": model, **given(args, JOB_SETTINGS)}
        spec.setdefault("name", name)
        spec["serve"] = given(args, SERVE_SETTINGS)
        degrees = given(args, LAYOUT_SETTINGS)
        if degrees:
            spec["parallelism"] = degrees
        if args.trust_remote_code:
            spec["trust_remote_code"] = True
        job = client.request("submit", spec=spec, plan=None, cwd=os.getcwd())["job"]
        url = _wait_for_url(client, job["id"])
        if url is None:
            return follow(client, job["id"])  # it ended before serving: say how, as `rigpilot run` does
        served = printable(spec.get("name") or model)
        print(f"serving {served} at {url} (job {job['id']}; stop with: rigpilot cancel {job['id']})", flush=True)
        return follow(client, job["id"]) if args.follow else 0


def _what_to_serve(client: Any, given_name: str) -> tuple[str, str]:
    """(the model to load, the name requests give): a folder, preset or repo id as it is, or a training job's
    model folder (its merged weights where it saved both an adapter and those)."""
    from rigpilot.engine.api import protocol
    from rigpilot.engine.api.client import EngineError

    if Path(given_name).expanduser().exists():
        return given_name, ""
    try:
        job = client.request("job", job=given_name)["job"]
    except EngineError as e:
        if e.code == protocol.NOT_FOUND:
            return given_name, ""  # a preset or a Hugging Face repo id; the engine checks it
        raise
    if job.get("kind") != "train":
        raise UserError(f"job {job['id']} is a {job.get('kind')} job: only a training job has a model to serve",
                        reason="serve_job_not_trained", job=job["id"], kind=job.get("kind"))  # fmt: skip
    out = Path(job.get("job_dir") or "") / "output"
    if job.get("state") != "completed" or not out.is_dir():
        raise UserError(f"job {job['id']} has not finished training ({job.get('state')}): serve it once it has",
                        reason="serve_job_not_finished", job=job["id"], state=job.get("state"))  # fmt: skip
    for folder in (out, out / "merged"):
        if (folder / "config.json").is_file():
            return str(folder), job.get("name") or job["id"]
    raise UserError(f"job {job['id']} saved a LoRA adapter without merged weights: serving an adapter by name is "
                    f"{NOT_YET} (train with --save-merged)", reason="serve_not_yet", feature="adapter",
                    job=job["id"])  # fmt: skip


def _wait_for_url(client: Any, job_id: str) -> str | None:
    """The URL the job reports once it listens; None when it ended first."""
    deadline = time.monotonic() + WAIT_FOR_URL_S
    client.request("subscribe", topics=[f"metrics:{job_id}"], metrics_cursors={job_id: {}})
    while time.monotonic() < deadline:
        ev = client.next_event(1.0)
        if ev is not None and ev.get("event") == "metrics":
            for r in ev.get("records") or []:
                if r.get("kind") == "status" and r.get("phase") == "serving" and isinstance(r.get("url"), str):
                    return str(r["url"])
        if ev is None and client.request("job", job=job_id)["job"]["state"] in TERMINAL_STATES:
            return None
    raise UserError(f"job {job_id} reported no URL in {WAIT_FOR_URL_S:.0f} s; see rigpilot logs {job_id}")
