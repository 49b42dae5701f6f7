"""Whether a GPU may take part in a job again: fallen off the bus, uncorrectable ECC errors, hardware XIDs.

Automatic recovery (engine.jobs.recovery) leaves such a GPU out when it restarts a job. The
judgement is made from the fields a telemetry sample already carries (`health`, `ecc_uncorrected`,
`xid`), so NVML, the simulated machine and a replayed recording are judged alike; each backend's
`health()` fills those fields freshly, on the caller's thread, for every GPU.
"""

from __future__ import annotations

from typing import Any

from rigpilot.engine.hardware.telemetry import GpuSample

# XIDs that put the GPU itself at fault (NVIDIA's XID catalogue), not the program that ran on it:
# 13, 31, 43 and their like follow from a kernel's own bug and say nothing about the card.
HARDWARE_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

# What the simulated machine can be told to report (SimulatedBackend.set_fault).
SIMULATED_FAULTS = ("lost", "ecc", "xid N")


def fault_of(sample: GpuSample) -> str | None:
    """Why this GPU must not run a job again, in a few words, or None when nothing says so."""
    if sample.health == "lost":
        return "fell off the bus (NVML: GPU is lost)"
    ecc = sample.ecc_uncorrected
    if isinstance(ecc, int) and not isinstance(ecc, bool) and ecc > 0:
        return f"reports {ecc} uncorrectable ECC error{'s' * (ecc != 1)}"
    if sample.xid in HARDWARE_XIDS:
        return f"reported XID {sample.xid} ({HARDWARE_XIDS[sample.xid]})"
    return None


def gpu_faults(backend: Any) -> dict[int, str]:
    """{GPU index: why it is faulty} for the GPUs `backend` finds faulty now; {} for a backend that cannot tell."""
    health = getattr(backend, "health", None)
    if health is None:
        return {}
    return {i: why for i, why in health().items() if why}


def parse_simulated_fault(text: str | None) -> tuple[str, int | None] | None:
    """("lost"|"ecc"|"xid", xid number) from what a user typed; None clears. Raises ValueError with the choices."""
    if text is None or text.strip().lower() in ("", "none", "clear", "ok"):
        return None
    words = text.strip().lower().split()
    if words == ["lost"] or words == ["ecc"]:
        return words[0], None
    if len(words) == 2 and words[0] == "xid" and words[1].isdigit() and 0 < int(words[1]) < 1000:
        return "xid", int(words[1])
    raise ValueError(f"unknown GPU fault {text[:40]!r}; choose one of {', '.join(SIMULATED_FAULTS)}, or clear")
