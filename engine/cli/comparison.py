"""What `rigpilot compare-models` and the app's "Compare with base model" run: a finished training job's base and
tuned models asked the same prompts, and the job's held-out figures, as one `rigpilot.compare/1` document.

Both models are asked through the server (`rigpilot serve`'s "serve" job), not through inference jobs: a LoRA
job's base and base + adapter come from ONE server (the adapter unmerged, selected per request by `model`), so
the base is loaded once and nothing is merged or written; an inference job cannot load an unmerged adapter. The
prompts go as concurrent requests, which the server decodes as one batch. A full fine-tune's two models are two
servers, one after the other. Each server is cancelled once its completions are in (or the comparison failed).

The held-out figures are the job's own last eval record (engine.jobs.metrics.held_out): the loss on the
`eval_fraction` share of its data that training never saw, measured after the last step.

Torch-free and free of the CLI's commands: the app imports it.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rigpilot.engine.cli.serve_wait import wait_for_url
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.metrics import held_out
from rigpilot.engine.jobs.serve_source import LORA_BASE_NAME
from rigpilot.engine.terminal import printable

DEFAULT_MAX_TOKENS = 64
MAX_AT_ONCE = 16  # requests in flight at once: the server's default batch
REQUEST_TIMEOUT_S = 600.0  # a long completion on CPU ranks; a server that fails ends its job, and the request


def compare_models(client: Any, job_ref: str, prompts: list[str], *, base: str | None = None,
                   max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = 0.0,
                   precision: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The comparison as its `rigpilot.compare/1` document, asked of the engine `client` speaks to: the CLI's and
    the app's one path (the app runs it off its GUI thread). Blocks until every completion is in."""
    job = _training_job(client, job_ref)
    plan = comparison_plan(job, base)
    precision = precision or _trained_precision(job)
    completions: dict[str, list[str]] = {}
    for serving in plan["servings"]:
        completions.update(_complete(client, job["id"], serving, precision, prompts, max_tokens, temperature))
    rows = [{"prompt": p, "base": completions["base"][i], "tuned": completions["tuned"][i]}
            for i, p in enumerate(prompts)]  # fmt: skip
    return {"schema": "rigpilot.compare/1", "job": job["id"], "name": job.get("name") or "", "method": plan["method"],
            "base_model": plan["base_model"], "tuned_model": plan["tuned_model"],
            "held_out": _jsonable(held_out(job.get("progress"))), "results": rows}  # fmt: skip


def held_out_line(figures: dict[str, Any] | None) -> str:
    if figures is None:
        return "held-out loss: not measured (the job evaluated no held-out data)"
    at = f" after step {figures['step']}" if figures.get("step") is not None else ""
    ppl = figures["perplexity"]
    return (
        f"held-out loss: {figures['eval_loss']:.4f}, perplexity {'beyond a float' if ppl is None else f'{ppl:.4g}'}{at}"
    )


def _jsonable(figures: dict[str, Any] | None) -> dict[str, Any] | None:
    if figures is not None and not math.isfinite(figures["perplexity"]):
        return {**figures, "perplexity": None}  # JSON has no infinity
    return figures


def _training_job(client: Any, ref: str) -> dict[str, Any]:
    from rigpilot.engine.api import protocol
    from rigpilot.engine.api.client import EngineError

    try:
        job = dict(client.request("job", job=ref)["job"])
    except EngineError as e:
        if e.code == protocol.NOT_FOUND:
            raise UserError(f"no job {ref}", reason="not_found", job=ref) from None
        raise
    # Refused in the words `rigpilot serve JOB` uses (the engine checks it again when it serves the job).
    if job.get("kind") != "train":
        raise UserError(f"job {job['id']} is a {job.get('kind')} job: only a training job has a model to serve",
                        reason="serve_job_not_trained", job=job["id"], kind=job.get("kind"))  # fmt: skip
    if job.get("state") != "completed":
        raise UserError(f"job {job['id']} has not finished training ({job.get('state')}): serve it once it has",
                        reason="serve_job_not_finished", job=job["id"], state=job.get("state"))  # fmt: skip
    return job


