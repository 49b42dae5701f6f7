"""Reading dataset records, shared by the job wizard (to check and preview files) and the workers (to train).

Torch-free on purpose: the GUI must not import torch, and both sides must
agree on what a valid record is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError

Messages = list[dict[str, str]]


@dataclass
class Document:
    """One training document: plain text, or a conversation to render with the chat template."""

    text: str | None = None
    messages: Messages | None = None


def parse_record(rec: Any, text_field: str) -> Document:
    """One JSONL record as a document; ValueError says what is wrong with it."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        msgs = rec["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise ValueError("'messages' must be a non-empty list of {role, content} strings")
        return Document(messages=[{"role": m["role"], "content": m["content"]} for m in msgs])
    if "instruction" in rec:
        prompt = str(rec["instruction"])
        if rec.get("input"):
            prompt += "\n" + str(rec["input"])
        return Document(
            messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": str(rec.get("output", ""))}]
        )
    if isinstance(rec.get(text_field), str):
        return Document(text=rec[text_field])
    raise ValueError(
        f"no '{text_field}' text field, 'messages' list or 'instruction' (fields: {', '.join(sorted(rec)[:8])})"
    )


def record_document(path: Path, line: int, rec: Any, text_field: str) -> Document:
    try:
        return parse_record(rec, text_field)
    except ValueError as e:
        raise UserError(f"dataset {path} line {line}: {e}") from None
