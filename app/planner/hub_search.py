"""Finding a model by name: the Hugging Face hub when it can be reached, the local cache and presets always.

Work functions for a background task; nothing here touches a widget. The hub
is asked only after a quick reachability check, because huggingface_hub
retries an unreachable hub with back-off for about half a minute.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rigpilot.engine.models.presets import list_presets

HUB_LIMIT = 20
_TRUE = {"1", "true", "yes", "on"}


@dataclass
class HubResults:
    query: str
    hub: list[str] = field(default_factory=list)  # repo ids the hub returned, most downloaded first
    cached: list[str] = field(default_factory=list)  # repo ids in the local Hugging Face cache that match
    presets: list[str] = field(default_factory=list)  # preset names that match
    message: str = ""  # why the hub was not asked or did not answer; empty when it answered
    offline: bool = False


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as set since (a test, a user's shell)."""
    # Imported here: huggingface_hub's client costs a third of a second, which the app's start-up should not pay.
    from rigpilot.engine.models import hub

    return hub.offline() or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cached_models(query: str = "") -> list[str]:
    """Model repos in the local Hugging Face cache whose id contains `query` (case-insensitive)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except (CacheNotFound, OSError, ValueError):
        return []  # no cache yet is the same as an empty one
    q = query.strip().lower()
    return sorted(r.repo_id for r in info.repos if r.repo_type == "model" and q in r.repo_id.lower())


def matching_presets(query: str = "") -> list[str]:
    q = query.strip().lower()
    return [p.name for p in list_presets() if q in p.name or q in p.repo_id.lower()]


def search_hub(
    query: str,
    limit: int = HUB_LIMIT,
    *,
    list_models: Callable[..., Any] | None = None,
    reachable: Callable[[], bool] | None = None,
) -> HubResults:
    """Hub, cache and preset matches for `query`; when the hub cannot be asked, `message` says why."""
    out = HubResults(query=query, cached=cached_models(query), presets=matching_presets(query))
    if hub_offline():
        out.offline = True
        out.message = "Offline (HF_HUB_OFFLINE is set): showing presets and models in the local Hugging Face cache."
        return out
    from rigpilot.engine.models import hub

    if not (reachable or hub.reachable)():
        out.offline = True
        out.message = "The Hugging Face hub cannot be reached: showing presets and models in the local cache."
        return out
    if list_models is None:
        from huggingface_hub import HfApi

        list_models = HfApi().list_models
    try:
        found = list_models(search=query.strip() or None, limit=limit, sort="downloads")
        out.hub = [m.id for m in found][:limit]
    except Exception as e:  # any hub failure (HTTP, timeout, auth) leaves the cache and presets to choose from
        out.offline = True
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        out.message = f"The Hugging Face hub did not answer ({first}): showing presets and cached models."
    return out
