"""What is in a data file: its format, the first records, a token estimate, or what is wrong with it.

A work function for a background task, reading only the head of each file. It
follows the rules the training workers apply (engine/workers/data.py): a text
file is one document; a JSONL line is a chat (`messages`), an instruction
(`instruction`, `input`, `output`) or a record with a text field. Token counts
are an estimate, bytes ÷ 4 (about right for English with a BPE tokenizer).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigpilot.engine.given_path import MISSING, NOT_A_FILE, PathRefused, check_given_path, open_given_file
from rigpilot.engine.jobspec.datasets import parse_record

TEXT_SUFFIXES = {".txt", ".md", ".text"}
JSONL_SUFFIXES = {".jsonl", ".json", ".ndjson"}
HEAD_BYTES = 64 * 1024
WHOLE_JSON_BYTES = 8 * 1024 * 1024  # a .json array is read whole up to this size
PREVIEW_RECORDS = 5
PREVIEW_CHARS = 160
BYTES_PER_TOKEN = 4

TEXT, JSONL_TEXT, INSTRUCTION, CHAT, PROMPTS = "text", "jsonl-text", "instruction", "chat", "prompts"
FORMAT_NAMES = {
    TEXT: "plain text",
    JSONL_TEXT: "JSONL with a text field",
    INSTRUCTION: "instruction JSONL (instruction, input, output)",
    CHAT: "chat JSONL (messages)",
    PROMPTS: "prompts JSONL",
}


@dataclass
class FileReport:
    path: str
    size: int = 0
    kind: str = ""  # TEXT, JSONL_TEXT, INSTRUCTION, CHAT, PROMPTS; "" when unreadable
    preview: list[str] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)  # string fields of the first JSON record
    problem: str | None = None

    @property
    def format(self) -> str:
        return FORMAT_NAMES.get(self.kind, "unknown")


@dataclass
class DataReport:
    files: list[FileReport]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def token_estimate(self) -> int:
        return self.total_bytes // BYTES_PER_TOKEN

    @property
    def problem(self) -> str | None:
        return next((f.problem for f in self.files if f.problem), None)

    @property
    def fields(self) -> list[str]:
        """String fields seen in the JSONL files, to offer as the text field."""
        seen: list[str] = []
        for f in self.files:
            seen += [k for k in f.fields if k not in seen]
        return seen


def inspect_dataset(paths: list[str], text_field: str = "text") -> DataReport:
    if not paths:
        return DataReport([FileReport("", problem="Add at least one data file (.txt or .jsonl).")])
    return DataReport([inspect_file(p, text_field) for p in paths])


def inspect_prompts(path: str) -> DataReport:
    return DataReport([inspect_file(path, "prompt", prompts=True)])


def inspect_file(path: str, text_field: str = "text", *, prompts: bool = False) -> FileReport:
    report = FileReport(path)
    name = Path(path).name
    try:
        p = check_given_path(path, "prompts file" if prompts else "data file")
    except PathRefused as e:
        friendlier = {MISSING: f"{name}: the file does not exist.", NOT_A_FILE: f"{name} is a folder; choose the files inside it."}
        report.problem = friendlier.get(e.problem, f"{e}.")
        return report
    report.path = str(p)
    suffix = p.suffix.lower()
    allowed = JSONL_SUFFIXES if prompts else TEXT_SUFFIXES | JSONL_SUFFIXES
    if suffix not in allowed:
        report.problem = f"{p.name}: {suffix or 'no suffix'} is not supported; use " + (
            '.jsonl with a "prompt" field.' if prompts else ".txt or .jsonl."
        )
        return report
    try:
        with open_given_file(p, "data file") as f:
            report.size = os.fstat(f.fileno()).st_size
            head = f.read(HEAD_BYTES if not (suffix == ".json" and report.size <= WHOLE_JSON_BYTES) else None)
    except OSError as e:
        report.problem = f"{p.name}: cannot read it ({e.strerror or e})."
        return report
    except PathRefused as e:  # swapped for a FIFO since it was checked
        report.problem = f"{e}."
        return report
    whole = len(head) >= report.size
    text = _decode(head, whole)
    if text is None:
        report.problem = f"{p.name} is not UTF-8 text."
        return report
    if not text.strip():
        report.problem = f"{p.name} is empty."
        return report
    if suffix in TEXT_SUFFIXES:
        report.kind = TEXT
        report.preview = [_clip(line) for line in text.splitlines() if line.strip()][:PREVIEW_RECORDS]
        return report
    _inspect_json(report, text, whole, text_field, prompts)
    return report


def _decode(head: bytes, whole: bool) -> str | None:
    try:
        return head.decode("utf-8")
    except UnicodeDecodeError as e:
        # The head may end inside a multi-byte character; that is not the file's fault.
        if not whole and e.start >= len(head) - 3:
            return head[: e.start].decode("utf-8", errors="strict")
        return None


def _inspect_json(report: FileReport, text: str, whole: bool, text_field: str, prompts: bool) -> None:
    name = Path(report.path).name
    records: list[tuple[int, Any]] = []
    if text.lstrip().startswith("[") and whole:
        try:
            records = list(enumerate(json.loads(text), start=1))[:PREVIEW_RECORDS]
        except ValueError as e:
            report.problem = f"{name} is not valid JSON ({e})."
            return
    else:
        lines = text.splitlines()
        if not whole and lines:
            lines = lines[:-1]  # the last line of the head may be cut short
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append((n, json.loads(line)))
            except ValueError as e:
                report.problem = f"{name} line {n} is not valid JSON ({getattr(e, 'msg', e)})."
                return
            if len(records) >= PREVIEW_RECORDS:
                break
    if not records:
        report.problem = f"{name} has no records."
        return
    first = records[0][1]
    if isinstance(first, dict):
        report.fields = [k for k, v in first.items() if isinstance(v, str)]
    kinds = []
    for n, rec in records:
        kind, preview, problem = _classify(rec, text_field, prompts)
        if problem:
            report.problem = f"{name} line {n}: {problem}"
            return
        kinds.append(kind)
        report.preview.append(preview)
    report.kind = kinds[0]


def _classify(rec: Any, text_field: str, prompts: bool) -> tuple[str, str, str | None]:
    if prompts:
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            return PROMPTS, _clip(rec["prompt"]), None
        fields = ", ".join(sorted(rec)[:8]) if isinstance(rec, dict) else type(rec).__name__
        return "", "", f'no "prompt" field (fields: {fields}).'
    # The workers' own reader decides what is valid, so the wizard never accepts a file a job would refuse.
    try:
        doc = parse_record(rec, text_field)
    except ValueError as e:
        hint = "; choose the text field." if isinstance(rec, dict) and "messages" not in rec else "."
        return "", "", f"{e}{hint}"
    if doc.text is not None:
        return JSONL_TEXT, _clip(doc.text), None
    kind = INSTRUCTION if "instruction" in rec else CHAT
    return kind, _clip("  ".join(f"{m['role']}: {m['content']}" for m in doc.messages or [])), None


def _clip(text: str) -> str:
    one = " ".join(str(text).split())
    return one if len(one) <= PREVIEW_CHARS else one[: PREVIEW_CHARS - 1] + "…"


def tokens_text(n: int) -> str:
    """'≈ 12k tokens (estimate: bytes ÷ 4)'."""
    if n >= 1_000_000_000:
        amount = f"{n / 1e9:.1f}B"
    elif n >= 1_000_000:
        amount = f"{n / 1e6:.1f}M"
    elif n >= 10_000:
        amount = f"{n / 1000:.0f}k"
    else:
        amount = f"{n:,}"
    return f"≈ {amount} tokens (an estimate: bytes ÷ 4; the real count depends on the tokenizer)"
