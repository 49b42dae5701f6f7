"""A serve job's load over time, from its "serve" records (engine.workers.serve._Meter): plain numpy, no Qt.

`fold` (app.jobs.series) hands each record of rank 0 to `serve_row`, so the one reader of a job's metric
records also reads these; `ServeSeries` keeps the rows in a ring buffer and the newest record whole, for
the totals (requests served, dropped, KV cache) that a chart of rates leaves out.

The meter writes nothing while the server is idle. A line drawn straight across such a gap would say the
load went on; `with_idle` puts the idle stretch back as zeros (and no time to first token, which is
undefined with no request), and starts each time to first token at the beginning of the period it measured.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rigpilot.app.widgets.ring_buffer import RingBuffer
from rigpilot.engine.workers.serve_setup import METRICS_EVERY_S

# Columns of a row, in the record's names; time_to_first_token in seconds.
SERVE_FIELDS = ("requests_per_s", "tokens_per_s", "time_to_first_token", "queue_depth", "running")
SERVE_ROWS = 43_200  # a day of a busy server at a record every 2 s
TTFT = SERVE_FIELDS.index("time_to_first_token")
# A gap this many periods long is idle time, not a late record.
IDLE_PERIODS = 2.5


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return math.nan
    return float(v)


def serve_row(rec: dict[str, Any]) -> tuple[float, list[float]] | None:
    """(time, SERVE_FIELDS values) of a "serve" record, NaN where a figure is missing; None without a time."""
    t = _number(rec.get("time"))
    if math.isnan(t):
        return None
    return t, [_number(rec.get(name)) for name in SERVE_FIELDS]


class ServeSeries:
    def __init__(self, capacity: int = SERVE_ROWS) -> None:
        self.capacity = capacity
        # Made with the first row: every job's JobSeries has a ServeSeries, and few jobs serve.
        self._rows: RingBuffer | None = None
        self.latest: dict[str, Any] | None = None  # the newest "serve" record, whole

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else 0

    def merge(self, times: np.ndarray, rows: np.ndarray, latest: dict[str, Any] | None) -> None:
        """Rows (n, SERVE_FIELDS) of records in any order (history pages and the stream overlap in time)."""
        if len(times):
            if self._rows is None:
                self._rows = RingBuffer(self.capacity, len(SERVE_FIELDS), dtype=np.float64)
            order = np.argsort(times, kind="stable")
            self._rows.merge(times[order], rows[order])
        if latest is not None and (self.latest is None or latest.get("time", 0) >= self.latest.get("time", 0)):
            self.latest = latest

    def window(self, since: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Times (n,) and one row per SERVE_FIELDS entry (k, n) at or after `since`, oldest first."""
        if self._rows is None:
            return np.empty(0), np.empty((len(SERVE_FIELDS), 0))
        return self._rows.window(since)

    @property
    def last_time(self) -> float | None:
        return self._rows.last_time if self._rows is not None else None


def with_idle(
    times: np.ndarray, values: np.ndarray, until: float | None = None, every: float = METRICS_EVERY_S
) -> tuple[np.ndarray, np.ndarray]:
    """`times`, `values` (k, n) with each idle gap drawn as idle: a zero row a period after the record before
    it and one a period before the record after it (NaN time to first token). `until`: the server is
    still up, idle since its last record if that is older than a gap, up to `until`."""
    if not len(times):
        return times, values
    ends = times[1:] if until is None else np.append(times[1:], until)
    gaps = np.flatnonzero(ends - times[: len(ends)] > IDLE_PERIODS * every)
    if not len(gaps):
        return times, values
    before = ends[gaps] - np.where(gaps == len(times) - 1, 0.0, every)  # idle up to `until` itself
    new_t = np.concatenate([times[gaps] + every, before])
    idle = np.zeros((values.shape[0], len(new_t)))
    idle[TTFT] = math.nan
    # A record's time to first token is the mean over the period before it: drawn from the start of that
    # period, it is a short line where it would otherwise be a lone point, which a line chart leaves out.
    resumed = gaps < len(times) - 1
    idle[TTFT, len(gaps) :][resumed] = values[TTFT, gaps[resumed] + 1]
    all_t = np.concatenate([times, new_t])
    all_v = np.concatenate([values, idle], axis=1)
    order = np.argsort(all_t, kind="stable")
    return all_t[order], all_v[:, order]
