"""Thinning a series to what the screen can show: the lowest and highest value per pixel-wide bin.

Drawing costs grow with points, and a chart 1,300 pixels wide cannot show more
than two values per pixel column anyway (the extremes: a spike must not vanish).
Bins are aligned to absolute time, not to the first sample, so as the window
scrolls each bin keeps its contents and the curve does not shimmer.
"""

from __future__ import annotations

import warnings

import numpy as np


def minmax_bins(t: np.ndarray, rows: np.ndarray, bin_seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """Per bin of `bin_seconds`, its min and max of each row (k, n), at the bin's first and last time.

    Returns (t', rows') with at most 2 points per bin; data with fewer than two
    points per bin comes back unchanged. All-NaN bins stay NaN, so gaps remain gaps.
    """
    n = len(t)
    if n < 4 or bin_seconds <= 0 or (t[-1] - t[0]) / bin_seconds * 2 >= n:
        return t, rows
    bins = np.floor(t / bin_seconds)
    starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    ends = np.r_[starts[1:], n] - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fmin/fmax of an all-NaN bin is NaN, as wanted
        lo = np.fmin.reduceat(rows, starts, axis=1)
        hi = np.fmax.reduceat(rows, starts, axis=1)
    out_t = np.empty(2 * len(starts))
    out_t[0::2], out_t[1::2] = t[starts], t[ends]
    out = np.empty((rows.shape[0], 2 * len(starts)), dtype=rows.dtype)
    # Within a bin, draw the extreme that came first first, so a rising bin does not zig-zag back.
    first_is_low = np.take(rows, starts, axis=1) <= np.take(rows, ends, axis=1)
    out[:, 0::2] = np.where(first_is_low, lo, hi)
    out[:, 1::2] = np.where(first_is_low, hi, lo)
    return out_t, out


class IncrementalMinMax:
    """`minmax_bins` for a series that only grows at its end: finished bins are kept, only new data is binned.

    An hour at 10 Hz is 36,000 points per series; binning all of them on every redraw
    would cost more than drawing. Call `reset()` when the data changed other than by
    appending (history merged in, another metric), or pass a new `epoch`.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._key: tuple[float, int, int] | None = None
        self._t = np.empty(0)
        self._rows: np.ndarray | None = None
        self._done_until = -np.inf  # start of the newest, still filling bin

    def update(
        self, t: np.ndarray, rows: np.ndarray, bin_seconds: float, epoch: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        key = (bin_seconds, rows.shape[0], epoch)
        if key != self._key:
            self.reset()
            self._key = key
        if not len(t):
            return t, rows
        start = int(np.searchsorted(t, self._done_until)) if self._rows is not None else 0
        new_t, new_rows = minmax_bins(t[start:], rows[:, start:], bin_seconds)
        if self._rows is not None and len(self._t):
            keep = int(np.searchsorted(self._t, t[0]))  # drop finished bins that left the window
            out_t = np.concatenate([self._t[keep:], new_t])
            out_rows = np.concatenate([self._rows[:, keep:], new_rows], axis=1)
        else:
            out_t, out_rows = new_t, new_rows
        self._done_until = np.floor(t[-1] / bin_seconds) * bin_seconds
        finished = int(np.searchsorted(out_t, self._done_until))
        self._t, self._rows = out_t[:finished], out_rows[:, :finished]
        return out_t, out_rows
