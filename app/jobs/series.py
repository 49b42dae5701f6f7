"""A job's metrics and its GPUs' telemetry as the charts read them: bounded, plain numpy, no Qt.

`JobSeries` folds the metric records of one job (engine/report.py's JSON lines)
into ring buffers, so an hour-long or a week-long job costs the same memory.
Step records of rank 0 feed the line charts, as the engine's own summary does;
every rank adds its peak memory and speed, which the predicted-vs-measured
view compares with the plan. `GpuUsage` keeps the memory and utilisation of
the job's GPUs from the telemetry stream.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from typing import Any

import numpy as np

from rigpilot.app.jobs.serve_series import SERVE_FIELDS, ServeSeries, serve_row
from rigpilot.app.widgets.ring_buffer import RingBuffer
from rigpilot.engine.jobs.metrics import PEAK_MEMORY_KEYS
from rigpilot.engine.workers.serve_setup import LOAD_RECORD

GIB = 1024**3
CHART_RANK = 0
STEP_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time", "mfu", "peak_memory")
# The train worker reports "peak_memory"; scripts and the engine's summary may use the longer names.
PEAK_MEMORY_FIELDS = ("peak_memory", *PEAK_MEMORY_KEYS)
STEP_ROWS = 100_000
EVAL_ROWS = 10_000
TELEMETRY_ROWS = 3600 * 4  # four hours at the sampler's usual 1 Hz
RECENT = 10  # steps the measured speed is the median of: single steps jitter, the first ones compile
KEPT_ERRORS = 5
DEFAULT_SMOOTHING = 0.9
KEPT_NOTES = 20
_STEP_TIME_COLUMN = 1 + STEP_FIELDS.index("step_time")


def _number(v: Any) -> float | None:
    kind = type(v)
    if kind is float:
        return v if v - v == 0.0 else None  # NaN and ±inf fail this: finite numbers only
    if kind is int:
        return float(v)
    if kind is bool or not isinstance(v, int | float):  # bool is an int; numpy numbers are not float
        return None
    return float(v) if math.isfinite(v) else None


def final_timeline(steps: np.ndarray) -> np.ndarray:
    """A mask over rows in time order keeping, for each step, the run that finally got past it.

    A resumed job repeats the steps after its last checkpoint; the rows of the
    run that failed there are replaced by the rerun's, so the line never doubles back.
    """
    keep = np.ones(len(steps), dtype=bool)
    if len(steps) > 1:
        later_min = np.minimum.accumulate(steps[::-1])[::-1]
        keep[:-1] = steps[:-1] < later_min[1:]
    return keep


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing); NaN gaps carry the last value on.

    Without the debiasing the first value weighs as much as all the steps after it until the average
    forgets it, so on a short run whose loss falls fast the smoothed line lags far above the raw one.
    """
    return ema_from(values, weight, EmaState())[0]


@dataclasses.dataclass(frozen=True)
class EmaState:
    """Where an average stopped, to carry it on over values that arrive later."""

    biased: float = 0.0  # the average as if it started from 0
    count: int = 0  # values averaged so far
    last: float = math.nan  # the last output


def ema_from(values: np.ndarray, weight: float, state: EmaState) -> tuple[np.ndarray, EmaState]:
    out = np.empty(len(values), dtype=np.float64)
    biased, count, last = state.biased, state.count, state.last
    keep, take = weight, 1.0 - weight
    for i, v in enumerate(values.tolist()):
        if v == v:  # not NaN
            biased = biased * keep + v * take
            count += 1
            last = biased / (1.0 - keep**count) if keep > 0 else v
        out[i] = last
    return out, EmaState(biased, count, last)


def _peak_field(rec: dict[str, Any]) -> float | None:
    for key in PEAK_MEMORY_FIELDS:
        v = _number(rec.get(key))
        if v is not None:
            return v
    return None  # a gap in the chart: not reported, or not finite (report() sends NaN as null)


