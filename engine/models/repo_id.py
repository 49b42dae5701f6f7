"""Whether a model name can be a Hugging Face repo id, from its spelling alone (no network, no huggingface_hub).

A name that is no preset and no local path is taken for a repo id that a worker fetches later; one
the hub could never hold is refused now, in one line, rather than by a job that fails after queueing.
The rules are the hub's own (huggingface_hub.utils.validate_repo_id): `name` or `namespace/name`,
each of ASCII letters, digits, '-', '_' and '.', at most 96 characters, no '--' or '..', not
starting or ending with '-' or '.', and not ending in '.git'.
"""

from __future__ import annotations

import re

REPO_NAME_MAX = 96
_PART = re.compile(r"[A-Za-z0-9_.-]+")


def repo_id_problem(ref: str) -> str | None:
    """Why `ref` cannot be a Hugging Face repo id, or None when it can."""
    parts = ref.split("/")
    if len(parts) > 2:
        return "a repo id has at most one '/' (namespace/name)"
    for part in parts:
        if not part:
            return "a repo id has no empty namespace or name"
        if len(part) > REPO_NAME_MAX:
            return f"a repo id's namespace and name have at most {REPO_NAME_MAX} characters, not {len(part)}"
        if not _PART.fullmatch(part):
            return "a repo id holds only ASCII letters, digits, '-', '_' and '.'"
        if "--" in part or ".." in part or part[0] in "-." or part[-1] in "-.":
            return "a repo id has no '--' or '..' and does not start or end with '-' or '.'"
    if ref.endswith(".git"):
        return "a repo id does not end in '.git'"
    return None
