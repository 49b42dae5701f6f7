"""The engine keeps its machine's latest calibration: a finished calibrate job's output, read by every plan.

`keep` runs when a calibrate job completes: its output/calibration.json is checked
(the planner's format, engine/planner/calibration.py) and replaces the stored one
unless that one was measured later. `stored` is what the service hands the
planner process with each plan request; the planner decides whether it applies.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError

log = logging.getLogger(__name__)

OUTPUT = Path("output") / "calibration.json"


def keep(job_dir: Path, target: Path) -> bool:
    """Store the calibration `job_dir` measured at `target`; False (and a log line) when it is not kept."""
    from rigpilot.engine.planner.calibration import MachineCalibration, parse_time

    source = job_dir / OUTPUT
    try:
        new = MachineCalibration.load(source)
    except UserError as e:
        log.warning("calibration not kept: %s", e)
        return False
    old = stored(target)
    if old is not None:
        try:
            if parse_time(str(old.get("measured_at"))) > parse_time(new.measured_at):
                return False  # an older job's output arrived late: the newer measurement stays
        except ValueError:
            pass  # the stored one is unreadable: the new one replaces it
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        tmp.write_text(json.dumps(new.to_dict(), indent=2) + "\n")
        os.replace(tmp, target)
    except OSError as e:  # a full disk must not stop the supervisor that reported the job
        log.warning("calibration not kept: cannot write %s: %s", target, e)
        return False
    log.info("calibration of %s kept for the planner (%s)", new.measured_at, job_dir.name)
    return True


def stored(target: Path) -> dict[str, Any] | None:
    """The stored calibration as JSON, or None when there is none; an unreadable file comes back as it is."""
    try:
        text = target.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"unreadable": str(e)}
    try:
        data = json.loads(text)
    except ValueError as e:
        return {"unreadable": f"{target}: {e}"}
    return data if isinstance(data, dict) else {"unreadable": f"{target} holds no JSON object"}
