"""Read a model's config.json, turning every way it can be broken into one clear line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import open_given_file

CONFIG_MAX = 16 << 20  # a config.json is kilobytes; a larger file is not one


def read_config(path: Path) -> dict[str, Any]:
    try:
        with open_given_file(path, "model config") as f:
            raw = f.read(CONFIG_MAX + 1)
        if len(raw) > CONFIG_MAX:
            raise UserError(f"{path}: larger than {CONFIG_MAX >> 20} MiB, too large to be a config.json")
        config = json.loads(raw)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: corrupt config.json ({e})") from e
    if not isinstance(config, dict):
        raise UserError(f"{path}: corrupt config.json (not a JSON object)")
    return config
