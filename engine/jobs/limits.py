"""The allowed range of every job setting: one table that the submission path checks and the GUI's
fields are bounded by, so a value is refused once, at the edge, in one line naming the setting.

The bounds are generous (far beyond any real job) but finite: a value past them is a typo or an
attack, and left in it would fail late (an overflow deep in a worker) or never stop (10^30 steps).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from rigpilot.engine.capability import INFER_BACKENDS, TRAIN_METHODS
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import check_path_length

PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINTING = ("none", "selective", "full")
PATH_MAX = 4096  # Linux's PATH_MAX: a longer path cannot name a file
MANY = 10**8


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    hi_open: bool = False  # [lo, hi) rather than [lo, hi]
    lo_open: bool = False  # (lo, hi]

    def holds(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def text(self) -> str:
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        return f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}"


@dataclass(frozen=True)
class Choice:
    options: tuple[str, ...]
    any_case: bool = False

    def holds(self, v: Any) -> bool:
        if self.any_case and isinstance(v, str):
            return v.lower() in {o.lower() for o in self.options}
        return v in self.options

    def text(self) -> str:
        return "one of " + ", ".join(self.options)


def _num(v: float) -> str:
    if v == int(v) and abs(v) >= 10**6:
        return f"{int(v):,}"
    return f"{v:g}"


# setting (as "section.field") -> its allowed values. Strings have a length bound instead.
# The parallel degrees and schedule are the Layout's own to check (engine.layout), when one is made.
LIMITS: dict[str, Range | Choice] = {
    "train.method": Choice(TRAIN_METHODS),
    "train.precision": Choice(PRECISIONS),
    "train.activation_checkpointing": Choice(CHECKPOINTING),
    "train.max_steps": Range(1, MANY),
    "train.seq_len": Range(1, 2**21),
    "train.micro_batch": Range(1, 2**16),
    "train.grad_accum": Range(1, 2**16),
    "train.learning_rate": Range(0, 10, lo_open=True),
    "train.warmup_steps": Range(0, MANY),
    "train.weight_decay": Range(0, 10),
    "train.grad_clip": Range(0, 10**6),
    "train.eval_fraction": Range(0, 1, hi_open=True),
    "train.eval_every": Range(0, MANY),
    "train.checkpoint_every": Range(0, MANY),
    "train.keep_checkpoints": Range(0, 10**6),
    "train.seed": Range(0, 2**63 - 1),
    "train.lora_rank": Range(1, 65536),
    "train.lora_alpha": Range(1, 2**20),
    "train.lora_dropout": Range(0, 1, hi_open=True),
    "infer.max_new_tokens": Range(1, 2**21),
    "infer.temperature": Range(0, 100),
    "infer.top_p": Range(0, 1, lo_open=True),
    "infer.batch_size": Range(1, 4096),
    "infer.precision": Choice(PRECISIONS),
    "infer.seed": Range(0, 2**63 - 1),
    "infer.backend": Choice(INFER_BACKENDS),
    "max_restarts": Range(0, 100),
}
STRING_MAX = {"name": 256, "train.text_field": 256, "infer.backend_reason": 1024}
LIST_MAX = {"gpus": 4096, "train.dataset": 1024, "train.lora_targets": 1024, "infer.prompts": 100_000, "script": 10_000}
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_MAX = 1024
ENV_VALUE_MAX = 128 * 1024
PROMPT_MAX = 1024 * 1024


def check_job_settings(spec: Any) -> None:
    """Raise a one-line UserError for the first setting of a JobSpec outside its allowed values."""
    for section in ("train", "infer"):
        part = getattr(spec, section, None)
        if part is None or not is_dataclass(part):
            continue
        for f in fields(part):
            key = f"{section}.{f.name}"
            value = getattr(part, f.name)
            _check_value(key, value)
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
        _check_value("max_restarts", restarts)
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


def _check_value(key: str, value: Any) -> None:
    limit = LIMITS.get(key)
    if limit is None or value is None:
        return
    if isinstance(limit, Range) and isinstance(value, bool):
        return  # type checks are the protocol's; a bool here is already refused there
    if not limit.holds(value):
        shown = value if not isinstance(value, str) else repr(value[:60])
        if isinstance(value, int) and abs(value) >= 10**12:
            shown = f"{value:.3g}"
        raise UserError(f"{key.replace('.', ' setting ', 1)}={shown}: must be {limit.text()}")
