"""What a finished job came to, in words: summary figures, the eval-loss trend, how to load its model,
which model a "use this model" action takes, and how the settings of runs differ. Plain Python, no Qt.

It reads the engine's `job` answer (`settings`: the job's spec; `output`: what its output folder holds,
engine/jobs/results.py) and the job's metric series.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from rigpilot.app.jobs.model import duration
from rigpilot.app.widgets.units import si
from rigpilot.engine.capability import backend_words
from rigpilot.engine.jobs.metrics import perplexity
from rigpilot.engine.jobs.store import COMPLETED
from rigpilot.engine.jobspec.spec import INFER_SETTINGS, SETTINGS, TRAIN_SETTINGS

# A rise this far above the best eval loss, held for the last RISING_EVALS evals, is flagged.
RISING_MARGIN = 0.02
RISING_EVALS = 2


@dataclass(frozen=True)
class ModelChoice:
    """The model a finished job offers to plan, infer or fine-tune from; `path` None says why not in `why`."""

    path: str | None
    what: str  # "the fine-tuned model", "the merged LoRA weights", "the model it ran"
    why: str = ""


def settings_of(job: dict[str, Any]) -> dict[str, Any]:
    s = job.get("settings")
    return s if isinstance(s, dict) else {}


def output_of(job: dict[str, Any]) -> dict[str, Any]:
    o = job.get("output")
    return o if isinstance(o, dict) else {}


def model_of(job: dict[str, Any]) -> ModelChoice:
    """The model a completed job leaves to use: its saved model (training) or the one it ran (inference)."""
    kind = job.get("kind")
    if job.get("state") != COMPLETED:
        return ModelChoice(None, "", "the job has not completed")
    settings, output = settings_of(job), output_of(job)
    if kind == "infer":
        model = settings.get("model")
        return ModelChoice(model, "the model it ran") if model else ModelChoice(None, "", "the engine did not say")
    if kind != "train":
        return ModelChoice(None, "", f"a {kind or 'job'} job saves no model")
    if output.get("model") == "full":
        return ModelChoice(output.get("folder"), "the trained model")
    if output.get("model") == "lora":
        if output.get("merged"):
            return ModelChoice(output["merged"], "the merged LoRA weights")
        return ModelChoice(
            None, "", "the job saved only its LoRA adapter; turn on 'save merged weights' to get a model to run"
        )
    if not output:
        return ModelChoice(None, "", "the engine has not said what the job saved")
    return ModelChoice(None, "", "the job's output folder holds no model")


def eval_trend(steps: np.ndarray, losses: np.ndarray, margin: float = RISING_MARGIN) -> str | None:
    """A line when the eval loss rose and stayed up: the last RISING_EVALS evals all above the best by `margin`."""
    ok = np.isfinite(losses)
    steps, losses = steps[ok], losses[ok]
    if len(losses) < RISING_EVALS + 1:
        return None
    best = int(np.argmin(losses))
    tail = losses[-RISING_EVALS:]
    if best >= len(losses) - RISING_EVALS or not np.all(tail > losses[best] * (1 + margin)):
        return None
    rise = (losses[-1] / losses[best] - 1) * 100
    return (
        f"Eval loss is rising: {losses[-1]:.4f} at step {int(steps[-1])}, {rise:.0f} % above its best "
        f"{losses[best]:.4f} at step {int(steps[best])} — the model may be overfitting; the checkpoint "
        f"nearest step {int(steps[best])} is likely the better one"
    )


def tokens_processed(job: dict[str, Any], steps_done: int | None) -> int | None:
    """Training tokens the job went through: steps × sequences per step × sequence length."""
    settings = settings_of(job)
    train, par = settings.get("train"), settings.get("parallelism") or {}
    if not isinstance(train, dict) or not steps_done:
        return None
    try:
        data_parallel = int(par.get("dp_replicate", 1)) * int(par.get("dp_shard", 1))
        per_step = int(train["micro_batch"]) * int(train["grad_accum"]) * data_parallel * int(train["seq_len"])
    except (KeyError, TypeError, ValueError):
        return None
    return steps_done * per_step


def summary_rows(job: dict[str, Any], series: Any) -> list[tuple[str, str]]:
    """(label, value) rows of a finished job's summary; only what is known."""
    rows: list[tuple[str, str]] = []
    progress = job.get("progress") or job.get("measured") or {}
    settings = settings_of(job)
    if settings.get("model"):
        rows.append(("Model", str(settings["model"])))
    steps, loss = series.series("loss")
    finite = np.isfinite(loss)
    if finite.any():
        last = int(np.flatnonzero(finite)[-1])
        rows.append(("Final train loss", f"{loss[last]:.4f} (step {int(steps[last])})"))
    eval_steps, eval_losses = series.eval_loss()
    ok = np.isfinite(eval_losses)
    if ok.any():
        e_steps, e_loss = eval_steps[ok], eval_losses[ok]
        best = int(np.argmin(e_loss))
        rows.append(("Final eval loss", f"{e_loss[-1]:.4f} (step {int(e_steps[-1])})"))
        rows.append(("Held-out perplexity", f"{perplexity(float(e_loss[-1])):.4g} (step {int(e_steps[-1])})"))
        rows.append(("Best eval loss", f"{e_loss[best]:.4f} (step {int(e_steps[best])})"))
    elif isinstance((progress.get("eval") or {}).get("eval_loss"), int | float):
        rows.append(("Final eval loss", f"{progress['eval']['eval_loss']:.4f}"))
        rows.append(("Held-out perplexity", f"{perplexity(progress['eval']['eval_loss']):.4g}"))
    step = series.last_step if series.last_step is not None else progress.get("step")
    tokens = tokens_processed(job, step)
    if tokens:
        rows.append(("Tokens processed", f"{si(tokens)} ({step} steps)"))
    wall, run = job.get("wall_s"), job.get("run") or 1  # the engine's figure: every run added up
    if isinstance(wall, int | float):
        rows.append(("Wall time", duration(wall) + (f" in {run} runs" if run > 1 else "")))
    speed = steady_speed(progress)
    if speed is not None:
        rows.append(("Speed", si(speed, "tokens/s")))
    folder = output_of(job).get("folder")
    if folder and output_of(job).get("model"):
        rows.append(("Saved to", folder))
    return rows


