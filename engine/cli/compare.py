"""`rigpilot compare-models JOB`: did fine-tuning help? The base model's and the tuned model's completions of the
user's own prompts side by side, greedy unless told, and the job's held-out loss and perplexity.

Both models are asked through the server (`rigpilot serve`'s "serve" job), not through inference jobs: a LoRA
job's base and base + adapter come from ONE server (the adapter unmerged, selected per request by `model`), so
the base is loaded once and nothing is merged or written; an inference job cannot load an unmerged adapter. The
prompts go as concurrent requests, which the server decodes as one batch. A full fine-tune's two models are two
servers, one after the other. Each server is cancelled once its completions are in.

The held-out figures are the job's own last eval record (`held_out`): the loss on the `eval_fraction` share of
its data that training never saw, measured after the last step.
"""

from __future__ import annotations

import argparse
import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.metrics import held_out
from rigpilot.engine.jobspec.spec import SERVE_SETTINGS
from rigpilot.engine.schema import add_option
from rigpilot.engine.terminal import printable

DEFAULT_MAX_TOKENS = 64
MAX_AT_ONCE = 16  # requests in flight at once: the server's default batch
REQUEST_TIMEOUT_S = 600.0  # a long completion on CPU ranks; a server that fails ends its job, and the request


def register(sub: Any, js: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "compare-models", parents=[js], help="a finished training job's model beside its base, on your prompts",
        description="rigpilot compare-models JOB: the base model's and the tuned model's completions of each "
        "prompt side by side (greedy unless --temperature), served by the engine on the first GPU (a CPU rank "
        "on a simulated machine), and the job's held-out loss and perplexity where it measured them.",
    )  # fmt: skip
    p.add_argument("job", metavar="JOB", help="a finished training job (id, unique prefix or name)")
    p.add_argument("--base", metavar="MODEL", help="the base model to compare with (default: the one the job "
                   "trained from)")  # fmt: skip
    p.add_argument("--prompts", metavar="FILE", help='a JSONL file of {"prompt": ...} records')
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeatable")
    p.add_argument("--max-tokens", type=_positive, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"new tokens per completion at most (default {DEFAULT_MAX_TOKENS})")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (the default): greedy")
    add_option(p, SERVE_SETTINGS["precision"], help="the weights' dtype (default: the job's training precision)")
    p.set_defaults(func=cmd_compare)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number of tokens of at least 1, not {text!r}")
    return n


def cmd_compare(args: argparse.Namespace) -> int:
    from rigpilot.engine.api.client import EngineClient
    from rigpilot.engine.cli.commands import print_notice
    from rigpilot.engine.workers.prompts import read_prompts

    if not args.prompts and not args.prompt:
        raise UserError("compare on what? give --prompt TEXT (repeatable) or --prompts FILE (JSONL with a "
                        '"prompt" field)', reason="no_prompts")  # fmt: skip
    prompts = read_prompts(args.prompts, args.prompt)
    with EngineClient(on_notice=print_notice) as client:
        job = _training_job(client, args.job)
        plan = comparison_plan(job, args.base)
        precision = args.precision or _trained_precision(job)
        completions: dict[str, list[str]] = {}
        for serving in plan["servings"]:
            completions.update(_complete(client, serving, precision, prompts, args.max_tokens, args.temperature))
        figures = held_out(job.get("progress"))
    rows = [{"prompt": p, "base": completions["base"][i], "tuned": completions["tuned"][i]}
            for i, p in enumerate(prompts)]  # fmt: skip
    if args.json:
        print(json.dumps({"schema": "rigpilot.compare/1", "job": job["id"], "method": plan["method"],
                          "base_model": plan["base_model"], "tuned_model": plan["tuned_model"],
                          "held_out": _jsonable(figures), "results": rows}))  # fmt: skip
        return 0
    print("\n".join(comparison_lines(job, plan, figures, rows)))
    return 0


def comparison_lines(job: dict[str, Any], plan: dict[str, Any], figures: dict[str, Any] | None,
                     rows: list[dict[str, str]]) -> list[str]:  # fmt: skip
    """The terminal's side by side: the job and its held-out figures, then per prompt both completions, each
    made safe to print (a model's text may hold control characters)."""
    lines = [f"job {job['id']} ({printable(str(job.get('name') or ''))}): {plan['method']} of "
             f"{printable(plan['base_model'])}", f"  {held_out_line(figures)}"]  # fmt: skip
    for row in rows:
        lines += ["", f"prompt: {printable(row['prompt'])}", f"  base:  {printable(row['base'])}",
                  f"  tuned: {printable(row['tuned'])}"]  # fmt: skip
    return lines


def held_out_line(figures: dict[str, Any] | None) -> str:
    if figures is None:
        return "held-out loss: not measured (the job evaluated no held-out data)"
    at = f" after step {figures['step']}" if figures.get("step") is not None else ""
    return f"held-out loss: {figures['eval_loss']:.4f}, perplexity {figures['perplexity']:.4g}{at}"


