"""What the command line takes, checked once: argparse types and JSON files the user names."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import open_given_file, shown


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def positive_int(text: str) -> int:
    v = _whole(text)
    if v < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return v


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return v


def positive_float(text: str) -> float:
    v = _finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return v


JSON_FILE_MAX = 64 << 20  # a plan or a calibration is kilobytes; far more is not one


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path`, or a UserError naming `what` it was meant to be.

    The path is checked first (engine.given_path): a FIFO or a name past NAME_MAX is refused, not opened.
    """
    try:
        with open_given_file(path, what) as f:
            raw = f.read(JSON_FILE_MAX + 1)
        if len(raw) > JSON_FILE_MAX:
            raise UserError(f"{what} {shown(path)} is larger than {JSON_FILE_MAX >> 20} MiB; it cannot be a {what}")
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {what} {shown(path)}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} must hold a JSON object")
    return data
