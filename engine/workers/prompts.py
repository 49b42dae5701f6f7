"""Prompts as the user gives them: a JSONL file of {"prompt": ...} records and prompts given one by one.

Torch-free, so that a client (`rigpilot compare-models`) reads and checks them as an inference job does
before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

from rigpilot.engine.errors import UserError


def read_prompts(prompts_file: str | None, given: list[str]) -> list[str]:
    """The file's prompts, then the given ones; refused in one line where the file is unreadable, a line is
    not a prompt record, a prompt is blank, or there are none."""
    prompts: list[str] = []
    if prompts_file:
        path = Path(prompts_file).expanduser()
        if not path.is_file():
            raise UserError(f"prompts file {path} not found", reason="prompts_file_invalid", path=str(path))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"prompts file {path} line {n}: not valid JSON ({e.msg})", reason="prompts_file_invalid",
                                path=str(path), line=n) from e  # fmt: skip
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise UserError(f'prompts file {path} line {n}: needs a "prompt" string', reason="prompts_file_invalid",
                                path=str(path), line=n)  # fmt: skip
            prompts.append(rec["prompt"])
    prompts.extend(given)
    if any(not p.strip() for p in prompts):
        raise UserError("an empty prompt: every prompt needs some text to continue", reason="empty_prompt")
    if not prompts:
        raise UserError('no prompts: give infer.prompts or a prompts_file (JSONL with a "prompt" field)',
                        reason="no_prompts")  # fmt: skip
    return prompts
