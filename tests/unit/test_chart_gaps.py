"""The rule that breaks a chart's line at a hole in its data instead of drawing a ramp across it."""

from __future__ import annotations

import numpy as np

from rigpilot.app.jobs.gaps import break_gaps, gap_positions


def test_a_jump_past_three_usual_steps_is_a_gap_and_gets_a_nan_in_its_middle():
    x = np.array([1.0, 2, 3, 4, 20, 21, 22])
    y = np.arange(7.0)
    bx, by = break_gaps(x, y)
    assert list(gap_positions(x)) == [4]
    assert list(bx) == [1, 2, 3, 4, 12, 20, 21, 22]
    assert np.isnan(by[4]) and list(by[[0, 3, 5, 7]]) == [0, 3, 4, 6]


def test_varying_spacing_within_the_factor_stays_joined_and_short_series_are_left_alone():
    x = np.array([0.0, 1, 2.5, 3, 5, 6])  # a sampler that slows under load
    assert break_gaps(x, x)[0] is x
    assert break_gaps(np.array([1.0, 50]), np.array([1.0, 2]))[0].tolist() == [1, 50]


def test_rows_of_several_series_break_together():
    t = np.array([0.0, 1, 2, 3, 30, 31])
    values = np.vstack([t, 2 * t])
    bt, bv = break_gaps(t, values)
    assert bt[4] == 16.5
    assert bv.shape == (2, 7) and np.isnan(bv[:, 4]).all()


def test_the_usual_step_is_numpys_median_of_odd_and_even_counts():
    from rigpilot.app.jobs.gaps import _median

    rng = np.random.default_rng(7)
    for n in range(1, 40):
        values = rng.random(n) * 10
        assert _median(values) == float(np.median(values))
