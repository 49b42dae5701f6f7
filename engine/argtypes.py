"""What the command line takes, checked once: argparse types and JSON files the user names."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engine.errors import UserError


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return v


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path`, or a UserError naming `what` it was meant to be."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {what} {path}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} must hold a JSON object")
    return data
