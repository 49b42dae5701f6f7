"""A job's figures as TensorBoard event files in `<job dir>/tensorboard/` (the job setting `--tensorboard`).

Where the writer runs, decided: in the engine, not in rank 0 of the worker. The engine reads every rank's
metric records already (engine.jobs.following) and is the only process that sees the GPU telemetry of the
job's GPUs; it follows every kind of job alike (a user's script included, whose ranks need nothing), and the
workers' environment (pyproject's `workers` extra, installed per user) stays as it is. The writer is
tensorboardX, a maintained writer whose dependencies are numpy and packaging, which the .deb bundles already,
and protobuf: the .deb's lock gains two wheels, not TensorFlow's or TensorBoard's server stack.

What is written (`scalars`): every numeric figure of rank 0's step and evaluation records under its own name
(loss, eval_loss, lr, grad_norm, mfu, step_time, and whatever a script reports), with the step as the x
axis; the per-rank figures (tokens_per_s, peak_memory in bytes) of every rank as `<name>/rank<N>`. These
are the TensorBoard run `training`. A resumed run repeats the steps after its checkpoint: its first record
starts a new event file that tells TensorBoard's reader to drop what the earlier run wrote from that step on,
as the engine's own views mark those records superseded. The files are a function of the metric files, read
with a cursor of their own: each time the engine starts following a run (a start, a resume, a restart of the
service) it writes them afresh from the whole history, so nothing is written twice.

The telemetry of the job's GPUs (`gpu<I>/utilization` in percent, `gpu<I>/memory_used` in bytes) has no step:
it is the TensorBoard run `gpus`, by whole seconds since the engine first wrote one of the job's samples,
added to run after run (the engine samples only while it runs, so there is nothing to rewrite).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

from rigpilot.engine.jobs.metrics import PEAK_MEMORY_KEYS, Cursor, read_records

log = logging.getLogger(__name__)

FOLDER = "tensorboard"
# Two TensorBoard runs in it: the job's figures by step, and its GPUs' by seconds (a resume purges the first).
TRAINING = "training"
GPUS = "gpus"
# Figures each rank reports for itself (engine.report): one curve per rank. Every other figure is rank 0's.
PER_RANK = ("tokens_per_s", *PEAK_MEMORY_KEYS)
# What a record carries besides its figures.
_BOOKKEEPING = frozenset({"time", "rank", "run", "step", "kind", "nonfinite"})
_FIGURE_KINDS = (None, "eval")  # step records and evaluations; status, notes and errors are not curves
TELEMETRY_EVERY_S = 2.0


def folder(job_dir: Path) -> Path:
    return job_dir / FOLDER


def scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """The (tag, value) pairs a metric record puts in TensorBoard; none for records without a step."""
    if record.get("kind") not in _FIGURE_KINDS or not isinstance(record.get("step"), int):
        return []
    rank = record.get("rank", 0)
    out = []
    for key, value in record.items():
        if key in _BOOKKEEPING or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value):
            continue
        if key in PER_RANK:
            out.append((f"{key}/rank{rank}", float(value)))
        elif rank == 0:
            out.append((key, float(value)))
    return out


def telemetry_scalars(sample: dict[str, Any], gpus: list[int]) -> list[tuple[str, float]]:
    """The (tag, value) pairs of one telemetry sample (TelemetrySample.to_dict) for the job's GPUs."""
    out = []
    for g in sample.get("gpus") or []:
        if g.get("index") not in gpus:
            continue
        for field, name in (("gpu_util", "utilization"), ("memory_used", "memory_used")):
            v = g.get(field)
            if isinstance(v, int | float) and math.isfinite(v):
                out.append((f"gpu{g['index']}/{name}", float(v)))
    return out