@dataclasses.dataclass
class Folded:
    """Metric records turned into what `JobSeries.apply` merges: arrays and a few small lists.

    Made by `fold`, which touches no shared state, so a page of history is folded on a worker
    thread and the GUI thread only merges arrays.
    """

    records: int = 0
    step_times_of_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0))
    step_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.empty((0, 1 + len(STEP_FIELDS))))
    eval_times: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0))
    eval_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.empty((0, 2)))
    peak_memory: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> the highest in these records
    speeds: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # rank -> tokens/s in record order
    step_times: list[float] = dataclasses.field(default_factory=list)
    errors: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    phase: str | None = None
    serve_times: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0))
    serve_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.empty((0, len(SERVE_FIELDS))))
    serve_latest: dict[str, Any] | None = None  # the newest "serve" record among these


def fold(records: list[dict[str, Any]]) -> Folded:
    """What `records` add to a job's charts, computed without touching a `JobSeries`."""
    out = Folded(records=len(records))
    # The common record (a rank's step) takes one pass with local names, no per-field function calls.
    step_t: list[float] = []
    step_rows: list[list[float]] = []
    eval_t: list[float] = []
    eval_rows: list[tuple[float, float]] = []
    serve_t: list[float] = []
    serve_rows: list[list[float]] = []
    peak, speeds_by_rank, step_times = out.peak_memory, out.speeds, out.step_times
    number = _number
    for rec in records:
        rank = rec.get("rank")
        if type(rank) is not int:
            rank = 0
        kind = rec.get("kind")
        for key in PEAK_MEMORY_FIELDS:
            if key in rec:
                v = number(rec[key])
                if v is not None:
                    peak[rank] = max(peak.get(rank, 0.0), v)
        if kind == LOAD_RECORD:
            load = serve_row(rec) if rank == CHART_RANK else None  # rank 0 serves; the others only compute
            if load is not None:
                serve_t.append(load[0])
                serve_rows.append(load[1])
                if out.serve_latest is None or load[0] >= out.serve_latest["time"]:
                    out.serve_latest = rec
            continue
        if kind is not None:
            _fold_other(out, rec, kind, rank, eval_t, eval_rows)
            continue
        t = number(rec.get("time"))
        step = number(rec.get("step"))
        if t is None or step is None:
            continue
        tps = number(rec.get("tokens_per_s"))
        if tps is not None:
            speeds = speeds_by_rank.get(rank)
            if speeds is None:
                speeds = speeds_by_rank[rank] = []
            speeds.append(tps)
        if rank != CHART_RANK:
            continue
        row = [step]
        for name in STEP_FIELDS:
            v = number(rec.get(name)) if name != "peak_memory" else _peak_field(rec)
            row.append(math.nan if v is None else v)
        step_t.append(t)
        step_rows.append(row)
        if not math.isnan(row[_STEP_TIME_COLUMN]):
            step_times.append(row[_STEP_TIME_COLUMN])
    if step_t:
        out.step_times_of_rows, out.step_rows = np.array(step_t), np.array(step_rows, dtype=np.float64)
    if eval_t:
        out.eval_times, out.eval_rows = np.array(eval_t), np.array(eval_rows, dtype=np.float64)
    if serve_t:
        out.serve_times, out.serve_rows = np.array(serve_t), np.array(serve_rows, dtype=np.float64)
    return out


def _fold_other(out: Folded, rec: dict[str, Any], kind: Any, rank: int, eval_t: list, eval_rows: list) -> None:
    """Records other than steps: errors, notes, status, eval losses (the rest is not charted here)."""
    if kind == "error":
        out.errors = [*out.errors[-(KEPT_ERRORS - 1) :], rec]
    elif kind == "note":
        note = rec.get("message")
        if isinstance(note, str) and note not in out.notes and len(out.notes) < KEPT_NOTES:
            out.notes.append(note)
    elif kind == "status":
        if rank == CHART_RANK and isinstance(rec.get("phase"), str):
            out.phase = rec["phase"]
    elif kind == "eval" and rank == CHART_RANK:
        t, step, loss = _number(rec.get("time")), _number(rec.get("step")), _number(rec.get("eval_loss"))
        if t is not None and step is not None and loss is not None:
            eval_t.append(t)
            eval_rows.append((step, loss))


