"""Telemetry history on disk, so a client that connects late still sees the whole curve.

Samples go into a SQLite table (`<state dir>/telemetry.db`), zlib-compressed
JSON, at most one per `min_interval` whatever rate the sampler runs at. The
newest `full_window` seconds keep every stored sample; older ones are thinned
to one per `coarse_interval`, and nothing older than `retention` is kept. With
the defaults (1 Hz, 6 h full, 15 s coarse, 24 h) that is about 26,000 rows,
some 15 MB for a four-GPU machine.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rigpilot.engine.hardware.telemetry import TelemetrySample


class TelemetryStore:
    def __init__(
        self,
        path: Path,
        *,
        min_interval: float = 1.0,
        full_window: float = 6 * 3600,
        coarse_interval: float = 15.0,
        retention: float = 24 * 3600,
        prune_every: float = 300.0,
        clock: Callable[[], float] = time.time,
    ):
        self.min_interval = min_interval
        self.full_window = full_window
        self.coarse_interval = coarse_interval
        self.retention = retention
        self._prune_every = prune_every
        self._clock = clock
        self._lock = threading.Lock()
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._last_prune = 0.0
        self._open()

    def _open(self) -> None:
        """Connect, and pick up where the stored history ends."""
        self._db = self._connect()
        # `coarse` marks the rows that survive thinning: the first sample of each coarse bucket.
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS telemetry (time REAL PRIMARY KEY, coarse INTEGER NOT NULL, data BLOB NOT NULL)"
        )
        row = self._db.execute("SELECT MAX(time) FROM telemetry").fetchone()
        self._last_time = row[0] or 0.0
        row = self._db.execute("SELECT MAX(time) FROM telemetry WHERE coarse = 1").fetchone()
        self._last_coarse_bucket = int((row[0] or 0.0) // self.coarse_interval)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def add(self, sample: TelemetrySample) -> bool:
        """Store `sample` unless one was stored less than `min_interval` ago; True when stored."""
        t = sample.time
        # A small tolerance keeps a 1 Hz sampler from skipping every other tick through jitter.
        if t - self._last_time < self.min_interval * 0.9:
            return False
        bucket = int(t // self.coarse_interval)
        coarse = bucket != self._last_coarse_bucket
        blob = zlib.compress(json.dumps(sample.to_dict(), separators=(",", ":")).encode(), 6)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO telemetry VALUES (?, ?, ?)", (t, int(coarse), blob))
        self._last_time = t
        if coarse:
            self._last_coarse_bucket = bucket
        if self._clock() - self._last_prune >= self._prune_every:
            self.prune()
        return True

    def prune(self) -> None:
        now = self._clock()
        self._last_prune = now
        with self._lock:
            self._db.execute("DELETE FROM telemetry WHERE time < ?", (now - self.retention,))
            self._db.execute("DELETE FROM telemetry WHERE time < ? AND coarse = 0", (now - self.full_window,))

    def since(self, since: float | None, *, limit: int = 10_000, max_bytes: int | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Stored samples newer than `since`, oldest first, and whether more remain after them."""
        with self._lock:
            rows = self._db.execute(
                "SELECT data FROM telemetry WHERE time > ? ORDER BY time LIMIT ?",
                (since if since is not None else float("-inf"), limit + 1),
            ).fetchall()
        out: list[dict[str, Any]] = []
        size = 0
        for (blob,) in rows[:limit]:
            raw = zlib.decompress(blob)
            if max_bytes is not None and out and size + len(raw) > max_bytes:
                return out, True
            size += len(raw)
            out.append(json.loads(raw))
        return out, len(rows) > limit

    def each_since(self, since: float | None, page: int = 2000) -> Iterator[dict[str, Any]]:
        """Every stored sample newer than `since`, oldest first, read a page at a time (a job's whole history
        at once would hold it all in memory)."""
        while True:
            samples, more = self.since(since, limit=page)
            yield from samples
            if not more or not samples:
                return
            since = samples[-1].get("time", since)

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM telemetry").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
