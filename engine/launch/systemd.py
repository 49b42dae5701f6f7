"""`rigpilot engine --install-systemd`: a systemd user unit that keeps the service running.

The unit uses KillMode=process: stopping or restarting the service must not
take the jobs with it (systemd would otherwise kill the whole cgroup, torchrun
and every rank included); the next service re-adopts them.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

UNIT_NAME = "rigpilot-engine.service"
# The .deb ships this unit (ExecStart=/usr/bin/rigpilot engine); dpkg removes it with the package, so nothing
# is left in a home folder pointing at a removed Python.
PACKAGED_UNIT = Path("/usr/lib/systemd/user") / UNIT_NAME
PACKAGED_PREFIX = Path("/opt/rigpilot")


def unit_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def unit_text(python: str | None = None) -> str:
    python = python or sys.executable
    return f"""[Unit]
Description=Rigpilot engine service (runs GPU jobs and serves telemetry)
Documentation=man:rigpilot(1)
# Once Rigpilot is removed the unit is skipped, not failed and restarted.
ConditionPathExists={python}

[Service]
Type=simple
ExecStart={shlex.quote(python)} -m rigpilot.engine.service
WorkingDirectory=%h
Restart=on-failure
RestartSec=2
KillMode=process

[Install]
WantedBy=default.target
"""


def packaged_unit() -> Path | None:
    """The package's own unit, when this Rigpilot is the packaged one and the unit is there."""
    if PACKAGED_UNIT.is_file() and Path(sys.prefix).resolve().is_relative_to(PACKAGED_PREFIX):
        return PACKAGED_UNIT
    return None


def install_unit() -> Path:
    d = unit_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / UNIT_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(unit_text())
    tmp.replace(path)
    return path


def enable_hint() -> str:
    return (
        f"systemctl --user daemon-reload && systemctl --user enable --now {UNIT_NAME}\n"
        "(and 'loginctl enable-linger $USER' to keep it running while you are logged out)"
    )
