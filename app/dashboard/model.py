"""The dashboard's view-model: telemetry history, the latest readings, and which job uses which GPU.

Plain Python and numpy; the page subscribes to nothing here, it asks. One ring
buffer row per telemetry sample holds every charted metric of every GPU, in
display units, plus the host's CPU and memory, so switching the chart's metric
or window never waits for data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rigpilot.app.widgets.ring_buffer import RingBuffer
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.telemetry import SLOW_FIELDS
from rigpilot.engine.jobs.store import ACTIVE_STATES

GIB = 1024**3
HISTORY_SECONDS = 3600
MAX_RATE_HZ = 10
# One hour at the fastest rate the sampler can run; at the usual 1 Hz this holds ten hours.
HISTORY_ROWS = HISTORY_SECONDS * MAX_RATE_HZ
WINDOWS = {"1 min": 60.0, "10 min": 600.0, "1 h": 3600.0}


@dataclass(frozen=True)
class Metric:
    key: str  # the GpuSample field
    title: str
    unit: str
    scale: float  # sample units -> display units
    fmt: str
    y_range: tuple[float, float] | None = None


METRICS: list[Metric] = [
    Metric("gpu_util", "Utilisation", "%", 1.0, "{:.0f}", (0.0, 100.0)),
    Metric("memory_used", "Memory used", "GiB", 1 / GIB, "{:.1f}"),
    Metric("power_w", "Power", "W", 1.0, "{:.0f}"),
    Metric("temperature_c", "Temperature", "°C", 1.0, "{:.0f}"),
    Metric("sm_clock_mhz", "SM clock", "MHz", 1.0, "{:.0f}"),
    Metric("mem_clock_mhz", "Memory clock", "MHz", 1.0, "{:.0f}"),
    Metric("pcie_rx_bps", "PCIe rx", "GB/s", 1e-9, "{:.2f}"),
    Metric("pcie_tx_bps", "PCIe tx", "GB/s", 1e-9, "{:.2f}"),
    Metric("nvlink_rx_bps", "NVLink rx", "GB/s", 1e-9, "{:.2f}"),
    Metric("nvlink_tx_bps", "NVLink tx", "GB/s", 1e-9, "{:.2f}"),
]
METRIC_BY_KEY = {m.key: m for m in METRICS}
HOST_CPU, HOST_MEMORY = "host_cpu", "host_memory"  # host columns after the GPU ones: percent, GiB


class DashboardModel:
    def __init__(self, capacity: int = HISTORY_ROWS):
        self.capacity = capacity
        self.machine: Machine | None = None
        self.gpu_indices: list[int] = []
        self.history: RingBuffer | None = None
        self.latest: dict[int, dict[str, Any]] = {}  # GPU index -> newest GpuSample dict
        self.host: dict[str, Any] | None = None  # newest HostSample dict
        self.jobs: dict[str, dict[str, Any]] = {}
        self.revision = 0  # bumps on every change, so views redraw only when something is new
        self.epoch = 0  # bumps when history changes other than by appending (merged, reset)

    # -- machine ---------------------------------------------------------------------------
    def set_machine(self, machine: Machine) -> bool:
        """Adopt a machine; True when its GPUs differ from before (history and cards start again)."""
        indices = [g.index for g in machine.gpus]
        changed = indices != self.gpu_indices or self.history is None
        self.machine = machine
        if changed:
            self._reset(indices)
        self.revision += 1
        return changed

    def _reset(self, indices: list[int]) -> None:
        self.gpu_indices = indices
        self.history = RingBuffer(self.capacity, len(METRICS) * max(len(indices), 1) + 2)
        self.latest = {}
        self.host = None
        self.epoch += 1

    def columns(self, metric: str) -> slice:
        m = METRICS.index(METRIC_BY_KEY[metric])
        n = len(self.gpu_indices)
        return slice(m * n, (m + 1) * n)

    def host_column(self, which: str) -> int:
        return len(METRICS) * len(self.gpu_indices) + (0 if which == HOST_CPU else 1)

    # -- telemetry ---------------------------------------------------------------------------
    def _row(self, sample: dict[str, Any]) -> np.ndarray:
        assert self.history is not None
        row = np.full(self.history.width, np.nan)
        pos = {index: i for i, index in enumerate(self.gpu_indices)}
        n = len(self.gpu_indices)
        for g in sample.get("gpus", []):
            i = pos.get(g.get("index"))
            if i is None:
                continue
            for m, metric in enumerate(METRICS):
                v = g.get(metric.key)
                if v is not None:
                    row[m * n + i] = v * metric.scale
        host = sample.get("host")
        if host:
            cpus = host.get("cpu_percent") or []
            if cpus:
                row[-2] = sum(cpus) / len(cpus)
            if host.get("memory_used") is not None:
                row[-1] = host["memory_used"] / GIB
        return row

    def _adopt_gpus_from(self, sample: dict[str, Any]) -> None:
        """Telemetry before any machine: chart what the sample has rather than drop it."""
        indices = sorted(g["index"] for g in sample.get("gpus", []))
        if self.history is None or (self.machine is None and indices != self.gpu_indices):
            self._reset(indices)

    def add_sample(self, sample: dict[str, Any]) -> None:
        """A live TelemetrySample dict."""
        self._adopt_gpus_from(sample)
        assert self.history is not None
        t = float(sample["time"])
        last = self.history.last_time
        if last is not None and t <= last:
            self.merge_history([sample])
        else:
            self.history.append(t, self._row(sample))
        self._keep_latest(sample)
        self.revision += 1

    def merge_history(self, samples: list[dict[str, Any]]) -> None:
        """Samples from `telemetry_history`, older or newer than what is held."""
        if not samples:
            return
        self._adopt_gpus_from(samples[-1])
        assert self.history is not None
        times = np.array([float(s["time"]) for s in samples])
        rows = np.stack([self._row(s) for s in samples])
        self.history.merge(times, rows)
        self.epoch += 1
        if self.history.last_time == times.max():
            self._keep_latest(samples[int(times.argmax())])
        self.revision += 1

    def _keep_latest(self, sample: dict[str, Any]) -> None:
        for g in sample.get("gpus", []):
            previous = self.latest.get(g["index"])
            if previous is not None:
                # Slow-tier fields (processes, PCIe, health) may be missing from a fast tick; keep the last ones read.
                missing = {
                    f: previous.get(f)
                    for f in SLOW_FIELDS
                    if g.get(f) is None and f not in (g.get("unavailable") or {})
                }
                if missing:
                    g = {**g, **missing}
            self.latest[g["index"]] = g
        if sample.get("host"):
            self.host = sample["host"]

    @property
    def last_time(self) -> float | None:
        return self.history.last_time if self.history is not None else None

    def series(self, metric: str, seconds: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Times and one row per GPU of `metric` for the last `seconds` (None: everything held)."""
        last = self.last_time
        if self.history is None or not len(self.history) or last is None:
            return np.empty(0), np.empty((len(self.gpu_indices), 0))
        since = None if seconds is None else last - seconds
        return self.history.window(since, self.columns(metric))

    def gpu_series(self, index: int, metrics: list[str], seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """One GPU's `metrics` over the last `seconds` (for a card's sparklines)."""
        last = self.last_time
        if self.history is None or not len(self.history) or last is None or index not in self.gpu_indices:
            return np.empty(0), np.empty((len(metrics), 0))
        i = self.gpu_indices.index(index)
        n = len(self.gpu_indices)
        cols = [METRICS.index(METRIC_BY_KEY[m]) * n + i for m in metrics]
        return self.history.window(last - seconds, cols)

    def host_series(self, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        last = self.last_time
        if self.history is None or not len(self.history) or last is None:
            return np.empty(0), np.empty((2, 0))
        return self.history.window(
            last - seconds, [self.host_column(HOST_CPU), self.host_column(HOST_MEMORY)]
        )

    def unavailable(self, index: int, field: str) -> str | None:
        """Why GPU `index` does not report `field`, or None when it does (or nothing is known yet)."""
        g = self.latest.get(index)
        if g is None:
            return None
        if g.get(field) is None:
            return (g.get("unavailable") or {}).get(field) or "not reported"
        return None

    def metric_notes(self, metric: str) -> list[str | None]:
        return [self.unavailable(i, metric) for i in self.gpu_indices]

    # -- jobs --------------------------------------------------------------------------------
    def set_jobs(self, jobs: list[dict[str, Any]]) -> None:
        self.jobs = {j["id"]: j for j in jobs}
        self.revision += 1

    def update_job(self, job: dict[str, Any]) -> None:
        self.jobs[job["id"]] = job
        self.revision += 1

    def jobs_on(self, index: int) -> list[dict[str, Any]]:
        """Jobs running (or starting) on GPU `index`."""
        return [j for j in self.jobs.values() if j.get("state") in ACTIVE_STATES and index in (j.get("gpus") or [])]

    # -- processes ---------------------------------------------------------------------------
    def processes(self, index: int | None = None) -> list[tuple[int, dict[str, Any]]]:
        """(GPU, process) pairs, most GPU memory first within each GPU; `index` limits to one GPU."""
        out = []
        for i in self.gpu_indices:
            if index is not None and i != index:
                continue
            procs = (self.latest.get(i) or {}).get("processes") or []
            for p in sorted(procs, key=lambda p: -(p.get("used_memory") or 0)):
                out.append((i, p))
        return out

    def processes_unavailable(self) -> str | None:
        """Why no GPU lists its processes, when none does."""
        if not self.latest or any(g.get("processes") is not None for g in self.latest.values()):
            return None
        reasons = {r for g in self.latest.values() if (r := (g.get("unavailable") or {}).get("processes")) is not None}
        return ", ".join(sorted(reasons)) or "not reported yet"
