"""What a serve submission serves when it names finished training jobs instead of folders.

`rigpilot serve JOB`, the app's "Serve this model" and `--adapter NAME=JOB` all name a job; the engine, which
holds the jobs and their folders (a client on another machine sees neither), puts the folders in before the
submission is checked. A full fine-tune or a model trained from scratch is served from its model folder; a
LoRA job is served as its base model with its adapter unmerged beside it, under the job's name (or the
submission's `name`), the base as "base" — even where the job saved merged weights too, so that the base and
the tuned model answer from one server. A model that is a folder (absolute, or under the client's working
folder) is a folder even where a job has that name; a name that is no job is left to the model checks (a
preset, a Hugging Face repo id).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.store import JobRecord

LORA_BASE_NAME = "base"  # what the base of a served LoRA job is called in requests
ADAPTER_CONFIG = "adapter_config.json"


def with_job_folders(
    data: dict[str, Any], base: Path | None, find: Callable[[str], list[JobRecord]], job_dir: Callable[[str], Path]
) -> dict[str, Any]:
    """`data` (a submission) with the jobs its model and adapters name replaced by what they trained."""
    if data.get("kind") != "serve":
        return data
    data = dict(data)
    serve = data.get("serve") if data.get("serve") is not None else {}
    if not isinstance(serve, dict):
        return data  # the submission's checks word what is wrong with it
    serve = dict(serve)
    adapters = serve.get("adapters")
    adapters = dict(adapters) if isinstance(adapters, dict) else adapters
    model = data.get("model")
    job = _job(find, model) if isinstance(model, str) and model.strip() and not _exists(model, base) else None
    if job is not None:
        out = _finished_output(job, job_dir(job.id))
        name = data.get("name") if isinstance(data.get("name"), str) and data.get("name") else job.name or job.id
        data["name"] = name
        serve["source_job"] = job.id  # clients find "the server of this job" by it
        if (out / ADAPTER_CONFIG).is_file():
            data["model"] = _lora_base(job, job_dir(job.id), out)
            serve.setdefault("base_name", LORA_BASE_NAME)
            given = adapters if isinstance(adapters, dict) else {}
            if name in given:
                raise UserError(f"adapter {name!r}: that name is given twice", reason="serve_adapter_invalid",
                                adapter=name)  # fmt: skip
            adapters = {name: str(out), **given}
        elif (out / "config.json").is_file():
            data["model"] = str(out)
        else:
            raise UserError(f"job {job.id} saved no model in {out}", reason="serve_job_not_trained", job=job.id,
                            kind=job.kind)  # fmt: skip
    if isinstance(adapters, dict):
        for name, folder in list(adapters.items()):
            if isinstance(folder, str) and folder.strip() and not _exists(folder, base):
                adapters[name] = _adapter_of(find, job_dir, str(name), folder)
        serve["adapters"] = adapters
    data["serve"] = serve
    return data


def _exists(given: str, base: Path | None) -> bool:
    path = Path(given).expanduser()
    if not path.is_absolute():
        if base is None:
            return False
        path = base / path
    try:
        return path.exists()
    except OSError:  # a name too long for a path, say: not a folder
        return False


def _job(find: Callable[[str], list[JobRecord]], ref: str) -> JobRecord | None:
    matches = find(ref)
    if len(matches) > 1:
        ids = [m.id for m in matches[:5]]
        raise UserError(f"{ref!r} could mean several jobs ({', '.join(ids)}); give more of the id",
                        reason="job_ambiguous", ref=ref, jobs=ids)  # fmt: skip
    return matches[0] if matches else None


def _finished_output(job: JobRecord, folder: Path) -> Path:
    if job.kind != "train":
        raise UserError(f"job {job.id} is a {job.kind} job: only a training job has a model to serve",
                        reason="serve_job_not_trained", job=job.id, kind=job.kind)  # fmt: skip
    out = folder / "output"
    if job.state != "completed" or not out.is_dir():
        raise UserError(f"job {job.id} has not finished training ({job.state}): serve it once it has",
                        reason="serve_job_not_finished", job=job.id, state=job.state)  # fmt: skip
    return out


def _adapter_of(find: Callable[[str], list[JobRecord]], job_dir: Callable[[str], Path], name: str, ref: str) -> str:
    job = _job(find, ref)
    if job is None:
        raise UserError(f"adapter {name}: {ref} is neither a folder nor a job", reason="serve_adapter_invalid",
                        adapter=name, folder=ref)  # fmt: skip
    out = _finished_output(job, job_dir(job.id))
    if not (out / ADAPTER_CONFIG).is_file():
        raise UserError(f"adapter {name}: job {job.id} saved no LoRA adapter (it trained all the weights): serve it "
                        "as a model instead", reason="serve_adapter_invalid", adapter=name, job=job.id)  # fmt: skip
    return str(out)


def _lora_base(job: JobRecord, folder: Path, out: Path) -> str:
    """The model a LoRA job trained on: its job.json's (as the engine resolved it), else the adapter's own note."""
    for file, key in ((folder / "job.json", "model"), (out / ADAPTER_CONFIG, "base_model_name_or_path")):
        try:
            model = json.loads(file.read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(model, str) and model:
            return model
    raise UserError(f"job {job.id}: its base model is named neither in its job.json nor in its adapter",
                    reason="serve_adapter_invalid", job=job.id)  # fmt: skip
