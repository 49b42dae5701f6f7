"""The engine keeps the machine check's report, one per machine and driver (either changing calls for a new check).

`keep` runs when a doctor job ends, completed or not: the ranks' half (output/doctor.json) is read as
JSON (never unpickled), completed with what NVML and nvidia-smi say now (engine/hardware/doctor_host.py),
and stored 0600 under the engine's state folder. A job that hung wrote what it measured before the hang and
names it, so a failed job's report is kept too. `latest` is what the planner, the launcher and every client
read: the report for the machine the engine runs now, or why there is none.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.doctor import DoctorReport, store_key
from rigpilot.engine.hardware.doctor_host import complete, identity, read_smi, samples_of
from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.paths import write_private

log = logging.getLogger(__name__)

OUTPUT = Path("output") / "doctor.json"
# Why there is no report for this machine now: codes the clients word.
NEVER, DRIVER_CHANGED, UNREADABLE = "never", "driver_changed", "unreadable"


def keep(job_dir: Path, machine: Machine, backend: Any, folder: Path) -> DoctorReport | None:
    """Complete and store the report `job_dir` holds; None (and a log line) when it has none or cannot be read."""
    try:
        raw = json.loads((job_dir / OUTPUT).read_text())
        report = DoctorReport.from_dict(raw, f"machine check {job_dir / OUTPUT}")
    except FileNotFoundError:
        log.warning("machine check %s left no report", job_dir.name)
        return None
    except (OSError, ValueError, UserError) as e:
        log.warning("machine check not kept: %s", e)
        return None
    smi = read_smi() if not machine.simulated else (None, "simulated")
    report = complete(report, machine, samples_of(backend), smi)
    report.machine["job"] = job_dir.name
    ident, driver = identity(machine)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(folder / store_key(ident, driver), json.dumps(report.to_dict(), indent=2) + "\n")
    except OSError as e:  # a full disk must not stop the supervisor that reported the job
        log.warning("machine check not kept: %s", e)
        return None
    log.info("machine check of %s kept (%s)", ident, job_dir.name)
    return report


# The last report read, by path, with the file's inode, mtime and size: every submission and plan asks for it, and it
# changes once per check. Callers treat the JSON as read-only.
_read: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def latest(machine: Machine, folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the stored report as JSON, None), or (None, why): never checked, checked on another driver, unreadable."""
    ident, driver = identity(machine)
    path = folder / store_key(ident, driver)
    try:
        st = path.stat()
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = _read.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1], None
        raw = json.loads(path.read_text())
        DoctorReport.from_dict(raw)
        _read[path] = (stamp, raw)
        return raw, None
    except FileNotFoundError:
        _read.pop(path, None)
    except (OSError, ValueError, UserError) as e:
        log.warning("stored machine check %s unreadable: %s", path, e)
        return None, UNREADABLE
    return None, DRIVER_CHANGED if _checked_on_another_driver(folder, ident) else NEVER


def latest_report(machine: Machine, folder: Path) -> DoctorReport | None:
    raw, _ = latest(machine, folder)
    return DoctorReport.from_dict(raw) if raw is not None else None


def _checked_on_another_driver(folder: Path, ident: str) -> bool:
    try:
        files = sorted(folder.glob("doctor-*.json"))
    except OSError:
        return False
    for f in files:
        try:
            if json.loads(f.read_text()).get("machine", {}).get("identity") == ident:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False
