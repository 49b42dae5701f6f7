"""What a job produced, as the `results` and `job` requests send it: completions and the output folder.

An inference job's completions are JSON lines the rank-0 worker writes into
`output/results.jsonl` (engine/workers/infer.py). They are read here as JSON
only, one record at a time, within a byte budget, so a huge or hostile file
costs a bounded reply; a line that is not a completion record is named in one
line rather than skipped in silence. The token ids of each completion stay in
the file: clients get their count.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError

RESULTS_FILE = Path("output") / "results.jsonl"
# Why a completion ended, as the worker records it, in the words the CLI and the app show.
STOP_WORDS = {"end_of_sequence": "the model ended its answer", "max_tokens": "it reached the new-token limit"}
STOP_REASONS = tuple(STOP_WORDS)
MAX_TEXT = 16 * 1024  # characters of one prompt or completion sent; the file keeps the rest
MAX_LINE = 4 << 20  # a longer line is not one the worker wrote
MAX_LISTED = 200  # output files named in a job's description


def read_results(path: Path, *, start: int = 0, limit: int = 1000, max_bytes: int = 512 * 1024) -> dict[str, Any]:
    """Completions `start`.. of `path`, at most `limit` of them and about `max_bytes` of JSON.

    Raises UserError, in one line, when the file is missing, is not a regular file, or holds a line
    that is not a completion record.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise UserError(f"no completions yet: {path} does not exist (the job writes it when generation ends)") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{path} is not a regular file; completions are only read from the file the job wrote")
    results: list[dict[str, Any]] = []
    used = 0
    more = False
    index = -1
    try:
        f = path.open("rb")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    with f:
        while True:
            line = f.readline(MAX_LINE + 1)
            if not line:
                break
            if len(line) > MAX_LINE:
                raise UserError(
                    f"{path}: line {index + 2} is longer than {MAX_LINE >> 20} MiB; not a completion record"
                )
            if not line.strip():
                continue
            index += 1
            if index < start:
                continue
            if len(results) >= limit or used >= max_bytes:
                more = True
                break
            item = _completion(line, path, index + 1)
            item["index"] = index
            results.append(item)
            used += len(json.dumps(item))
    return {"results": results, "start": start, "more": more, "path": str(path), "size": info.st_size}


def _completion(line: bytes, path: Path, number: int) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except (UnicodeDecodeError, ValueError):
        raise UserError(f"{path}: line {number} is not valid JSON") from None
    if (
        not isinstance(rec, dict)
        or not isinstance(rec.get("prompt"), str)
        or not isinstance(rec.get("completion"), str)
    ):
        raise UserError(f"{path}: line {number} is not a completion record (it needs text 'prompt' and 'completion')")
    tokens = rec.get("tokens")
    prompt, completion = rec["prompt"], rec["completion"]
    return {
        "prompt": prompt[:MAX_TEXT],
        "completion": completion[:MAX_TEXT],
        "new_tokens": len(tokens) if isinstance(tokens, list) else None,
        "cut": len(prompt) > MAX_TEXT or len(completion) > MAX_TEXT,
        # Why generation stopped (`end_of_sequence`, `max_tokens`); None in files written before it was recorded.
        "stop_reason": rec.get("stop_reason") if rec.get("stop_reason") in STOP_REASONS else None,
    }


def describe_output(job_dir: Path) -> dict[str, Any]:
    """What the job's output folder holds: a full model, a LoRA adapter (and merged weights), completions."""
    out = job_dir / "output"
    try:
        names = sorted(p.name for p in out.iterdir())
    except OSError:
        names = []
    model = "lora" if "adapter_config.json" in names else "full" if "config.json" in names else None
    config = _small_json(out / "config.json") if model == "full" else _small_json(out / "merged" / "config.json")
    adapter = _small_json(out / "adapter_config.json") if model == "lora" else {}
    architectures = config.get("architectures")
    base = adapter.get("base_model_name_or_path")
    return {
        "folder": str(out),
        "files": names[:MAX_LISTED],
        "model": model,  # how to load it: transformers (full) or peft (lora)
        "merged": str(out / "merged") if (out / "merged" / "config.json").is_file() else None,
        "results": "results.jsonl" in names,
        # Which transformers class loads it (config.json's "architectures"), and the adapter's base.
        "architectures": [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else [],
        "base_model": base if isinstance(base, str) and base else None,
    }


def _small_json(path: Path, limit: int = 1 << 20) -> dict[str, Any]:
    try:
        if not path.is_file() or path.stat().st_size > limit:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def job_settings(job_dir: Path) -> dict[str, Any] | None:
    """The job's spec (job.json) for clients, without its environment; None when it cannot be read."""
    try:
        spec = json.loads((job_dir / "job.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(spec, dict):
        return None
    spec.pop("env", None)  # names only (secrets are kept apart), but nothing a view needs
    return spec


def check_name(name: str, max_len: int = 100) -> str:
    """A job name as it is stored: one printable line, trimmed."""
    name = name.strip()
    if not name:
        raise UserError("a job's name cannot be empty")
    if len(name) > max_len:
        raise UserError(f"a job's name has at most {max_len} characters; this one has {len(name)}")
    if not name.isprintable():
        raise UserError("a job's name is one line of printable characters")
    return name
