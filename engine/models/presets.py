"""Model presets: public models whose config.json ships with Rigpilot (resources/model_presets.json).

A preset plans without network or weights; its counts come from the same
formulas as any config.json, and `params_total` in the file records the
exact count the tests hold those formulas to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

from rigpilot import resources


@dataclass(frozen=True)
class Preset:
    name: str  # what the user types: "llama-3.1-8b"
    repo_id: str  # the Hugging Face repo the config comes from
    params_total: int
    config: dict[str, Any]


@cache
def _load() -> dict[str, Preset]:
    doc = json.loads(resources.path("model_presets.json").read_text())
    return {name: Preset(name, p["repo_id"], int(p["params_total"]), p["config"]) for name, p in doc["presets"].items()}


def list_presets() -> list[Preset]:
    """Every preset, in the file's order (families together, small to large)."""
    return list(_load().values())


def find_preset(ref: str) -> Preset | None:
    """The preset named `ref` (case-insensitive), or None."""
    return _load().get(ref.strip().lower())


def preset_for_repo(repo_id: str) -> Preset | None:
    """The preset whose config came from `repo_id`, to answer offline for a model the user named by repo."""
    wanted = repo_id.strip().lower()
    return next((p for p in _load().values() if p.repo_id.lower() == wanted), None)
