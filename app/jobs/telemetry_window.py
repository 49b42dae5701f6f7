"""Which stretch of the GPUs' telemetry a job's charts show: the last minutes while it runs, and its
own recorded window once it has ended, so a finished job never shows what its GPUs do now."""

from __future__ import annotations

import math
import time
from typing import Any

from rigpilot.engine.schema import TERMINAL_STATES


def _time(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def job_window(record: dict[str, Any], span: float, now: float | None = None) -> tuple[float, float | None]:
    """(since, until) of the telemetry to show; `until` None while the job may still run.

    An ended job shows its last `span` seconds (all of it if it ran shorter), ending when it ended.
    """
    ended = _time(record.get("ended")) if record.get("state") in TERMINAL_STATES else None
    if ended is None:
        return (time.time() if now is None else now) - span, None
    started = _time(record.get("started"))
    return max(ended - span, started if started is not None else -math.inf), ended
