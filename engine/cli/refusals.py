"""The command line's words for a refusal that names a setting: its flag and value, as the user typed them.

The engine and the planner refuse with a code and fields (engine.errors.UserError: `setting`, `value`, and
`lo`/`hi`, `choices` or `other`/`needs`/`found`); the GUI words the same facts with its controls' labels.
A refusal without a declared setting, or of a setting with no flag, keeps the engine's sentence.
"""

from __future__ import annotations

from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import INFER_SETTINGS, SETTINGS, TRAIN_SETTINGS
from rigpilot.engine.layout import LAYOUT_SETTINGS
from rigpilot.engine.schema import Setting, command_text, flag_phrase, shown_value


def declared(key: Any) -> Setting | None:
    """The declaration a refusal's `setting` names: a full key ("train.seq_len") or a planner's bare name."""
    if not isinstance(key, str):
        return None
    layout = {s.key: s for s in LAYOUT_SETTINGS.values()}
    return SETTINGS.get(key) or layout.get(key) or TRAIN_SETTINGS.get(key) or INFER_SETTINGS.get(key)


def words(error: UserError) -> str:
    fields = getattr(error, "fields", None) or {}
    decl = declared(fields.get("setting"))
    if decl is None or decl.flag is None or "value" not in fields:
        return str(error)
    given = f"{decl.flag} {command_text(fields['value'])}"
    reason = getattr(error, "reason", "")
    if reason == "conflicting_settings":
        other = declared(fields.get("other"))
        if other is not None and other.flag is not None:
            # A switch reads as its flag ("--fp8 needs --precision bf16"), never "--fp8 True".
            found = fields.get("found")
            found_text = shown_value(other, found) if isinstance(found, bool) else found
            return (
                f"{flag_phrase(decl, fields['value'])} needs {flag_phrase(other, fields.get('needs'))} "
                f"(it is {found_text})"
            )
    if reason in ("out_of_range", "not_a_choice") and decl.bound is not None:
        return f"{given}: must be {decl.bound.text()}"
    return str(error)
