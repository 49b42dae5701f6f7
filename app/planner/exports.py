"""Writing a plan out for other launchers: torchrun, Accelerate, DeepSpeed, SLURM, or the plan JSON itself.

Work functions for a background task. The torchrun line and the SLURM script
run with `--plan FILE`, so those two also write the plan JSON beside them,
named after the file the user chose, and point at it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.planner.export import export
from rigpilot.engine.planner.plan import Plan
from rigpilot.engine.planner.settings import PLAN_SETTINGS


@dataclass(frozen=True)
class ExportTarget:
    key: str
    label: str  # the button's text
    default_name: str
    file_filter: str


_EXPORT = PLAN_SETTINGS["export"]  # the buttons read as the planner's advice names them ("use Export “torchrun”")
EXPORT_TARGETS: list[ExportTarget] = [
    ExportTarget("torchrun", _EXPORT.choice_word("torchrun"), "launch.sh", "Shell script (*.sh);;All files (*)"),
    ExportTarget("accelerate", _EXPORT.choice_word("accelerate"), "accelerate_config.yaml",
                 "YAML (*.yaml *.yml);;All files (*)"),
    ExportTarget("deepspeed", _EXPORT.choice_word("deepspeed"), "ds_config.json", "JSON (*.json);;All files (*)"),
    ExportTarget("slurm", _EXPORT.choice_word("slurm"), "job.slurm", "SLURM batch script (*.slurm *.sh);;All files (*)"),
    ExportTarget("json", "JSON", "plan.json", "JSON (*.json);;All files (*)"),
]
TARGETS = {t.key: t for t in EXPORT_TARGETS}


def plan_sidecar(path: Path) -> Path:
    """Where the plan JSON goes beside a launcher file: `launch.sh` -> `launch.plan.json`."""
    return path.with_name(f"{path.stem}.plan.json")


def export_text(plan: dict[str, Any], target: str, *, plan_path: str = "plan.json") -> str:
    """The file's content; raises UserError (e.g. an Accelerate config of an inference plan)."""
    p = Plan.from_dict(plan)
    if target == "json":
        return p.to_json() + "\n"
    text = export(p, target, plan_path=plan_path)
    if target == "torchrun":
        return f"#!/bin/sh\n# Launch under the Rigpilot plan ({p.parallelism.describe()}).\n{text}\n"
    return text if text.endswith("\n") else text + "\n"


def unsupported(plan: dict[str, Any], target: str) -> str | None:
    """Why `target` cannot express `plan` (Accelerate has no pipelines, ...), or None when it can."""
    try:
        export_text(plan, target)
    except UserError as e:
        return str(e)
    return None


def write_export(plan: dict[str, Any], target: str, path: str | os.PathLike[str]) -> list[Path]:
    """Write the export (and the plan beside a launcher that reads it); the paths written, main file first."""
    path = Path(path)
    written = [path]
    plan_path = "plan.json"
    if target in ("torchrun", "slurm"):
        sidecar = plan_sidecar(path)
        plan_path = sidecar.name
        _write(sidecar, export_text(plan, "json"))
        written.append(sidecar)
    _write(path, export_text(plan, target, plan_path=plan_path))
    if target in ("torchrun", "slurm"):
        path.chmod(path.stat().st_mode | 0o111)
    return written


def _write(path: Path, text: str) -> None:
    # Through a temporary file, so a failed write never leaves half a config where a good one was.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
