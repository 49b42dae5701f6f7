"""Which job environment values are secrets, and how they are shown and stored: masked.

A job's `env` is written to job.json and shown by every view; a secret's value
never is. The engine keeps secrets in memory and hands them to the ranks'
environment only; job.json holds `MASK` in their place. A value is a secret
when its name looks like one (HF_TOKEN, WANDB_API_KEY, DB_PASSWORD, ...) or the
value itself has a well-known token prefix (hf_..., sk-..., ghp_...).

A job resumed after the engine restarted has lost them: the user gives them
again (`rigpilot resume JOB --env NAME=VALUE`) or keeps them in
`secrets_file()`, a NAME=VALUE file readable by its owner only (0600).

Plain Python: the workers import MASK to leave masked names alone.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

MASK = "••••"
# Name parts that say "secret"; PWD (the working directory) and similar are deliberately absent.
_SECRET_PARTS = {"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "APIKEY",
                 "AUTH", "PAT", "COOKIE"}  # fmt: skip
_SECRET_SUBSTRINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "API_KEY", "ACCESS_KEY", "PRIVATE_KEY")
_SECRET_VALUE = re.compile(r"^(hf_|sk-|sk_live_|ghp_|gho_|ghs_|github_pat_|glpat-|xox[abprs]-|AKIA|ASIA|AIza)\w")


def is_secret(name: str, value: str = "") -> bool:
    upper = name.upper()
    if any(s in upper for s in _SECRET_SUBSTRINGS):
        return True
    if set(re.split(r"[^A-Z0-9]+", upper)) & _SECRET_PARTS:
        return True
    return bool(_SECRET_VALUE.match(value or ""))


def split(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(env as it may be stored and shown, with secrets masked; the secrets themselves)."""
    shown, hidden = {}, {}
    for name, value in env.items():
        if value == MASK:
            shown[name] = MASK  # already masked (a cloned job): the caller must find the value
        elif is_secret(name, value):
            shown[name], hidden[name] = MASK, value
        else:
            shown[name] = value
    return shown, hidden


def masked_names(env: dict[str, str]) -> list[str]:
    return [name for name, value in env.items() if value == MASK]


def secrets_file() -> Path:
    from rigpilot.engine.settings import config_dir

    return config_dir() / "secrets.env"


def read_secrets_file(path: Path | None = None) -> dict[str, str]:
    """NAME=VALUE lines from the user's secrets file; {} when there is none.

    A file others could read is refused (ValueError): a secret there has already leaked.
    """
    path = path or secrets_file()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"{path} must be yours and private: chmod 600 {path}")
        text = f.read(1 << 20)
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.removeprefix("export ").partition("=")
        if sep and name.strip():
            out[name.strip()] = value.strip().strip("'\"")
    return out
