"""Metrics straight from the rank files, with a cursor, so nothing is ever lost.

Each rank appends JSON lines to `metrics/rank<N>.jsonl` (engine.report). A
cursor is the byte offset reached in each file (`{"0": 1234, "1": 980}`); a
reader hands back only complete lines and the cursor after them, so a client
that reconnects resumes exactly where it stopped, or from `{}` to get the whole
history. `MetricsSummary` folds records into what the job views show: step,
loss, tokens/s, progress and ETA, peak memory per rank, phase and errors.

tokens/s is reported per rank (torchtitan's per-device convention: the job's
tokens per step / step time / world size; see engine.report), by the workers
and by scripts alike, so the job's rate is the sum over ranks of each rank's
latest value.
"""

from __future__ import annotations

import json
import math
import re
from collections import deque
from pathlib import Path
from statistics import median
from typing import Any

_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")
# Names a peak-memory figure (bytes) may go by in a record. engine.workers reports "peak_memory" with
# every step (the allocator's peak on a GPU, the process's peak RSS on a CPU) and "max_allocated" in
# its out-of-memory error record; scripts may use the longer names.
# The steady speed is the median of the latest this many steps: one step jitters, the first ones compile and
# warm the allocator, and a long job's speed drifts (thermal limits, other work), so its latest steps say most.
STEADY_STEPS = 10
PEAK_MEMORY_KEYS = ("peak_memory", "peak_memory_bytes", "max_memory_allocated", "max_allocated")
Cursor = dict[str, int]


def rank_files(metrics_dir: Path) -> dict[int, Path]:
    out = {}
    try:
        entries = list(metrics_dir.iterdir())
    except FileNotFoundError:
        return {}
    for f in entries:
        m = _RANK_FILE.match(f.name)
        if m:
            out[int(m.group(1))] = f
    return dict(sorted(out.items()))