class TensorboardLog:
    """The event files of one followed run; each folder is opened on its first figure, so a job that reports
    none has none."""

    def __init__(self, job_dir: Path, gpus: list[int], now: float):
        self.dir = folder(job_dir)
        self.gpus = list(gpus)
        self.cursor: Cursor = {}
        self.next_telemetry_read = 0.0
        # The engine samples telemetry only while it runs, so a new follower has no sample to catch up on that an
        # earlier one did not write: it carries on from now, in the same folder, on the same x axis.
        self.telemetry_time = now
        self._writers: dict[str, Any] = {}
        self._opened: list[str] = []
        self._run: int | None = None
        self._failed = False
        # The training figures are rewritten from the whole history (see the module's docstring).
        shutil.rmtree(self.dir / TRAINING, ignore_errors=True)

    def _writer(self, name: str, purge_step: int | None = None) -> Any:
        if self._failed:
            return None
        old = self._writers.get(name)
        if old is not None and purge_step is None:
            return old
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            self._failed = True
            log.warning("tensorboardX is not installed: no TensorBoard files for job %s", self.dir.parent.name)
            return None
        if old is not None:
            old.close()
        (self.dir / name).mkdir(parents=True, exist_ok=True)
        self._writers[name] = SummaryWriter(
            str(self.dir / name),
            purge_step=purge_step,
            flush_secs=5,
            # Two files opened within one second would have the same name; the suffix keeps them apart, in order.
            filename_suffix=f".{len(self._opened):04d}",
        )
        self._opened.append(name)
        return self._writers[name]

    def add(self, record: dict[str, Any]) -> None:
        pairs = scalars(record)
        if not pairs:
            return
        run = record["run"] if isinstance(record.get("run"), int) else 1
        step = int(record["step"])
        if self._run is not None and run < self._run:
            return  # an earlier run's record read after a later one's: superseded
        new_run = self._run is not None and run > self._run
        self._run = run
        # A new event file whose start tells TensorBoard's reader to drop the earlier run's points from here on.
        writer = self._writer(TRAINING, step if new_run else None)
        if writer is None:
            return
        wall = record["time"] if isinstance(record.get("time"), int | float) else None
        for tag, value in pairs:
            writer.add_scalar(tag, value, step, walltime=wall)

    def catch_up(self) -> None:
        """Write the records the job's metric files gained since the last read."""
        while True:
            records, self.cursor, more = read_records(self.dir.parent / "metrics", self.cursor)
            for r in records:
                self.add(r)
            if not more:
                break
        self._flush(TRAINING)

    def add_telemetry(self, sample: dict[str, Any]) -> None:
        t = sample.get("time")
        if not isinstance(t, int | float) or t <= self.telemetry_time:
            return
        self.telemetry_time = t
        pairs = telemetry_scalars(sample, self.gpus)
        writer = self._writer(GPUS) if pairs else None
        if writer is None:
            return
        for tag, value in pairs:
            writer.add_scalar(tag, value, int(t - self._origin()), walltime=t)

    def _origin(self) -> float:
        """When the job's GPU figures began: their x axis is whole seconds since then, over every run."""
        marker = self.dir / GPUS / "origin"
        try:
            return float(marker.read_text())
        except (OSError, ValueError):
            marker.write_text(repr(self.telemetry_time))
            return self.telemetry_time

    def catch_up_telemetry(self, telemetry: Any, now: float) -> None:
        """Write the samples the telemetry store gained since the last read (at most every few seconds)."""
        if telemetry is None or now < self.next_telemetry_read:
            return
        self.next_telemetry_read = now + TELEMETRY_EVERY_S
        try:
            for s in telemetry.each_since(self.telemetry_time):
                self.add_telemetry(s)
        except Exception:  # a chart elsewhere must never stop a job from being watched or ended
            log.exception("cannot write telemetry to TensorBoard")
        self._flush(GPUS)

    def _flush(self, name: str) -> None:
        if name in self._writers:
            self._writers[name].flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()


def finish(tb: TensorboardLog | None, telemetry: Any) -> None:
    """Write what the run's last reads brought, then close its files."""
    if tb is None:
        return
    tb.catch_up()
    tb.catch_up_telemetry(telemetry, float("inf"))
    tb.close()


def for_run(spec: Any, job_dir: Path, gpus: list[int]) -> TensorboardLog | None:
    """The event files of a run of `spec`, or None where the job did not ask for them."""
    return TensorboardLog(job_dir, gpus, time.time()) if getattr(spec, "tensorboard", False) else None