class JobSeries:
    """Everything charted about one job, fed record by record (deduplicated by the caller)."""

    def __init__(self, capacity: int = STEP_ROWS):
        # Rows are keyed by the record's time (file order); column 0 is the step, then STEP_FIELDS.
        self._steps = RingBuffer(capacity, 1 + len(STEP_FIELDS))
        self._evals = RingBuffer(min(capacity, EVAL_ROWS), 2)
        self.peak_memory: dict[int, float] = {}  # rank -> bytes, the highest reported
        self._speed: dict[int, deque[float]] = {}  # rank -> recent tokens/s
        self._step_times: deque[float] = deque(maxlen=RECENT)
        self.errors: list[dict[str, Any]] = []  # the newest few kind="error" records
        self.notes: list[str] = []  # what the workers noted about how they run the job (each once)
        self.phase: str | None = None
        self.serve = ServeSeries()  # a serve job's load (its "serve" records)
        self.records = 0
        self.revision = 0  # bumps on every change, so charts redraw only when something is new
        self._view: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None  # revision, times, steps, values
        # The weight, the time of the last row, the EMA and where it stopped.
        self._smoothed: tuple[float, float, np.ndarray, EmaState] | None = None

    # -- input ----------------------------------------------------------------------------
    def add(self, records: list[dict[str, Any]]) -> None:
        """Fold `records` in here and now (the live stream's few records a tick)."""
        self.apply(fold(records))

    def apply(self, folded: Folded) -> None:
        """Take records `fold` prepared (off the GUI thread, for a page of history): a merge of arrays."""
        peak = self.peak_memory
        for rank, v in folded.peak_memory.items():
            peak[rank] = max(peak.get(rank, 0.0), v)
        for rank, speeds in folded.speeds.items():
            kept = self._speed.get(rank)
            if kept is None:
                kept = self._speed[rank] = deque(maxlen=RECENT)
            kept.extend(speeds)
        self._step_times.extend(folded.step_times)
        if folded.errors:
            self.errors = [*self.errors, *folded.errors][-KEPT_ERRORS:]
        for note in folded.notes:
            if note not in self.notes and len(self.notes) < KEPT_NOTES:
                self.notes.append(note)
        if folded.phase is not None:
            self.phase = folded.phase
        if len(folded.step_times_of_rows):
            self._steps.merge(folded.step_times_of_rows, folded.step_rows)
        if len(folded.eval_times):
            self._evals.merge(folded.eval_times, folded.eval_rows)
        self.serve.merge(folded.serve_times, folded.serve_rows, folded.serve_latest)
        self.records += folded.records
        if folded.records:
            self.revision += 1

    # -- output -----------------------------------------------------------------------------
    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Times, steps and the STEP_FIELDS rows of the final timeline, computed once per revision."""
        if self._view is None or self._view[0] != self.revision:
            times, values = self._steps.window()
            keep = final_timeline(values[0])
            steps, fields = values[0][keep].astype(np.float64), values[1:, keep].astype(np.float64)
            self._view = (self.revision, times[keep], steps, fields)
        return self._view[1], self._view[2], self._view[3]

    def steps(self) -> np.ndarray:
        return self._rows()[1]

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of one STEP_FIELDS entry, in step order; NaN where a step did not report it."""
        _, steps, values = self._rows()
        return steps, values[STEP_FIELDS.index(name)]

    def smoothed_loss(self, weight: float = DEFAULT_SMOOTHING) -> tuple[np.ndarray, np.ndarray]:
        times, steps, values = self._rows()
        loss = values[STEP_FIELDS.index("loss")]
        # A live job only appends: carry on from the last average instead of redoing a long history.
        # The time of a row names its record, so a changed prefix (a merge, a resumed run) is noticed.
        cached = self._smoothed
        n = len(cached[2]) if cached else 0
        if cached and cached[0] == weight and 0 < n <= len(times) and times[n - 1] == cached[1]:
            more, state = ema_from(loss[n:], weight, cached[3])
            smoothed = np.concatenate([cached[2], more])
        else:
            smoothed, state = ema_from(loss, weight, EmaState())
        self._smoothed = (weight, float(times[-1]), smoothed, state) if len(times) else None
        return steps, smoothed

    def eval_loss(self) -> tuple[np.ndarray, np.ndarray]:
        _, values = self._evals.window()
        keep = final_timeline(values[0])
        return values[0][keep].astype(np.float64), values[1][keep].astype(np.float64)

    @property
    def last_step(self) -> int | None:
        steps = self.steps()
        return int(steps[-1]) if len(steps) else None

    @property
    def oom(self) -> dict[str, Any] | None:
        """The newest out-of-memory error record, if a rank reported one."""
        return next((e for e in reversed(self.errors) if e.get("error") == "out_of_memory"), None)

    def measured(self) -> dict[str, float | None]:
        """What the plan's predictions are compared with: peak memory per GPU, job tokens/s, step time."""
        # Ranks report their own device's rate (engine/workers/train.py), so the job's is the sum.
        speeds = [statistics.median(d) for d in self._speed.values() if d]
        return {
            "peak_memory_bytes": max(self.peak_memory.values()) if self.peak_memory else None,
            "tokens_per_s": sum(speeds) if speeds else None,
            "step_time_s": statistics.median(self._step_times) if self._step_times else None,
        }


