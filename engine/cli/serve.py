"""`rigpilot serve MODEL|JOB`: serve a model, or a finished training job's model, through an OpenAI-compatible
API (loopback unless --listen); the job runs in the engine until `rigpilot cancel`.

It submits a "serve" job (engine.workers.serve), waits until the job reports its URL, prints it (and, beyond
loopback, the job's API key, this once) and returns (or, with --follow, follows the job as `rigpilot run` does).

A finished LoRA job is served unmerged: its base under the name "base" and base + adapter under the job's
name. `--adapter NAME=FOLDER` serves more adapters beside the base; FOLDER may be a finished LoRA job too.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rigpilot.engine.cli.serve_wait import wait_for_url
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import JOB_SETTINGS, SERVE_SETTINGS
from rigpilot.engine.layout import LAYOUT_SETTINGS
from rigpilot.engine.schema import add_option, add_options, given
from rigpilot.engine.terminal import printable


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="serve a model (or a finished training job's) through an OpenAI-compatible API",
        description="rigpilot serve MODEL|JOB: a preset, a model folder, a Hugging Face repo id, or a finished "
        "training job whose model to serve (a LoRA job: base + adapter as the job's name, the base as 'base'). "
        "Runs as an engine job on one GPU (a CPU rank on a simulated machine), or split over --gpus (tensor "
        "parallel, or --pp stages), and listens on 127.0.0.1 unless "
        "--listen; stop it with rigpilot cancel JOB.",
    )  # fmt: skip
    p.add_argument("model", metavar="MODEL|JOB")
    add_option(p, JOB_SETTINGS["gpus"], help="the GPUs to serve on (default: the first, or as many as --tp or "
               "--pp); several split the model by tensor parallelism unless --pp")  # fmt: skip
    add_option(p, JOB_SETTINGS["name"])
    add_options(p, SERVE_SETTINGS)
    for name in ("tp", "pp"):
        add_option(p, LAYOUT_SETTINGS[name])  # one of the two splits the served model
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code to run")
    p.add_argument("--follow", action="store_true", help="follow the job after it serves (Ctrl-C stops following)")
    p.add_argument("--adapter", action="append", metavar="NAME=FOLDER",
                   help="serve a LoRA adapter (a peft folder, or a finished LoRA job) unmerged beside the base, "
                   "as the model NAME in requests; repeatable")  # fmt: skip
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from rigpilot.engine.api.client import EngineClient
    from rigpilot.engine.cli.commands import follow, print_notice

    if not args.model.strip():
        raise UserError("serve what? name a model (a preset, a folder, a repo id) or a finished training job")
    pairs = [_adapter_pair(a) for a in args.adapter or []]
    if args.listen is not None:
        from rigpilot.engine.workers.serve_setup import parse_listen

        parse_listen(args.listen)  # a bad address is told before anything starts; the engine checks it again
    with EngineClient(on_notice=print_notice) as client:
        # A job's name or id goes as it is: the engine puts in what the job trained (engine.jobs.serve_source).
        spec: dict[str, Any] = {"kind": "serve", "model": args.model, **given(args, JOB_SETTINGS)}
        spec["serve"] = given(args, SERVE_SETTINGS)
        adapters: dict[str, str] = {}
        for adapter, folder in pairs:
            if adapter in adapters:
                raise UserError(f"--adapter {adapter}: that name is given twice", reason="serve_adapter_invalid",
                                adapter=adapter)  # fmt: skip
            adapters[adapter] = folder
        if adapters:
            spec["serve"]["adapters"] = adapters
        degrees = given(args, LAYOUT_SETTINGS)
        if degrees:
            spec["parallelism"] = degrees
        if args.trust_remote_code:
            spec["trust_remote_code"] = True
        job = client.request("submit", spec=spec, plan=None, cwd=os.getcwd())["job"]
        serving = wait_for_url(client, job["id"], on_queued=lambda why: print(
            f"job {job['id']} is {printable(why)}; it serves once it runs (Ctrl-C leaves it queued)", flush=True))
        if serving is None:
            return follow(client, job["id"])  # it ended before serving: say how, as `rigpilot run` does
        served = printable(str(serving.get("model") or spec.get("name") or args.model))
        url = printable(str(serving["url"]))
        print(f"serving {served} at {url} (job {job['id']}; stop with: rigpilot cancel {job['id']})", flush=True)
        for adapter in str(serving.get("adapters") or "").split(","):
            if adapter:
                print(f"  adapter {printable(adapter)}: give its name as the model", flush=True)
        if isinstance(serving.get("api_key_file"), str):
            print(_api_key_line(Path(serving["api_key_file"])), flush=True)
        if isinstance(serving.get("tls_fingerprint"), str):
            print(f"TLS certificate: the engine's own, self-signed, {printable(serving['tls_fingerprint'])} (pin it)",
                  flush=True)  # fmt: skip
        return follow(client, job["id"]) if args.follow else 0


def _api_key_line(path: Path) -> str:
    try:
        key = path.read_text().strip()
    except OSError:
        return f"API key: in {printable(str(path))} (send it as Authorization: Bearer KEY)"
    return f"API key (send it as Authorization: Bearer KEY; it is also in {printable(str(path))}): {key}"


def _adapter_pair(given_text: str) -> tuple[str, str]:
    name, sep, folder = given_text.partition("=")
    if not sep or not name.strip() or not folder.strip():
        raise UserError(f"--adapter {given_text!r}: give NAME=FOLDER (a LoRA adapter folder or a finished LoRA job)",
                        reason="serve_adapter_invalid", adapter=name.strip())  # fmt: skip
    return name.strip(), folder.strip()


