"""What the machine check (engine/hardware/doctor.py) sets in a job's environment, and the note that says why.

At submission the engine's stored report for this machine decides, by `nccl_env_for` (the one rule, also the
planner's: engine.planner.machine_check): a job whose GPUs hold a pair with broken or slow P2P runs with
NCCL_P2P_DISABLE=1. The job's record keeps what was set and why, so a resumed run gets the same and every client
shows it:

    "machine_check": {"measured_at": "...", "simulated": true,
                      "env": {"NCCL_P2P_DISABLE": "1"},        # what the engine sets for the job's ranks
                      "yours": [],                              # names the job's own --env set: theirs stand
                      "findings": [FINDING, ...]}               # why (codes with fields; `describe` words them)

The user's own setting of a variable wins: a job submitted with --env NCCL_P2P_DISABLE=0 runs with it, and its
record names the variable under `yours`. Not for a machine check itself (it tests the peer paths the variable
would hide), and not for a SLURM job: its ranks run on the cluster's nodes, which this machine's check did not see.
"""

from __future__ import annotations

import logging
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.doctor import DoctorReport, Finding, describe, nccl_env_for
from rigpilot.engine.jobspec.spec import JobSpec

log = logging.getLogger(__name__)

NOT_FOR_KINDS = ("doctor",)


def for_job(raw: dict[str, Any] | None, spec: JobSpec, *, slurm: bool = False) -> dict[str, Any] | None:
    """The record's `machine_check` for a job of `spec` given the stored report (its JSON; None: never checked),
    or None when the check asks nothing of this job."""
    if raw is None or slurm or spec.kind in NOT_FOR_KINDS:
        return None
    try:
        report = DoctorReport.from_dict(raw, "the engine's stored machine check")
    except UserError as e:  # the planner says so on every plan; a job still runs as it would unchecked
        log.warning("machine check not applied to a job: %s", e)
        return None
    env, why = nccl_env_for(report, spec.gpus)
    if not why:
        return None
    yours = sorted(k for k in env if k in (spec.env or {}))
    return {
        "measured_at": report.measured_at,
        "simulated": report.simulated,
        "env": {k: v for k, v in env.items() if k not in yours},
        "yours": yours,
        "findings": [f.to_dict() for f in why],
    }


def job_env(record: dict[str, Any] | None) -> dict[str, str]:
    """The variables a job's record says the engine sets for its ranks."""
    env = (record or {}).get("env")
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}


def lines(record: dict[str, Any] | None) -> list[str]:
    """What `rigpilot run`, `rigpilot metrics JOB` and the job page say: a line per finding, and one per variable
    the job's own --env set instead."""
    if not isinstance(record, dict):
        return []
    when = str(record.get("measured_at") or "")[:10]
    source = f"Machine check of {when}" + (" (simulated)" if record.get("simulated") else "")
    out = []
    for f in record.get("findings") or []:
        try:
            out.append(f"{source}: {describe(Finding.from_dict(f))}")
        except ValueError:
            continue
    out += [
        f"{name} is set by this job's --env, which stands over the machine check" for name in record.get("yours") or []
    ]
    return out