class GpuUsage:
    """Memory used (GiB) and utilisation (%) of a job's GPUs over time, from telemetry samples."""

    def __init__(self, capacity: int = TELEMETRY_ROWS):
        self.capacity = capacity
        self.gpus: list[int] = []
        self._buffer = RingBuffer(capacity, 1)
        self.memory_total: dict[int, float] = {}  # GPU -> bytes
        self.revision = 0

    def set_gpus(self, gpus: list[int]) -> None:
        if list(gpus) == self.gpus:
            return
        self.gpus = list(gpus)
        self._buffer = RingBuffer(self.capacity, 2 * max(len(self.gpus), 1))
        self.revision += 1

    def add_samples(self, samples: list[dict[str, Any]]) -> None:
        """Telemetry samples (TelemetrySample.to_dict()), live or from history, in any order."""
        if not self.gpus:
            return
        times, rows = [], []
        for sample in samples:
            t = _number(sample.get("time"))
            if t is None:
                continue
            by_index = {g.get("index"): g for g in sample.get("gpus") or []}
            row = []
            for index in self.gpus:
                g = by_index.get(index) or {}
                used = _number(g.get("memory_used"))
                total = _number(g.get("memory_total"))
                if total:
                    self.memory_total[index] = total
                row.append(used / GIB if used is not None else math.nan)
            for index in self.gpus:
                util = _number((by_index.get(index) or {}).get("gpu_util"))
                row.append(util if util is not None else math.nan)
            times.append(t)
            rows.append(row)
        if times:
            order = np.argsort(times, kind="stable")
            self._buffer.merge(np.array(times)[order], np.array(rows, dtype=np.float64)[order])
            self.revision += 1

    def memory(self, since: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.gpus)
        return self._buffer.window(since, slice(0, n))

    def utilization(self, since: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.gpus)
        return self._buffer.window(since, slice(n, 2 * n))

    @property
    def last_time(self) -> float | None:
        return self._buffer.last_time
