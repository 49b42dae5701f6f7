"""Errors that are the user's to fix, as opposed to bugs.

The CLI prints a `UserError` as one line and exits 2; the engine service sends
it back as an error reply; the GUI shows it in place. Anything else is a bug
and keeps its traceback.

A `UserError` carries a `reason` (a snake_case code saying which refusal it is,
such as "out_of_range") and `fields` (JSON values: the setting, the limit, the
value given) beside its line, so a client decides what to do and how to word it
from those, never by reading the sentence.
"""

from __future__ import annotations

import json
from typing import Any

GENERIC = "user_error"  # the reason of a refusal that has no code of its own yet


class UserError(Exception):
    """Bad input: an unknown profile or model, an unreadable file, a contradictory flag."""

    def __init__(self, message: str = "", *args: Any, reason: str = GENERIC, **fields: Any) -> None:
        super().__init__(message, *args)
        self.reason = reason
        self.fields: dict[str, Any] = fields


def jsonable(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` as JSON carries them: one that JSON cannot (a Path, an enum, a NaN) goes as its text rather
    than failing the whole reply or record."""
    try:
        return json.loads(json.dumps(fields, default=str, allow_nan=False)) if fields else {}
    except ValueError:
        return {k: v if isinstance(v, str | int | bool | None) else str(v) for k, v in fields.items()}
