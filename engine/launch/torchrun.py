"""How a job's ranks are started: the torchrun command line, the rank's target and its environment.

The supervisor (local and multi-node jobs) and the SLURM backend start ranks the same way: each rank is
`rankexec JOB_DIR -- TARGET`, which writes the rank's metrics and logs in the job folder whoever launched it.
What the rank is told (job id, folder, run, GPUs) travels in the environment built here, so a rank started
by torchrun, by SLURM or forked by the warm worker sees the same variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RANKEXEC_MODULE = "rigpilot.engine.launch.rankexec"
WORKERS_MODULE = "rigpilot.engine.workers"


def rank_target(python: str, job_dir: Path, script: Sequence[str] | None) -> list[str]:
    """What each rank runs: the user's script, or the engine's worker for the job folder."""
    if script is not None:
        return [python, "-u", *script]
    return [python, "-u", "-m", WORKERS_MODULE, str(job_dir)]


def rankexec_command(python: str, job_dir: Path, target: Sequence[str]) -> list[str]:
    """One rank, wrapped by rankexec (SLURM starts this once per task)."""
    return [python, "-u", "-m", RANKEXEC_MODULE, str(job_dir), "--", *target]


def torchrun_command(
    *, python: str, job_id: str, run: int, ranks_per_node: int, nodes: Mapping[str, Any], port: int,
    monitor_interval_s: float, job_dir: Path, target: Sequence[str],
) -> list[str]:
    """`torch.distributed.run` over rankexec: one node, or this node's part of a multi-node job (`nodes`)."""
    # Several engines: every node's torchrun meets at the head's endpoint, and only the head hosts the store.
    across = ["--rdzv-conf", f"is_host={int(nodes.get('role') == 'head')}",
              "--local-addr", str(nodes["local_addr"])] if nodes.get("endpoint") else []  # fmt: skip
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(nodes.get("count", 1)),
        "--nproc-per-node", str(ranks_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", str(nodes.get("endpoint") or f"127.0.0.1:{port}"),
        *across,
        "--rdzv-id", f"{job_id}-{run}",
        "--max-restarts", "0",
        "--monitor-interval", str(monitor_interval_s),
        "-m", RANKEXEC_MODULE, str(job_dir), "--", *target,
    ]  # fmt: skip


def rank_environment(
    base: Mapping[str, str], *, job_id: str, job_dir: Path, run: int, gpus: Sequence[int], ranks: int,
    simulated: bool,
) -> dict[str, str]:
    """`base` (the service's environment and the job's own variables) plus what every rank is told."""
    env = dict(base)
    # Nothing of the service's own environment goes on PYTHONPATH: ranks and user scripts import
    # rigpilot (rigpilot.report) from the worker interpreter's environment, and a user's `engine`
    # package stays theirs.
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")  # ranks fork dataloader workers after tokenizing
    env.update(
        RIGPILOT_JOB_ID=job_id,
        RIGPILOT_JOB_DIR=str(job_dir),
        RIGPILOT_METRICS_DIR=str(job_dir / "metrics"),
        RIGPILOT_RUN=str(run),
        RIGPILOT_GPUS=",".join(str(g) for g in gpus),
    )
    if simulated:
        # Simulated GPUs: ranks must not grab a real one. The ranks read "simulated" from the job's spec
        # (JobSpec.simulated, the machine's word at submission), not from their environment.
        env["CUDA_VISIBLE_DEVICES"] = ""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // max(ranks, 1))))
    else:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so CUDA's numbering matches nvidia-smi's and ours
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env
