"""The reporting API for code that runs inside a Rigpilot job, user scripts included.

    from rigpilot import report
    report(step=10, loss=2.31, lr=3e-4)

Each call appends one JSON line to this rank's metrics file, which the engine
service tails and streams to the charts. Outside a Rigpilot job (no
RIGPILOT_METRICS_DIR) it does nothing, so scripts run unchanged elsewhere.
Values must be JSON numbers, strings or booleans; anything else is refused
here, in the script, rather than breaking the charts later.

Conventions the engine reads records by:
- `tokens_per_s` is PER RANK, torchtitan's per-device figure: the tokens the
  whole job processed in the step / the step's time / the world size (a rank
  that shares its model replica with tensor- or pipeline-parallel peers counts
  its replica's tokens divided by their number). Every rank reports its own;
  the job's rate is the sum over ranks of each rank's latest value, for the
  Rigpilot workers and user scripts alike. A script that only knows the
  global rate reports it from one rank only.
- `peak_memory` is this rank's peak memory in bytes (the allocator's peak on a
  GPU); the highest value a rank reports is its peak.
- `time` (seconds since the epoch) is when report() was called, unless given: a loop that writes a
  step's record after the step, once figures from other ranks have arrived, passes when it ended.
- `step` counts optimizer steps; the job shows rank 0's `loss` (another rank's until rank 0 reports one).
- `run` is added to every record: 1 for a job's first run, one more per resume (RIGPILOT_RUN). A resumed
  run repeats the steps after its checkpoint; readers keep the latest run's record of a step and mark
  the earlier ones superseded (engine.jobs.metrics.mark_superseded).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

METRICS_DIR_ENV = "RIGPILOT_METRICS_DIR"
RUN_ENV = "RIGPILOT_RUN"

_lock = threading.Lock()
_file: IO[str] | None = None
_file_path: Path | None = None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _run() -> int:
    try:
        return max(int(os.environ.get(RUN_ENV, "1")), 1)
    except ValueError:
        return 1


def _target() -> Path | None:
    d = os.environ.get(METRICS_DIR_ENV)
    return Path(d) / f"rank{_rank()}.jsonl" if d else None


def report(step: int | None = None, **values: float | int | str | bool | None) -> None:
    """Record metrics for `step` (loss=..., lr=..., tokens_per_s=..., anything numeric)."""
    global _file, _file_path
    for k, v in values.items():
        if v is not None and not isinstance(v, int | float | str | bool):
            raise TypeError(f"report({k}=...) needs a number, string or bool, not {type(v).__name__}")
    path = _target()
    if path is None:
        return
    record: dict[str, Any] = {"time": time.time(), "rank": _rank(), "run": _run(), "step": step}
    # JSON has no NaN/inf: send them as null and keep a marker so charts can show a gap.
    for k, v in values.items():
        if isinstance(v, float) and not math.isfinite(v):
            record[k] = None
            record.setdefault("nonfinite", []).append(k)
        else:
            record[k] = v
    line = json.dumps(record) + "\n"
    with _lock:
        if _file is None or _file_path != path:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # 0600 whatever the umask: a job's metrics are its user's alone.
            _file = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a", buffering=1)
            _file_path = path
        _file.write(line)