def comparison_plan(job: dict[str, Any], base: str | None) -> dict[str, Any]:
    """What serves what, from the engine's view of the job (its settings and what its output holds): for a LoRA
    job one server of its base (as "base") with the job's adapter (as "tuned"); for a full fine-tune one server
    each. The job goes to the engine by its id, which puts in its folders (engine.jobs.serve_source), so a
    client on another machine compares as well. `base` overrides the model the job trained from."""
    output = job.get("output") or {}
    tuned = str(output.get("folder") or job["id"])
    method = str(((job.get("settings") or {}).get("train") or {}).get("method") or "full")
    if output.get("model") == "lora":
        base_model = base or _trained_from(job)
        names = {"base": LORA_BASE_NAME, "tuned": "tuned"}  # the served names of the base and the adapter
        serving = {"model": base_model, "names": names, "adapters": {"tuned": job["id"]}}
        return {"method": method, "base_model": base_model, "tuned_model": tuned, "servings": [serving]}
    if output.get("model") != "full":
        raise UserError(f"job {job['id']} saved no model in {tuned}", reason="serve_job_not_trained", job=job["id"],
                        kind=job.get("kind"))  # fmt: skip
    if base is None and method == "scratch":
        raise UserError(f"job {job['id']} trained from scratch: there is no base model to compare with; name one "
                        "with --base MODEL", reason="compare_base_missing", job=job["id"])  # fmt: skip
    base_model = base or _trained_from(job)
    servings = [{"model": base_model, "names": {"base": "base"}, "adapters": {}},
                {"model": job["id"], "names": {"tuned": "tuned"}, "adapters": {}}]  # fmt: skip
    return {"method": method, "base_model": base_model, "tuned_model": tuned, "servings": servings}


def _trained_from(job: dict[str, Any]) -> str:
    """The model the job trained from, as the engine resolved it at submission (its settings' model); a LoRA
    adapter's own note where the settings lack it."""
    model = (job.get("settings") or {}).get("model") or (job.get("output") or {}).get("base_model")
    if not isinstance(model, str) or not model:
        raise UserError(f"job {job['id']}: its settings name no base model; name one with --base MODEL",
                        reason="compare_base_missing", job=job["id"])  # fmt: skip
    return model


def _trained_precision(job: dict[str, Any]) -> str | None:
    precision = ((job.get("settings") or {}).get("train") or {}).get("precision")
    return precision if isinstance(precision, str) else None


def _complete(client: Any, trained_id: str, serving: dict[str, Any], precision: str | None, prompts: list[str],
              max_tokens: int, temperature: float) -> dict[str, list[str]]:  # fmt: skip
    """Each of the serving's models' completions of every prompt, from one serve job, which is cancelled after."""
    names = serving["names"]
    spec: dict[str, Any] = {"kind": "serve", "model": serving["model"], "serve": {"max_new_tokens": max_tokens},
                            "name": f"compare {trained_id}: {' and '.join(names)}"}  # fmt: skip
    if serving["adapters"]:
        spec["serve"]["base_name"] = LORA_BASE_NAME
        spec["serve"]["adapters"] = serving["adapters"]
    if precision:
        spec["serve"]["precision"] = precision
    job = client.request("submit", spec=spec, plan=None)["job"]
    try:
        status = wait_for_url(client, job["id"])
        if status is None:
            ended = client.request("job", job=job["id"])["job"]
            why = printable(str(ended.get("exit_reason") or ended.get("state") or "it ended"))
            raise UserError(f"the server for the {' and '.join(names)} model did not start (job {job['id']}: {why})",
                            reason="compare_server_failed", job=job["id"], state=ended.get("state"))  # fmt: skip
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
