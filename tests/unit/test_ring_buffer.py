"""The ring buffer's bulk append keeps exactly what appending row by row keeps, wrapping included."""

from __future__ import annotations

import numpy as np
import pytest

from rigpilot.app.widgets.ring_buffer import RingBuffer


def row_by_row(capacity: int, batches: list[tuple[np.ndarray, np.ndarray]]) -> RingBuffer:
    ring = RingBuffer(capacity, 2)
    for times, rows in batches:
        for t, row in zip(times, rows, strict=True):
            ring.append(float(t), row)
    return ring


@pytest.mark.parametrize("sizes", [[3], [5], [12], [2, 2, 2], [4, 7, 1], [0, 6, 0, 9]])
def test_extend_wraps_like_appending_each_row(sizes):
    batches, start = [], 0
    for n in sizes:
        times = np.arange(start, start + n, dtype=np.float64)
        batches.append((times, np.column_stack([times, -times])))
        start += n
    bulk = RingBuffer(5, 2)
    for times, rows in batches:
        bulk.extend(times, rows)
    expected = row_by_row(5, batches)
    for since in (None, start - 3.0):
        for got, want in zip(bulk.window(since), expected.window(since), strict=True):
            np.testing.assert_array_equal(got, want)
    assert len(bulk) == len(expected) and bulk.last_time == expected.last_time


def test_extend_refuses_times_and_rows_of_different_lengths():
    with pytest.raises(ValueError):
        RingBuffer(5, 2).extend(np.arange(3.0), np.zeros((2, 2)))
