"""A chain of turns rests as long as it was kept waiting for the CPU, so a busy machine's scheduler
does not count the GUI thread as a CPU hog; on an idle machine it does not rest at all."""

from __future__ import annotations

import pytest

from rigpilot.app.jobs import chart_turns
from rigpilot.app.jobs.chart_turns import MAX_REST_S, Pacer


class Clock:
    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def run(self, seconds: float) -> None:  # the GUI thread works
        self.wall += seconds
        self.cpu += seconds

    def wait(self, seconds: float) -> None:  # runnable, but another process has the CPU; or a timer's rest
        self.wall += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(chart_turns.time, "perf_counter", lambda: c.wall)
    monkeypatch.setattr(chart_turns.time, "thread_time", lambda: c.cpu)
    return c


def test_an_idle_machine_gets_no_rest_but_the_least_asked_for(clock):
    pacer = Pacer()
    pacer.start()
    clock.run(0.003)
    assert pacer.rest_ms() == 0
    clock.run(0.003)
    assert pacer.rest_ms(25) == 25
    clock.wait(0.025)  # the rest itself is not a wait
    clock.run(0.003)
    assert pacer.rest_ms() == 0


def test_a_busy_machine_rests_as_long_as_it_kept_the_turn_waiting_up_to_a_bound(clock):
    pacer = Pacer()
    pacer.start()
    clock.wait(0.020)
    clock.run(0.003)
    assert pacer.rest_ms() == 20
    clock.wait(0.020)  # the rest
    clock.wait(0.030)  # then kept waiting again
    clock.run(0.002)
    assert pacer.rest_ms() == 30
    clock.wait(10.0)
    assert pacer.rest_ms() == round(MAX_REST_S * 1000)
