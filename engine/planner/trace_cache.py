"""Traced memory of plans, kept on disk: a plan traced once is verified at once the next time it is planned.

A trace (engine.workers.memtrace) takes seconds; its answer depends only on what the tracer reads, so it is
kept under a key made of exactly that: the model's config (its bytes), the plan's layout, shapes and method
(Parallelism and Workload, LoRA settings with them), the recipe as a whole (`Recipe.to_dict()`, so a recipe
setting added later keys the cache without a change here), the versions of torch, transformers and peft the
tracer imports, and the tracer's own code. A plan whose config cannot be read here (a hub id not in the local
cache) or that runs the model's own code (trust_remote_code) is not cached: what it traces could change
without its key changing.

Entries are JSON files (never pickle) in a 0700 folder under the user's cache dir, each 0600 and written
atomically; the folder keeps at most `MAX_ENTRIES` (the oldest go first). A damaged entry is a miss and is
removed, never an error. RIGPILOT_TRACE_CACHE names another folder, or "off".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.planner.plan import Plan
from rigpilot.engine.recipe import Recipe

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

ENV_CACHE = "RIGPILOT_TRACE_CACHE"  # a folder, or "off"
MAX_ENTRIES = 512  # a few MB of JSON: thousands of plans' worth is more than any user replans
FORMAT = 1  # of an entry; bump when the answer's fields change meaning
# The tracer's code: a change to any of these may change what it measures, so it keys the cache.
# Every module of engine/workers (the recipe's modules run in the trace too), and these beside them.
TRACER_SOURCES = ("../planner/traceable.py", "../planner/plan.py", "../accuracy/cuda_autocast.py", "../recipe.py")
_STACK = ("torch", "transformers", "peft", "torchao")
_ENTRY = re.compile(r"^[0-9a-f]{64}\.json$")


def folder() -> Path | None:
    """Where entries live; None when the cache is off."""
    chosen = os.environ.get(ENV_CACHE, "").strip()
    if chosen.lower() in {"off", "0", "no", "false"}:
        return None
    if chosen:
        # A folder of Rigpilot's own inside the one chosen: its mode is set and its entries evicted, never the
        # chosen folder's or its other files.
        return Path(chosen).expanduser() / "rigpilot-traces"
    from rigpilot.engine.settings import cache_dir

    return cache_dir() / "traces"


def key(plan: Plan, *, python: str, trust_remote_code: bool = False) -> str | None:
    """The cache key of `plan`'s trace by the tracer that `python` runs; None when it must not be cached."""
    if trust_remote_code:
        return None
    config = config_digest(plan.workload.model)
    stack = stack_versions(python)
    if config is None or stack is None:
        return None
    workload = dataclasses.asdict(plan.workload)
    workload.pop("model")  # the config's bytes stand for it: the same model under another path is the same trace
    workload.pop("token_budget", None)  # how long it trains, not what one step holds
    parallelism = dataclasses.asdict(plan.parallelism)
    parallelism.pop("gpu_indices")  # which GPUs, not how many: the trace is of one rank
    parallelism.pop("internode", None)
    what = {
        "format": FORMAT,
        "config": config,
        "workload": workload,
        "recipe": Recipe.of(plan.workload).to_dict(),
        "parallelism": parallelism,
        "stack": stack,
        "tracer": tracer_digest(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def load(entry: str | None) -> dict[str, Any] | None:
    """The traced answer stored under `entry`, or None (absent, unreadable or damaged: a damaged one is removed)."""
    where = folder()
    if entry is None or where is None:
        return None
    if not _ours(where) or stat.S_IMODE(where.lstat().st_mode) & 0o022:
        return None  # another's folder, or one others may write to: not to be believed (the next write tightens it)
    path = where / f"{entry}.json"
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.info("trace cache: %s is damaged (%s); traced again", path.name, e)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    answer = doc.get("answer") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("key") == entry and isinstance(answer, dict) and _sound(answer)):
        log.info("trace cache: %s does not hold a traced answer; traced again", path.name)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: evicted last
    return dict(answer)


def store(entry: str | None, answer: dict[str, Any]) -> None:
    """Keep a traced answer (only a successful one) under `entry`; a cache that cannot be written is skipped."""
    where = folder()
    if entry is None or where is None or not _sound(answer):
        return
    try:
        _private_folder(where)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".", suffix=".tmp")  # 0600, a name of its own
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"key": entry, "answer": answer}, f, separators=(",", ":"))
            os.replace(tmp, where / f"{entry}.json")  # atomic: a reader sees the whole entry or none
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _evict(where)
    except OSError as e:
        log.info("trace cache: not kept in %s (%s)", where, e.strerror or e)


