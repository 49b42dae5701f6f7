"""Read a model's config.json, turning every way it can be broken into one clear line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: corrupt config.json ({e})") from e
    if not isinstance(config, dict):
        raise UserError(f"{path}: corrupt config.json (not a JSON object)")
    return config
