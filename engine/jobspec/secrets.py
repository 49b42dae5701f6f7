"""Which job environment values are secrets, and how they are shown and stored: masked.

A job's `env` is written to job.json and shown by every view; a secret never
is. The engine keeps secrets in memory and hands them to the ranks'
environment only; job.json holds `MASK` in their place. This module is the one
rule for that, used wherever env reaches job.json, a log or a message (submit,
resume --env, the SLURM refusal, the CLI's own errors):

- a value is wholly secret when its name says so (HF_TOKEN, WANDB_API_KEY,
  DB_PASSWORD, MY_PW, PGPASS, AWS_CREDENTIALS, BASIC_AUTH, dbPassword, ...) or
  the value itself looks like one (a well-known token prefix such as hf_...,
  sk-..., ghp_...; an Authorization header; a JWT; a PEM private key);
- otherwise the credentials inside it are masked and the rest stays readable:
  the password of a URL (postgres://user:••••@host/db), a token-like URL user
  (https://••••@github.com/...), and `name=value` pairs whose name says secret
  (?token=••••, Password=••••; in a connection string, --api-key=••••).

Either way the real value is kept apart (`split`), and a masked value is any
value holding MASK (`is_masked`). A job resumed after the engine restarted has
lost them: the user gives them again (`rigpilot resume JOB --env NAME=VALUE`)
or keeps them in `secrets_file()`, a NAME=VALUE file readable by its owner only
(0600).

Plain Python: the workers import `plain` to leave masked names alone.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from rigpilot.engine.errors import UserError

MASK = "••••"
# Words of a name that say "secret". PWD alone is the shell's working folder (see _NOT_SECRET_NAMES).
_SECRET_WORDS = {
    "TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "PASS", "PW", "PWD", "CREDENTIAL", "CREDENTIALS",
    "CRED", "CREDS", "APIKEY", "AUTH", "AUTHORIZATION", "BEARER", "PAT", "COOKIE", "SIGNATURE", "SIG",
}  # fmt: skip
_NOT_SECRET_NAMES = {"PWD", "OLDPWD"}  # the shell's working folders
# Secret words glued to others: GITHUB_ACCESS_TOKEN, AWSSECRET, SSHPASS, PGPASS, MYAUTH.
_SECRET_SUBSTRINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY", "API_KEY", "ACCESS_KEY",
                      "PRIVATE_KEY", "CREDENTIAL")  # fmt: skip
_SECRET_SUFFIXES = ("PASS", "PW", "PWD", "AUTH", "CREDS")
_SECRET_VALUE = re.compile(
    r"^(?:hf_|sk-|sk_live_|rk_live_|ghp_|gho_|ghs_|ghu_|github_pat_|glpat-|xox[abprs]-|AKIA|ASIA|AIza|npm_|pypi-)\w"
    r"|^(?:Bearer|Basic|Token)\s+\S"  # an Authorization header's value
    r"|^eyJ[\w-]+\.[\w-]+\."  # a JSON Web Token
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
)
_URL_AUTHORITY = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<authority>[^/?#\s]*)")
_PAIR = re.compile(r"(?<![\w.])(?P<name>[A-Za-z_][\w.-]*)=(?P<value>[^&;\s]*)")
_TOKEN_LIKE_USER = 16  # a URL user this long, with no password, is a token (https://TOKEN@github.com)


def _words(name: str) -> list[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)  # dbPassword -> db_Password
    return [w for w in re.split(r"[^A-Z0-9]+", spaced.upper()) if w]


def secret_name(name: str) -> bool:
    """Whether a variable (or parameter) of this name holds a secret, whatever its value."""
    upper = name.upper()
    if upper in _NOT_SECRET_NAMES:
        return False
    if any(s in upper for s in _SECRET_SUBSTRINGS):
        return True
    words = _words(name)
    if set(words) & _SECRET_WORDS:
        return True
    return bool(words) and words[-1].endswith(_SECRET_SUFFIXES)


def is_secret(name: str, value: str = "") -> bool:
    """Whether the whole value is secret: by its name, or by what the value itself looks like."""
    return secret_name(name) or bool(_SECRET_VALUE.search(value or ""))


def mask_credentials(value: str) -> str:
    """`value` with the credentials inside it replaced by MASK (URL passwords and token users, secret pairs)."""
    if _SECRET_VALUE.search(value):
        return MASK
    out = _URL_AUTHORITY.sub(_mask_userinfo, value)
    return _PAIR.sub(lambda m: f"{m['name']}={MASK}" if m["value"] and secret_name(m["name"]) else m[0], out)


def _mask_userinfo(m: re.Match[str]) -> str:
    userinfo, at, host = m["authority"].rpartition("@")
    if not at or not userinfo:
        return m[0]
    user, colon, password = userinfo.partition(":")
    if colon and password:
        userinfo = f"{user}:{MASK}"
    elif not colon and (len(user) >= _TOKEN_LIKE_USER or _SECRET_VALUE.search(user)):
        userinfo = MASK
    return f"{m['scheme']}{userinfo}@{host}"


def is_masked(value: str) -> bool:
    """Whether a stored value had a secret masked out of it: the real one must come from elsewhere."""
    return MASK in value


def split(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(env as it may be stored and shown, with secrets masked; the secrets themselves, whole)."""
    shown, hidden = {}, {}
    for name, value in env.items():
        if is_masked(value):
            shown[name] = value  # already masked (a cloned job): the caller must find the value
        elif is_secret(name, value):
            shown[name], hidden[name] = MASK, value
        else:
            masked = mask_credentials(value)
            shown[name] = masked
            if masked != value:
                hidden[name] = value
    return shown, hidden


