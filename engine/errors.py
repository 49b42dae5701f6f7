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

from typing import Any

GENERIC = "user_error"  # the reason of a refusal that has no code of its own yet


class UserError(Exception):
    """Bad input: an unknown profile or model, an unreadable file, a contradictory flag."""

    def __init__(self, message: str = "", *args: Any, reason: str = GENERIC, **fields: Any) -> None:
        super().__init__(message, *args)
        self.reason = reason
        self.fields: dict[str, Any] = fields