def read_records(
    metrics_dir: Path, cursor: Cursor | None = None, *, max_bytes: int = 512 * 1024
) -> tuple[list[dict[str, Any]], Cursor, bool]:
    """Records after `cursor` from every rank, in time order; the new cursor; whether more remain."""
    cursor = dict(cursor or {})
    files = rank_files(metrics_dir)
    if not files:
        return [], cursor, False
    share = max(max_bytes // len(files), 4096)
    records: list[dict[str, Any]] = []
    more = False
    for rank, path in files.items():
        key = str(rank)
        start = cursor.get(key, 0)
        try:
            with path.open("rb") as f:
                size = f.seek(0, 2)
                if start > size:  # the file was replaced (job folder restored by hand): start again
                    start = 0
                f.seek(start)
                chunk = f.read(share)
                if len(chunk) == share and b"\n" not in chunk:
                    # One line longer than the share: read on to its end rather than stall.
                    chunk += f.readline()
        except FileNotFoundError:
            continue
        end = chunk.rfind(b"\n") + 1  # only complete lines; a half-written one waits for the next read
        for line in chunk[:end].splitlines():
            rec = _parse(line, rank)
            if rec is not None:
                records.append(rec)
        cursor[key] = start + end
        # More remains only when the share ran out; a half-written last line is not "more".
        more = more or (len(chunk) >= share and end > 0 and cursor[key] < size)
    records.sort(key=lambda r: (r.get("time") or 0.0, r.get("rank", 0)))
    return records, cursor, more


def mark_superseded(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark (`superseded: True`) each step record a later run of the job repeated; returns `records`.

    A resumed job repeats the steps between its last checkpoint and where the previous run stopped, so
    the metric files hold those steps twice. The latest run's record of a (rank, kind, step) is the one
    that counts; records without a run number (written before runs were numbered) count as run 1 and,
    between equals, the later one in file order wins. Records without a step are never superseded.
    """
    latest: dict[tuple[Any, Any, int], tuple[int, int]] = {}
    for i, rec in enumerate(records):
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        key = (rec.get("rank"), rec.get("kind"), step)
        order = (_run_of(rec), i)
        if key not in latest or order > latest[key]:
            latest[key] = order
    for i, rec in enumerate(records):
        step = rec.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            if latest[(rec.get("rank"), rec.get("kind"), step)][1] != i:
                rec["superseded"] = True
    return records


def _run_of(rec: dict[str, Any]) -> int:
    run = rec.get("run")
    return run if isinstance(run, int) and not isinstance(run, bool) else 1


def _parse(line: bytes, rank: int) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None  # a torn or foreign line must not break the stream
    if not isinstance(rec, dict):
        return None
    rec.setdefault("rank", rank)
    return rec


class MetricsSummary:
    """Folds metric records into the figures a job's detail shows."""

    def __init__(self, max_steps: int | None = None):
        self.max_steps = max_steps
        self.records = 0
        self.step: int | None = None
        self.loss: float | None = None
        self.tokens_per_s: float | None = None
        self.phase: str | None = None
        self.eval: dict[str, Any] | None = None
        self.errors: list[dict[str, Any]] = []
        self.peak_memory: dict[int, int] = {}
        self.first_time: float | None = None
        self.last_time: float | None = None
        self._rate_start: tuple[float, int] | None = None  # (time, step) of the first step record
        self._rate_end: tuple[float, int] | None = None
        self._tokens_by_rank: dict[int, float] = {}  # each rank's latest tokens/s (per rank)
        # The steady speed every view shows beside the plan: each rank's last STEADY_STEPS rates, and the step
        # times (a step's is its slowest rank's) of the last STEADY_STEPS steps.
        self._recent_tps: dict[int, deque[float]] = {}
        self._recent_step_s: dict[tuple[int, int], float] = {}  # (run, step) -> slowest rank's step time
        # Tokens processed, every run's steps included (a resumed run's repeats cost energy too): the sum over
        # step records of tokens/s × step_time, the per-rank figures adding up to the job's (engine.report).
        self.tokens = 0.0
        self._loss_key: tuple[int, int, bool] | None = None  # (run, step, from rank 0) of the loss shown
        self._generated: dict[int, int] = {}  # run -> tokens an inference run generated (its infer_summary)

    def add(self, rec: dict[str, Any]) -> None:
        self.records += 1
        t = rec.get("time") if isinstance(rec.get("time"), int | float) else None
        rank = rec.get("rank", 0) if isinstance(rec.get("rank"), int) else 0
        if t is not None:
            self.first_time = t if self.first_time is None else min(self.first_time, t)
            self.last_time = t if self.last_time is None else max(self.last_time, t)
        for key in PEAK_MEMORY_KEYS:
            v = rec.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool):
                self.peak_memory[rank] = max(self.peak_memory.get(rank, 0), int(v))
        kind = rec.get("kind")
        if kind == "status":
            phase = rec.get("phase", rec.get("status"))
            if isinstance(phase, str):
                self.phase = phase
            return
        if kind == "error":
            self.errors = [*self.errors[-4:], rec]
            return
        if kind == "eval":
            self.eval = {k: v for k, v in rec.items() if k not in ("kind",)}
            return
        if kind == "infer_summary":
            # An inference job's tokens are those it generated: every rank states the job's count, once per run.
            n = rec.get("job_new_tokens")
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                self._generated[_run_of(rec)] = n
        for key in ("max_steps", "total_steps"):  # scripts may announce their length
            if isinstance(rec.get(key), int) and not isinstance(rec.get(key), bool) and rec[key] > 0:
                self.max_steps = rec[key]
        step = rec.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            self.step = step if self.step is None else max(self.step, step)
            if t is not None:
                if self._rate_start is None:
                    self._rate_start = (t, step)
                if self._rate_end is None or step >= self._rate_end[1]:
                    self._rate_end = (t, step)
        loss = rec.get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            # The latest run's latest step, rank 0's where it has that step: every rank holding a loss states
            # the same one, but on a multi-node job another node's ranks may arrive later than this one's.
            loss_key = (_run_of(rec), step if isinstance(step, int) and not isinstance(step, bool) else -1, rank == 0)
            if self._loss_key is None or loss_key >= self._loss_key:
                self.loss, self._loss_key = float(loss), loss_key
        tps = rec.get("tokens_per_s")
        if isinstance(tps, int | float) and not isinstance(tps, bool):
            # Per rank, by convention (engine.report): the job's rate is the sum of each rank's latest.
            self._tokens_by_rank[rank] = float(tps)
            self.tokens_per_s = sum(self._tokens_by_rank.values())
            self._recent_tps.setdefault(rank, deque(maxlen=STEADY_STEPS)).append(float(tps))
            dt = rec.get("step_time")
            if isinstance(dt, int | float) and not isinstance(dt, bool) and dt > 0 and math.isfinite(tps * dt):
                self.tokens += tps * dt
                if isinstance(step, int) and not isinstance(step, bool):
                    at = (_run_of(rec), step)
                    self._recent_step_s[at] = max(self._recent_step_s.get(at, 0.0), float(dt))
                    while len(self._recent_step_s) > STEADY_STEPS:
                        del self._recent_step_s[min(self._recent_step_s)]

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        fraction = eta = rate = None
        if self.max_steps and self.step is not None:
            fraction = min(self.step / self.max_steps, 1.0)
        if self._rate_start and self._rate_end and self._rate_end[0] > self._rate_start[0]:
            rate = (self._rate_end[1] - self._rate_start[1]) / (self._rate_end[0] - self._rate_start[0])
            if rate > 0 and self.max_steps and self.step is not None:
                eta = max(self.max_steps - self.step, 0) / rate
                if now is not None and self._rate_end[0] < now:
                    eta = max(eta - (now - self._rate_end[0]), 0.0)
        return {
            "records": self.records,
            "step": self.step,
            "max_steps": self.max_steps,
            "fraction": fraction,
            "eta_s": eta,
            "steps_per_s": rate,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            "steady_tokens_per_s": sum(median(d) for d in self._recent_tps.values()) if self._recent_tps else None,
            "steady_step_time_s": median(self._recent_step_s.values()) if self._recent_step_s else None,
            "tokens": (self.tokens + sum(self._generated.values())) or None,
            "phase": self.phase,
            "eval": self.eval,
            "errors": self.errors,
            "peak_memory_by_rank": {str(r): v for r, v in sorted(self.peak_memory.items())},
            "first_time": self.first_time,
            "last_time": self.last_time,
        }


def summarize(metrics_dir: Path, max_steps: int | None = None) -> tuple[MetricsSummary, Cursor]:
    """Read a job's whole metric history into a summary (used for jobs the service re-adopts)."""
    summary = MetricsSummary(max_steps)
    cursor: Cursor = {}
    while True:
        records, cursor, more = read_records(metrics_dir, cursor, max_bytes=4 << 20)
        for r in records:
            summary.add(r)
        if not more:
            return summary, cursor


def held_out(progress: dict[str, Any] | None) -> dict[str, Any] | None:
    """A training job's last loss on its held-out split (the eval record, `eval_fraction` of the data), with its
    perplexity (exp of the mean token loss) and the step it was measured at; None where the job measured none.
    The one reader of it for the CLI and the app, from the job's own records as `progress` folds them."""
    rec = (progress or {}).get("eval") or {}
    loss = rec.get("eval_loss")
    if not isinstance(loss, int | float) or isinstance(loss, bool) or not math.isfinite(loss):
        return None
    step = rec.get("step")
    return {"eval_loss": float(loss), "perplexity": perplexity(loss), "step": step if isinstance(step, int) else None}


def perplexity(loss: float) -> float:
    """exp of a mean token cross-entropy: the number of equally likely tokens the model's uncertainty is worth."""
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709