def _sound(answer: Any) -> bool:
    return (
        isinstance(answer, dict)
        and answer.get("ok") is True
        and isinstance(answer.get("peak"), int)
        and not isinstance(answer.get("peak"), bool)
        and answer["peak"] >= 0
        and isinstance(answer.get("stages") or {}, dict)
    )


def _private_folder(where: Path) -> None:
    where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # Rigpilot's cache folder too, when it is new
    where.mkdir(mode=0o700, exist_ok=True)
    if not _ours(where):
        raise OSError(f"{where} is not a folder of this user's")
    if stat.S_IMODE(where.lstat().st_mode) & 0o077:
        os.chmod(where, 0o700)


def _ours(where: Path) -> bool:
    """A folder of this user's (not a link), which no one else may write to: entries there are believed."""
    try:
        st = where.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _evict(where: Path, keep: int | None = None) -> None:
    """At most `keep` entries (MAX_ENTRIES): the least recently used go; leftovers of a crashed write too."""
    limit = MAX_ENTRIES if keep is None else keep
    entries: list[tuple[float, Path]] = []
    now = time.time()
    for path in where.iterdir():
        with contextlib.suppress(OSError):
            if _ENTRY.match(path.name):
                entries.append((path.stat().st_mtime, path))
            elif path.name.startswith(".") and path.name.endswith(".tmp") and now - path.stat().st_mtime > 3600:
                path.unlink()  # a crashed write's leftover
    entries.sort()
    for _, path in entries[: max(len(entries) - limit, 0)]:
        with contextlib.suppress(OSError):
            path.unlink()


# -- what the key is made of ---------------------------------------------------------------------------


def config_digest(model: str) -> str | None:
    """sha256 of the config the tracer builds `model` from: a local config.json, the Hugging Face cache's copy of
    a hub model's, or a preset's own; None when there is none here."""
    ref = model.strip()
    path = Path(ref).expanduser()
    candidates = [path / "config.json", path] if path.is_dir() else [path]
    if not ref.startswith(("/", "./", "../", "~")) and not path.exists():
        candidates = []
        from rigpilot.engine.models.presets import find_preset

        preset = find_preset(ref)
        repo = preset.repo_id if preset is not None else ref
        cached = _hub_cached_config(repo)
        if cached is not None:
            candidates = [cached]
        elif preset is not None:  # the tracer falls back to the preset's own config
            text = json.dumps(dict(preset.config), sort_keys=True)
            return "preset:" + hashlib.sha256(text.encode()).hexdigest()
    for candidate in candidates:
        with contextlib.suppress(OSError):
            if candidate.is_file():
                return hashlib.sha256(candidate.read_bytes()).hexdigest()
    return None


def _hub_cached_config(repo: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json")
    except Exception:  # a name that is not a repo id, a cache that cannot be read: nothing cached
        return None
    return Path(found) if isinstance(found, str) else None


@functools.lru_cache(maxsize=4)
def stack_versions(python: str) -> dict[str, str] | None:
    """The versions of torch, transformers and peft that `python` imports, read from their installed metadata
    (no interpreter started); None when torch's cannot be found."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        found = {}
        for name in _STACK:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                found[name] = importlib.metadata.version(name)
    else:
        root = Path(python).parent.parent  # a virtual environment's: bin/python -> lib/python3.X/site-packages
        found = {}
        for name in _STACK:
            infos = sorted(glob.glob(str(root / "lib" / "python3*" / "site-packages" / f"{name}-*.dist-info")))
            if infos:
                found[name] = Path(infos[-1]).name.removesuffix(".dist-info").split("-", 1)[1]
    return found if "torch" in found else None


@functools.lru_cache(maxsize=1)
def tracer_digest() -> str:
    """sha256 over the tracer's source files (engine/workers), as installed beside this planner."""
    workers = Path(__file__).resolve().parent.parent / "workers"
    h = hashlib.sha256()
    for name in (*sorted(p.name for p in workers.glob("*.py")), *TRACER_SOURCES):
        h.update(name.encode())
        with contextlib.suppress(OSError):
            h.update((workers / name).read_bytes())
    return h.hexdigest()
