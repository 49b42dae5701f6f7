"""How the Jobs page names a job that SLURM runs: its queue state beside Rigpilot's (engine.jobs.slurm_state)."""

from __future__ import annotations

from typing import Any

from rigpilot.engine.jobs.slurm_state import describe


def slurm_state_text(job: dict[str, Any]) -> str:
    """'SLURM: pending (Resources)' while SLURM has the job, with its SLURM job id in the detail; '' for local jobs."""
    return describe(job.get("slurm")) if job.get("slurm") else ""


def slurm_detail(job: dict[str, Any]) -> str:
    slurm = job.get("slurm") or {}
    if not slurm:
        return ""
    parts = [f"{describe(slurm)}, job {slurm.get('job_id', '?')}"]
    if slurm.get("partition"):
        parts.append(f"partition {slurm['partition']}")
    if slurm.get("login"):
        parts.append(f"through {slurm['login']}")
    return " · ".join(parts)
