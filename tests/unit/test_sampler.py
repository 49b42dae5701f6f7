import threading
import time

import pytest

from rigpilot.engine.hardware.sampler import Sampler
from rigpilot.engine.hardware.simulated import SimulatedBackend, load_profile
from rigpilot.engine.hardware.telemetry import Tier


class CountingBackend:
    """Wraps a backend and records which tier each call asked for and on which thread."""

    def __init__(self, inner):
        self.inner = inner
        self.tiers = []
        self.threads = set()

    def machine(self):
        return self.inner.machine()

    def sample_gpus(self, tier):
        self.tiers.append(tier)
        self.threads.add(threading.get_ident())
        return self.inner.sample_gpus(tier)

    def close(self):
        pass


def test_slow_fields_are_read_rarely_and_carried_forward():
    b = CountingBackend(SimulatedBackend(load_profile("4x-rtx4090"), seed=3))
    s = Sampler(b, period=0.01, slow_period=10.0, host=False)
    samples = [s.sample() for _ in range(5)]
    assert b.tiers == [Tier.SLOW] + [Tier.FAST] * 4
    first_pcie = samples[0].gpus[0].pcie_rx_bps
    assert first_pcie is not None
    assert all(x.gpus[0].pcie_rx_bps == first_pcie for x in samples[1:])
    assert all(x.gpus[0].processes == [] for x in samples)


def test_background_thread_samples_off_the_callers_thread_at_the_period():
    b = CountingBackend(SimulatedBackend(load_profile("1x-rtx4090")))
    s = Sampler(b, period=0.05, slow_period=0.05, host=True)
    got = []
    s.subscribe(got.append)
    s.start()
    time.sleep(0.5)
    s.stop()
    assert 6 <= len(got) <= 12
    assert threading.get_ident() not in b.threads
    assert got[-1].host is not None and got[-1].host.memory_total > 0
    assert s.latest() is got[-1]
    assert got[-1].simulated


def test_a_failing_listener_does_not_stop_the_others():
    s = Sampler(SimulatedBackend(load_profile("1x-rtx4090")), period=1, slow_period=1, host=False)
    seen = []

    def broken(_):
        raise RuntimeError("boom")

    s.subscribe(broken)
    unsubscribe = s.subscribe(seen.append)
    s.sample()
    unsubscribe()
    s.sample()
    assert len(seen) == 1


def test_history_is_bounded_and_filterable():
    ticks = iter(range(100))
    s = Sampler(SimulatedBackend(load_profile("1x-rtx4090")), period=1, slow_period=1, host=False, history=5,
                clock=lambda: float(next(ticks)))
    for _ in range(8):
        s.sample()
    assert [x.time for x in s.history()] == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert [x.time for x in s.history(since=5.0)] == [6.0, 7.0]


def test_bad_periods_are_refused():
    b = SimulatedBackend(load_profile("1x-rtx4090"))
    with pytest.raises(ValueError):
        Sampler(b, period=0)
    with pytest.raises(ValueError):
        Sampler(b, period=2, slow_period=1)