def backend_of(job: dict[str, Any]) -> str | None:
    """The generator an inference job runs and why (job.json's `infer`, as the engine's submission wrote it)."""
    infer = settings_of(job).get("infer")
    if job.get("kind") != "infer" or not isinstance(infer, dict):
        return None
    # A job submitted before backends were chosen ("auto" in its job.json) ran Rigpilot's own generator.
    name = "vllm" if infer.get("backend") == "vllm" else "transformers"
    reason = infer.get("backend_reason")
    return backend_words(name, reason if isinstance(reason, str) else "")


def load_snippets(job: dict[str, Any]) -> list[tuple[str, str]]:
    """(title, Python) to load what a training job saved, for the folder as the engine wrote it."""
    output, settings = output_of(job), settings_of(job)
    folder = output.get("folder")
    if not folder or output.get("model") not in ("full", "lora"):
        return []
    auto = _auto_class(output.get("architectures") or [])
    out: list[tuple[str, str]] = []
    if output["model"] == "full":
        out.append(("transformers", _full_snippet(auto, folder)))
        return out
    base = output.get("base_model") or settings.get("model") or "BASE_MODEL"
    out.append((
        "peft (LoRA adapter)",
        f"from peft import PeftModel\nfrom transformers import {auto}, AutoTokenizer\n\n"
        f"base = {auto}.from_pretrained({json.dumps(str(base))})\n"
        f"model = PeftModel.from_pretrained(base, {json.dumps(folder)})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(folder)})\n",
    ))  # fmt: skip
    if output.get("merged"):
        out.append(("transformers (merged weights)", _full_snippet(auto, output["merged"])))
    return out


def _full_snippet(auto: str, folder: str) -> str:
    return (
        f"from transformers import {auto}, AutoTokenizer\n\n"
        f"model = {auto}.from_pretrained({json.dumps(folder)})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(folder)})\n"
    )


def _auto_class(architectures: list[str]) -> str:
    # The engine saves causal LMs and masked LMs (engine/workers/model_loading.py auto_class).
    return "AutoModelForMaskedLM" if any(a.endswith("ForMaskedLM") for a in architectures) else "AutoModelForCausalLM"


# -- comparing settings ------------------------------------------------------------------------------

# The settings a user compares runs by (keys in the spec), in the order they read: every declared training and
# inference setting (engine.jobspec.spec), labelled as declared; a new setting is compared without an edit here.
_NOT_SETTINGS = {"kind": "Kind", "model": "Model", "parallelism": "Layout"}
COMPARED_KEYS = (
    "kind", "model", *(s.key for s in TRAIN_SETTINGS.values()), "gpus", "parallelism",
    *(s.key for s in INFER_SETTINGS.values()),
)  # fmt: skip
COMPARED: list[tuple[str, tuple[str, ...]]] = [
    (_NOT_SETTINGS.get(key) or SETTINGS[key].label, tuple(key.split("."))) for key in COMPARED_KEYS
]


def layout_text(par: Any) -> str:
    if not isinstance(par, dict):
        return "—"
    parts = [f"{name} {par[key]}" for key, name in
             (("dp_replicate", "DP"), ("dp_shard", "FSDP"), ("tp", "TP"), ("pp", "PP"))
             if isinstance(par.get(key), int) and par[key] > 1]  # fmt: skip
    if par.get("cpu_offload"):
        parts.append("CPU offload")
    return " × ".join(parts) if parts else "one rank"


def _value(settings: dict[str, Any], path: tuple[str, ...]) -> str:
    v: Any = settings
    for key in path:
        v = v.get(key) if isinstance(v, dict) else None
    if v is None and len(path) == 2 and isinstance(settings.get(path[0]), dict):
        v = SETTINGS[".".join(path)].default  # a job from before the setting existed ran with its default
    if path == ("parallelism",):
        return layout_text(v)
    if v is None or v == []:
        return "—"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v)
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def settings_diff(jobs: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(label, value per job) for each compared setting whose values are not all the same."""
    values = [[_value(settings_of(j), path) for j in jobs] for _, path in COMPARED]
    return [(label, row) for (label, _), row in zip(COMPARED, values, strict=True) if len(set(row)) > 1]


def steady_speed(progress: dict[str, Any]) -> float | None:
    """The job's tokens/s as the engine measures it beside the plan (the median of its latest steps)."""
    v = progress.get("steady_tokens_per_s")
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