def _jsonable(figures: dict[str, Any] | None) -> dict[str, Any] | None:
    if figures is not None and not math.isfinite(figures["perplexity"]):
        return {**figures, "perplexity": None}  # JSON has no infinity
    return figures


def _training_job(client: Any, ref: str) -> dict[str, Any]:
    from rigpilot.engine.cli.serve import _finished_output, _job

    job = _job(client, ref)
    if job is None:
        raise UserError(f"no job {ref}", reason="not_found", job=ref)
    _finished_output(job)  # a job that is not training, or not finished, is refused as `rigpilot serve` does
    return job


def comparison_plan(job: dict[str, Any], base: str | None) -> dict[str, Any]:
    """What serves what: for a LoRA job one server of its base (as "base") with the adapter (as "tuned"); for a
    full fine-tune one server each. `base` overrides the model the job trained from."""
    from rigpilot.engine.cli.serve import _lora_base

    out = Path(job.get("job_dir") or "") / "output"
    method = str(((job.get("settings") or {}).get("train") or {}).get("method") or "full")
    if (out / "adapter_config.json").is_file():
        base_model = base or _lora_base(job, out)
        serving = {"model": base_model, "names": {"base": "base", "tuned": "tuned"}, "adapters": {"tuned": str(out)}}
        return {"method": method, "base_model": base_model, "tuned_model": str(out), "servings": [serving]}
    if not (out / "config.json").is_file():
        raise UserError(f"job {job['id']} saved no model in {out}", reason="serve_job_not_trained", job=job["id"],
                        kind=job.get("kind"))  # fmt: skip
    if base is None and method == "scratch":
        raise UserError(f"job {job['id']} trained from scratch: there is no base model to compare with; name one "
                        "with --base MODEL", reason="compare_base_missing", job=job["id"])  # fmt: skip
    base_model = base or _trained_from(job)
    servings = [{"model": base_model, "names": {"base": "base"}, "adapters": {}},
                {"model": str(out), "names": {"tuned": "tuned"}, "adapters": {}}]  # fmt: skip
    return {"method": method, "base_model": base_model, "tuned_model": str(out), "servings": servings}


def _trained_from(job: dict[str, Any]) -> str:
    try:
        model = json.loads((Path(job.get("job_dir") or "") / "job.json").read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        model = None
    if not isinstance(model, str) or not model:
        raise UserError(f"job {job['id']}: its job.json names no base model; name one with --base MODEL",
                        reason="compare_base_missing", job=job["id"])  # fmt: skip
    return model


def _trained_precision(job: dict[str, Any]) -> str | None:
    precision = ((job.get("settings") or {}).get("train") or {}).get("precision")
    return precision if isinstance(precision, str) else None


def _complete(client: Any, serving: dict[str, Any], precision: str | None, prompts: list[str], max_tokens: int,
              temperature: float) -> dict[str, list[str]]:  # fmt: skip
    """Each of the serving's models' completions of every prompt, from one serve job, which is cancelled after."""
    from rigpilot.engine.cli.commands import follow
    from rigpilot.engine.cli.serve import LORA_BASE_NAME, _wait_for_url

    names = serving["names"]
    spec: dict[str, Any] = {"kind": "serve", "model": serving["model"], "name": f"compare: {next(iter(names))}",
                            "serve": {"max_new_tokens": max_tokens}}  # fmt: skip
    if serving["adapters"]:
        spec["serve"]["base_name"] = LORA_BASE_NAME
        spec["serve"]["adapters"] = serving["adapters"]
    if precision:
        spec["serve"]["precision"] = precision
    job = client.request("submit", spec=spec, plan=None)["job"]
    try:
        status = _wait_for_url(client, job["id"])
        if status is None:
            follow(client, job["id"])  # it ended before serving: say how, as `rigpilot serve` does
            raise UserError(f"the server for the {' and '.join(names)} model did not start (job {job['id']})",
                            reason="compare_server_failed", job=job["id"])  # fmt: skip
        served = str(status.get("model") or "")
        url = str(status["url"]).rstrip("/") + "/completions"
        with ThreadPoolExecutor(max_workers=min(MAX_AT_ONCE, len(prompts) * len(names))) as pool:
            # Every request is in flight together, so both models' rows share the server's batches.
            futures = {label: [pool.submit(_completion, url, name if serving["adapters"] else served, p, max_tokens,
                                           temperature) for p in prompts]
                       for label, name in names.items()}  # fmt: skip
            return {label: [f.result() for f in fs] for label, fs in futures.items()}
    finally:
        client.request("cancel", job=job["id"])


def _completion(url: str, model: str, prompt: str, max_tokens: int, temperature: float) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature})
    req = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return str(json.loads(r.read())["choices"][0]["text"])
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {e.code}"
        raise UserError(f"the server refused a prompt: {message}", reason="compare_request_refused",
                        status=e.code, detail=str(message)) from None  # fmt: skip