def masked_names(env: dict[str, str]) -> list[str]:
    return [name for name, value in env.items() if is_masked(value)]


def plain(env: dict[str, str]) -> dict[str, str]:
    """The values of a stored env that are real, without the masked ones (their values come from elsewhere)."""
    return {name: value for name, value in env.items() if not is_masked(value)}


def shown_text(text: str) -> str:
    """Free text a user typed where an env entry was expected (an error message quotes it), secrets masked."""
    name, sep, value = text.partition("=")
    if sep and is_secret(name, value):
        return f"{name}={MASK}"
    return mask_credentials(text)


def secrets_file() -> Path:
    from rigpilot.engine.settings import config_dir

    return config_dir() / "secrets.env"


def read_secrets_file(path: Path | None = None) -> dict[str, str]:
    """NAME=VALUE lines from the user's secrets file; {} when there is none.

    A file others could read is refused (ValueError): a secret there has already leaked. So is
    anything but a regular file, before it is read: a FIFO would block the engine forever.
    """
    path = path or secrets_file()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} must be a regular file holding NAME=VALUE lines")
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"{path} must be yours and private: chmod 600 {path}")
        os.set_blocking(fd, True)
        text = f.read(1 << 20).decode("utf-8", errors="replace")
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.removeprefix("export ").partition("=")
        if sep and name.strip():
            out[name.strip()] = value.strip().strip("'\"")
    return out


def find_secrets(names: list[str], known: dict[str, str], how: str) -> dict[str, str]:
    """The values of the masked `names`: from `known` (the engine's memory, or given now), else the user's
    secrets file. A name found in neither raises UserError saying `how` to give it again."""
    found = {n: known[n] for n in names if n in known}
    lacking = [n for n in names if n not in found]
    if lacking:
        try:
            from_file = read_secrets_file()
        except ValueError as e:
            raise UserError(f"secrets file refused: {e}") from None
        found.update({n: from_file[n] for n in lacking if n in from_file})
        lacking = [n for n in lacking if n not in found]
    if lacking:
        names_text = ", ".join(lacking)
        raise UserError(
            f"the job needs {names_text} again (secrets are kept in the engine's memory only, not on disk): "
            f"{how}, or keep them in {secrets_file()} (chmod 600)"
        )
    return found
