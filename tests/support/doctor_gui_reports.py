"""Machine-check reports (rigpilot.doctor/1) for the GUI's tests, built with the engine's own types and findings.

broken_report()   4 simulated GPUs: peer copies between GPUs 0 and 1 return wrong data, the all-reduce
                  between 2 and 3 hangs (the check stopped there)
clean_report()    the same machine, nothing wrong
reply(report)     the engine's `doctor_report` answer holding it (or why there is none, or a running job)
"""

from __future__ import annotations

from typing import Any

from rigpilot.engine.hardware.doctor import (
    Check,
    DoctorReport,
    Finding,
    GpuResult,
    GroupResult,
    PairResult,
    actions_of,
    findings_of,
)

MEASURED_AT = "2026-11-29T05:00:00Z"
DEADLINE_S = 10.0
LINKS = {(0, 1): "NODE", (2, 3): "NODE"}  # as the 4x-rtx4090 profile wires them: the rest cross sockets


def _gpu(index: int) -> GpuResult:
    return GpuResult(index, "NVIDIA GeForce RTX 4090", [
        Check("matmul", "ok", 0.8, {"tflops": {"fp32": 0.21, "bf16": 0.09}, "peak_tflops": {}}),
        Check("memory_bandwidth", "ok", 0.4, {"gbs": 11.5, "peak_gbs": None}),
        Check("nvml_vs_smi", "skipped", 0.0, {}, "simulated"),
        Check("health", "ok", 0.0, {"ecc_uncorrected": 0, "xid": 0, "throttle": []}),
    ])  # fmt: skip


def _pair(
    a: int, b: int, *, corrupt: bool = False, hung: bool = False, reduce: bool = True, p2p: str = "unsupported"
) -> PairResult:
    copy = (Check("p2p_copy", "fail", 0.3, {"bytes": 1 << 24, "correct": False, "mismatched": 4096, "gbs": 3.1,
                                            "host_gbs": 4.0}, "p2p_corrupt")
            if corrupt else
            Check("p2p_copy", "ok", 0.3, {"bytes": 1 << 24, "correct": True, "mismatched": 0, "gbs": 3.4 + a / 10,
                                          "host_gbs": 4.0}))  # fmt: skip
    checks = [copy]
    if hung:
        checks.append(Check("all_reduce", "timeout", DEADLINE_S, {"bytes": 1 << 22, "deadline_s": DEADLINE_S},
                            "all_reduce_hung"))  # fmt: skip
    elif reduce:
        checks.append(Check("all_reduce", "ok", 0.5, {"bytes": 1 << 22, "busbw_gbs": 1.5 + a + b / 10,
                                                      "deadline_s": DEADLINE_S}))  # fmt: skip
    # By default no peer access, as the driver of a 4090 box reports it (an info finding: copies go through the host).
    return PairResult((a, b), LINKS.get((a, b), "SYS"), p2p, checks)


def _pairs(n: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(n) for b in range(a + 1, n)]


def _report(pairs: list[PairResult], groups: list[GroupResult], stopped: Finding | None, n: int = 4) -> DoctorReport:
    report = DoctorReport(
        measured_at=MEASURED_AT, simulated=True, device_type="cpu", backend="gloo", duration_s=12.4,
        machine={"identity": "simulated:4x-rtx4090", "label": "simulated: 4×RTX 4090",
                 "gpus": {str(i): "NVIDIA GeForce RTX 4090" for i in range(n)}, "driver": None, "torch": "2.9.0"},
        complete=stopped is None, stopped=stopped, gpus=[_gpu(i) for i in range(n)], pairs=pairs, groups=groups,
    )  # fmt: skip
    # As the engine completes a report (engine/hardware/doctor_host.complete): its findings and actions.
    report.findings = findings_of(report)
    report.actions = actions_of(report.findings)
    return report


def broken_report(gpus: int = 4) -> dict[str, Any]:
    """P2P copies 0↔1 corrupt; the all-reduce 2↔3 hung, which stopped the check (on more than 4 GPUs this
    report has every pair's all-reduce, as though the hang came last: a drawing with many pairs to show)."""
    pairs = [_pair(a, b, corrupt=(a, b) == (0, 1), hung=(a, b) == (2, 3)) for a, b in _pairs(gpus)]
    stopped = Finding("all_reduce_hung", "fail", [2, 3], {"deadline_s": DEADLINE_S, "check": "all_reduce"})
    return _report(pairs, [], stopped, gpus).to_dict()


def clean_report() -> dict[str, Any]:
    """Nothing found at all: every pair has peer access, every copy is right, every all-reduce finishes."""
    pairs = [_pair(a, b, p2p="ok") for a, b in _pairs(4)]
    group = GroupResult([0, 1, 2, 3], [Check("all_reduce", "ok", 0.9, {"bytes": 1 << 22, "busbw_gbs": 2.2,
                                                                       "deadline_s": DEADLINE_S})])  # fmt: skip
    return _report(pairs, [group], None).to_dict()


def reply(report: dict[str, Any] | None = None, why: str | None = None, running: str | None = None) -> dict[str, Any]:
    """`doctor_report`'s answer: the report, or why there is none ("never", "driver_changed", …)."""
    return {"report": report, "why": None if report is not None else (why or "never"), "running": running}


def doctor_job(job_id: str = "doctor-1", state: str = "running", gpus: list[int] | None = None) -> dict[str, Any]:
    """A doctor job's record, in the fields the GUI reads."""
    from support.gui_fakes import make_job

    job = make_job(job_id, gpus=gpus or [0, 1, 2, 3], state=state, name="machine check")
    job["kind"] = "doctor"
    return job
