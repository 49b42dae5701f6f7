"""Where a chart's data has a hole, the line breaks instead of drawing a straight ramp across it.

The rule: a step from one point to the next that is more than GAP_FACTOR times the usual step
(the median spacing of the series) is a gap; a NaN is put in the middle of it, and curves drawn
with connect="finite" lift the pen there. Steps a job did not report (metrics lost with a crashed
rank, a resumed run that started past them) and telemetry while the engine was down both show as
a break. Spacing that merely varies (eval every 50 steps, a sampler that slows under load) stays
within the factor and stays joined.
"""

from __future__ import annotations

import numpy as np

GAP_FACTOR = 3.0
MIN_POINTS = 3  # fewer points have no "usual step" to judge by


def gap_positions(x: np.ndarray) -> np.ndarray:
    """Indices i where the step from x[i - 1] to x[i] is a gap."""
    if len(x) < MIN_POINTS:
        return np.empty(0, dtype=np.intp)
    steps = np.diff(x)
    forward = steps[steps > 0]
    if not len(forward):
        return np.empty(0, dtype=np.intp)
    usual = _median(forward)
    return np.flatnonzero(steps > GAP_FACTOR * usual) + 1


def _median(values: np.ndarray) -> float:
    # np.median's first call in a process imports numpy.ma (40 ms, on the GUI thread, inside the first
    # job page a user opens); the two middle values by np.partition are the same median without it.
    n = len(values)
    middle = n // 2
    if n % 2:
        return float(np.partition(values, middle)[middle])
    low, high = np.partition(values, (middle - 1, middle))[middle - 1 : middle + 1]
    return (float(low) + float(high)) / 2.0


def break_gaps(x: np.ndarray, *rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """(x, *rows) with a NaN point in the middle of every gap of x; rows may be 1-D or (k, n)."""
    where = gap_positions(x)
    if not len(where):
        return (x, *rows)
    middle = (x[where - 1] + x[where]) / 2.0
    out = [np.insert(x.astype(np.float64), where, middle)]
    for row in rows:
        out.append(np.insert(row.astype(np.float64), where, np.nan, axis=row.ndim - 1))
    return tuple(out)
