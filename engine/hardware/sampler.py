"""Tiered telemetry sampling off the caller's thread.

Cheap fields are read every `period`; expensive ones (process lists, PCIe
throughput, ECC) every `slow_period` and carried forward in between, so a
1 Hz dashboard of eight GPUs costs a fraction of a percent of one core.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from rigpilot.engine.hardware.host import read_host_sample
from rigpilot.engine.hardware.telemetry import SLOW_FIELDS, Backend, GpuSample, TelemetrySample, Tier

log = logging.getLogger(__name__)

Listener = Callable[[TelemetrySample], None]


class Sampler:
    def __init__(
        self,
        backend: Backend,
        *,
        period: float = 1.0,
        slow_period: float = 5.0,
        host: bool = True,
        history: int = 3600,
        clock: Callable[[], float] = time.time,
    ):
        if period <= 0 or slow_period < period:
            raise ValueError("need 0 < period <= slow_period")
        self.backend = backend
        self.period = period
        self.slow_period = slow_period
        self._host = host
        self._clock = clock
        self._simulated = backend.machine().simulated
        self._last_slow: dict[int, GpuSample] = {}
        self._last_slow_time = float("-inf")
        self._history: deque[TelemetrySample] = deque(maxlen=history)
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if host:
            read_host_sample()  # psutil's first CPU reading is always 0: prime it

    # -- one sample, on the caller's thread ---------------------------------
    def sample(self) -> TelemetrySample:
        now = time.monotonic()
        slow = now - self._last_slow_time >= self.slow_period - 1e-6
        gpus = self.backend.sample_gpus(Tier.SLOW if slow else Tier.FAST)
        if slow:
            self._last_slow_time = now
            self._last_slow = {g.index: g for g in gpus}
        else:
            for g in gpus:
                _carry_slow_fields(g, self._last_slow.get(g.index))
        sample = TelemetrySample(
            time=self._clock(),
            gpus=gpus,
            host=read_host_sample() if self._host else None,
            simulated=self._simulated,
        )
        with self._lock:
            self._history.append(sample)
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(sample)
            except Exception:  # one bad listener must not stop telemetry for the others
                log.exception("telemetry listener failed")
        return sample

    # -- background thread ---------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="telemetry-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:
                log.exception("telemetry sample failed")
            # Schedule from the intended tick, not from now, so the rate does not drift.
            next_tick += self.period
            delay = next_tick - time.monotonic()
            if delay < 0:
                next_tick = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    # -- consumers -----------------------------------------------------------
    def subscribe(self, fn: Listener) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)

        return unsubscribe

    def latest(self) -> TelemetrySample | None:
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self, since: float | None = None) -> list[TelemetrySample]:
        with self._lock:
            items = list(self._history)
        return items if since is None else [s for s in items if s.time > since]


def _carry_slow_fields(sample: GpuSample, last: GpuSample | None) -> None:
    if last is None:
        return
    for name in SLOW_FIELDS:
        setattr(sample, name, copy.copy(getattr(last, name)))
        if name in last.unavailable:
            sample.unavailable[name] = last.unavailable[name]
