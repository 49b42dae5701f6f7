"""The check of a whole job spec: each setting against its declared range or choices (engine.jobspec.spec
declares them, engine.schema words the refusal), strings, lists, paths and the environment against their
sizes, so a value is refused once, at the edge, in one line naming the setting.

The bounds are generous (far beyond any real job) but finite: a value past them is a typo or an
attack, and left in it would fail late (an overflow deep in a worker) or never stop (10^30 steps).
"""

from __future__ import annotations

import re
from dataclasses import is_dataclass
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import check_path_length
from rigpilot.engine.jobspec.spec import INFER_SETTINGS, SERVE_SETTINGS, SETTINGS, TRAIN_SETTINGS
from rigpilot.engine.schema import check_group

PATH_MAX = 4096  # Linux's PATH_MAX: a longer path cannot name a file

# Each setting's range or choices is its declaration's (engine.jobspec.spec); strings have a length bound here
# instead. The parallel degrees and schedule are the Layout's own to check (engine.layout), when one is made.
STRING_MAX = {"name": 256, "train.text_field": 256, "infer.backend_reason": 1024}
LIST_MAX = {"gpus": 4096, "train.dataset": 1024, "train.lora_targets": 1024, "infer.prompts": 100_000, "script": 10_000}
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_MAX = 1024
ENV_VALUE_MAX = 128 * 1024
PROMPT_MAX = 1024 * 1024


def check_job_settings(spec: Any) -> None:
    """Raise a one-line UserError for the first setting of a JobSpec outside its allowed values."""
    for section, declared in (("train", TRAIN_SETTINGS), ("infer", INFER_SETTINGS), ("serve", SERVE_SETTINGS)):
        part = getattr(spec, section, None)
        if part is not None and is_dataclass(part):
            check_group(part, declared)
    for key, limit in STRING_MAX.items():
        value = _setting(spec, key)
        if isinstance(value, str) and len(value) > limit:
            raise UserError(f"{key} is {len(value):,} characters long; at most {limit:,} are allowed")
    for key, limit in LIST_MAX.items():
        value = _setting(spec, key)
        if isinstance(value, list) and len(value) > limit:
            raise UserError(f"{key} has {len(value):,} entries; at most {limit:,} are allowed")
    restarts = getattr(spec, "max_restarts", None)
    if restarts is not None:
        SETTINGS["max_restarts"].check(restarts)
    for g in spec.gpus or []:
        if not 0 <= g < 4096:
            raise UserError(f"GPU index {g} is out of range [0, 4095]")
    # Paths (and a model, which may be one) no file system could hold: engine.given_path's rule, in bytes.
    for what, path in [("model", spec.model), ("script", (spec.script or [None])[0]),
                       *(("data file", p) for p in (spec.train.dataset if spec.train else [])),
                       ("prompts file", spec.infer.prompts_file if spec.infer else None)]:  # fmt: skip
        if isinstance(path, str) and path:
            check_path_length(path, what)
    for item in spec.script or []:
        if len(item) > PATH_MAX:
            raise UserError(f"a script argument is {len(item):,} characters long; at most {PATH_MAX:,} are allowed")
    if spec.infer:
        for prompt in spec.infer.prompts:
            if len(prompt) > PROMPT_MAX:
                raise UserError(f"a prompt is {len(prompt):,} characters long; at most {PROMPT_MAX:,} are allowed")
    check_env(spec.env or {})


def check_env(env: dict[str, str]) -> None:
    """The environment a job's ranks get: names a shell accepts, sizes bounded (submit and resume alike)."""
    if len(env) > ENV_MAX:
        raise UserError(f"env has {len(env):,} variables; at most {ENV_MAX:,} are allowed")
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            raise UserError(f"env name {name[:60]!r} is not a valid variable name (letters, digits and _)")
        if len(value) > ENV_VALUE_MAX:
            raise UserError(f"env {name} is {len(value):,} characters long; at most {ENV_VALUE_MAX:,} are allowed")


def _setting(spec: Any, key: str) -> Any:
    """The value of "field" or "section.field" in a JobSpec; None where the section is absent."""
    section, _, name = key.rpartition(".")
    owner = getattr(spec, section, None) if section else spec
    return getattr(owner, name, None) if owner is not None else None


