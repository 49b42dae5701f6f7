"""Machine-check reports (rigpilot.doctor/1) for tests of what uses them: built here as the check would write them,
with findings and actions derived by engine.hardware.doctor itself, so a test never hand-writes a finding.

The machine is the simulated 4×RTX 4090 (resources/machines/4x-rtx4090.json): GPUs 0-1 and 2-3 share a NUMA node
(NODE), the other pairs cross sockets (SYS).
"""

from __future__ import annotations

import itertools
from typing import Any

from rigpilot.engine.hardware.doctor import (
    Check,
    DoctorReport,
    GpuResult,
    GroupResult,
    PairResult,
    actions_of,
    findings_of,
)

GPU_NAME = "NVIDIA GeForce RTX 4090"
LINKS = {(0, 1): "NODE", (2, 3): "NODE"}  # every other pair: SYS
MEASURED_AT = "2026-11-29T04:00:00Z"


def four_gpu_report(
    corrupt: tuple[tuple[int, int], ...] = ((0, 1),),
    *,
    simulated: bool = True,
    measured_at: str = MEASURED_AT,
    pair_busbw: dict[tuple[int, int], float] | None = None,
    group_busbw: float | None = None,
    tflops: dict[str, float] | None = None,
    hung: tuple[tuple[int, int], ...] = (),
) -> DoctorReport:
    """A complete check of four GPUs; the pairs in `corrupt` returned wrong data from a P2P copy, those in `hung`
    timed out in their all-reduce. Figures: each pair's all-reduce bus bandwidth (`pair_busbw`, default 1 GB/s,
    a CPU's), the all-GPU group's (`group_busbw`), and each GPU's matmul TFLOP/s by dtype (`tflops`)."""
    gpus = [0, 1, 2, 3]
    device = "cpu" if simulated else "cuda"
    matmul = tflops or {"fp32": 0.1}
    report = DoctorReport(
        measured_at=measured_at, simulated=simulated, device_type=device, backend="gloo" if simulated else "nccl",
        duration_s=12.0,
        machine={"identity": "test-4x4090", "label": "simulated: 4×RTX 4090" if simulated else "box: 4×RTX 4090",
                 "gpus": {str(g): GPU_NAME for g in gpus}, "driver": "550.54.14"},
    )  # fmt: skip
    for g in gpus:
        report.gpus.append(
            GpuResult(g, GPU_NAME, [Check("matmul", "ok", 0.5, {"tflops": dict(matmul), "peak_tflops": {}})])
        )
    for a, b in itertools.combinations(gpus, 2):
        copy = (Check("p2p_copy", "fail", 0.2, {"bytes": 1 << 20, "correct": False, "mismatched": 4096, "gbs": 20.0,
                                                  "host_gbs": 10.0})
                if (a, b) in corrupt else
                Check("p2p_copy", "ok", 0.2, {"bytes": 1 << 20, "correct": True, "mismatched": 0, "gbs": 20.0,
                                               "host_gbs": 10.0}))  # fmt: skip
        busbw = (pair_busbw or {}).get((a, b), 1.0)
        reduce = (Check("all_reduce", "timeout", 5.0, {"bytes": 1 << 24, "deadline_s": 5.0})
                  if (a, b) in hung else
                  Check("all_reduce", "ok", 0.3, {"bytes": 1 << 24, "busbw_gbs": busbw, "deadline_s": 5.0}))  # fmt: skip
        report.pairs.append(PairResult((a, b), LINKS.get((a, b), "SYS"), "ok", [copy, reduce]))
    whole = Check("all_reduce", "ok", 0.6, {"bytes": 1 << 24, "busbw_gbs": group_busbw or 1.0, "deadline_s": 5.0})
    report.groups.append(GroupResult(list(gpus), [whole]))
    report.findings = findings_of(report)
    report.actions = actions_of(report.findings)
    return report


def clean_report(**kwargs: Any) -> DoctorReport:
    """The same machine with nothing wrong."""
    return four_gpu_report((), **kwargs)
