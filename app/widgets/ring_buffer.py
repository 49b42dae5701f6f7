"""A fixed-size store of timestamped rows, for charts that must not grow without bound.

Plain numpy, no Qt: the dashboard's view-model keeps its telemetry history in one
and the benchmark and tests use it directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RingBuffer:
    """`capacity` rows of one time stamp and `width` values each, allocated once.

    Appending to a full buffer overwrites the oldest row, so memory stays at
    capacity × (width × value size + 8) bytes whatever runs for how long.
    Rows are expected in time order; `merge` takes rows that arrive late
    (history loaded after live samples) and puts everything back in order.
    Missing values are NaN, which charts draw as gaps.
    """

    def __init__(self, capacity: int, width: int, dtype: type = np.float32):
        if capacity < 1 or width < 1:
            raise ValueError("a ring buffer needs at least one row and one column")
        self.capacity = capacity
        self.width = width
        # Only the rows in use are ever read, so the store is not filled: a job's 100,000-row buffer
        # costs nothing until rows arrive (filling it with NaN took 2 ms of the click that opens a job).
        self._t = np.empty(capacity, dtype=np.float64)  # unix seconds need float64's precision
        # Column-major: one series is contiguous, which is how charts read it.
        self._v: np.ndarray = np.empty((width, capacity), dtype=dtype)
        self._head = 0  # where the next row goes
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        return self._t.nbytes + self._v.nbytes

    @property
    def last_time(self) -> float | None:
        return float(self._t[(self._head - 1) % self.capacity]) if self._size else None

    @property
    def _start(self) -> int:
        return 0 if self._size < self.capacity else self._head

    def clear(self) -> None:
        self._head = self._size = 0

    def append(self, t: float, row: Sequence[float] | np.ndarray) -> None:
        self._t[self._head] = t
        self._v[:, self._head] = row
        self._head = (self._head + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def extend(self, times: np.ndarray, rows: np.ndarray) -> None:
        """Append many rows at once; `rows` is (n, width)."""
        times = np.asarray(times, dtype=np.float64)
        rows = np.asarray(rows)
        if len(times) != len(rows):
            raise ValueError(f"{len(times)} times for {len(rows)} rows")
        # Only the newest `capacity` rows can stay; they go in at most two slices, not row by row.
        times, rows = times[-self.capacity :], rows[-self.capacity :]
        n = len(times)
        first = min(n, self.capacity - self._head)
        self._t[self._head : self._head + first] = times[:first]
        self._v[:, self._head : self._head + first] = rows[:first].T
        self._t[: n - first] = times[first:]
        self._v[:, : n - first] = rows[first:].T
        self._head = (self._head + n) % self.capacity
        self._size = min(self._size + n, self.capacity)

    def _segments(self) -> list[slice]:
        """The physical slices that hold the rows, oldest first."""
        start, end = self._start, self._start + self._size
        if end <= self.capacity:
            return [slice(start, end)]
        return [slice(start, self.capacity), slice(0, end - self.capacity)]

    def window(
        self, since: float | None = None, columns: slice | Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the rows at or after `since`, oldest first: times (n,) and values (k, n).

        Always copies: a chart keeps the arrays it is given, and the next append would
        change a view under it.
        """
        cols = slice(None) if columns is None else columns
        times, values = [], []
        for seg in self._segments():
            t = self._t[seg]
            first = 0 if since is None else int(np.searchsorted(t, since, side="left"))
            if first < len(t):
                part = slice(seg.start + first, seg.stop)
                times.append(self._t[part])
                values.append(self._v[cols, part])
        if not times:
            k = len(range(self.width)[cols]) if isinstance(cols, slice) else len(cols)
            return np.empty(0, dtype=np.float64), np.empty((k, 0), dtype=self._v.dtype)
        return np.concatenate(times), np.concatenate(values, axis=1)

    def latest(self) -> np.ndarray | None:
        """The newest row (a copy), or None when empty."""
        return self._v[:, (self._head - 1) % self.capacity].copy() if self._size else None

    def merge(self, times: np.ndarray, rows: np.ndarray) -> None:
        """Add rows that may be older than what is stored; the result is sorted, one row per time.

        Where a time is both stored and given, the stored row wins: it came live and is
        at least as fresh as a replayed copy. Only the newest `capacity` rows are kept.
        """
        times = np.asarray(times, dtype=np.float64)
        if not len(times):
            return
        rows = np.asarray(rows, dtype=self._v.dtype).reshape(len(times), self.width)
        last = self.last_time
        if last is not None and times.min() > last and np.all(np.diff(times) > 0):
            self.extend(times, rows)  # the common case: nothing to reorder
            return
        old_t, old_v = self.window()
        all_t = np.concatenate([old_t, times])
        all_v = np.concatenate([old_v, rows.T], axis=1)
        # Stored rows come first, so a stable sort plus "first of each time" keeps them.
        order = np.argsort(all_t, kind="stable")
        all_t, all_v = all_t[order], all_v[:, order]
        keep = np.ones(len(all_t), dtype=bool)
        keep[1:] = all_t[1:] != all_t[:-1]
        all_t, all_v = all_t[keep][-self.capacity :], all_v[:, keep][:, -self.capacity :]
        self.clear()
        n = len(all_t)
        self._t[:n] = all_t
        self._v[:, :n] = all_v
        self._head = n % self.capacity
        self._size = n
