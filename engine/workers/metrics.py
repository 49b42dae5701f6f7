"""Small measurements every worker reports: memory, MFU, phases, and the consensus helpers behind them."""

from __future__ import annotations

import os

import psutil
import torch
import torch.distributed as dist

from rigpilot.engine.report import report

PEAK_TFLOPS_ENV = "RIGPILOT_PEAK_TFLOPS"

_rss_peak = 0
_process: psutil.Process | None = None  # one handle: building one reads /proc every step


def peak_memory(device: torch.device) -> int:
    """Bytes: the allocator's peak on a GPU; on the CPU the highest process RSS seen so far."""
    global _rss_peak, _process
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if _process is None:
        _process = psutil.Process()
    _rss_peak = max(_rss_peak, _process.memory_info().rss)
    return _rss_peak


def assumed_peak_tflops() -> float | None:
    """Peak dense TFLOP/s of one device in the job's precision, when the service knows it (else no MFU)."""
    raw = os.environ.get(PEAK_TFLOPS_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 else None


def mfu(flops_per_token: float, tokens_per_s_per_device: float) -> float | None:
    """Model FLOPs utilisation as a fraction of the device's peak (0..1), or None without a known peak."""
    peak = assumed_peak_tflops()
    if peak is None:
        return None
    return flops_per_token * tokens_per_s_per_device / (peak * 1e12)


def status(phase: str, **extra: float | int | str | bool | None) -> None:
    report(kind="status", phase=phase, **extra)


def world_sums(values: list[float], device: torch.device) -> list[float]:
    """Each of `values` summed over all ranks, in float64, in one all-reduce; every rank must call it."""
    t = torch.tensor(values, device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def world_sum_and_any_async(
    value: torch.Tensor | None, flag: bool, device: torch.device
) -> torch.futures.Future[tuple[float | None, bool]]:
    """(sum of `value` over the ranks that have one, or None if none has, whether `flag` is set on any rank),
    as a future: the all-reduce runs in the background, so no rank waits for it where it is started.

    `value` stays a tensor (no host sync to start it). One all-reduce in float64; a collective: every
    rank must start it, in the same order as its other collectives on the default group.
    """
    rest = torch.tensor([0.0 if value is None else 1.0, 1.0 if flag else 0.0], dtype=torch.float64, device=device)
    head = torch.zeros(1, dtype=torch.float64, device=device) if value is None else value.detach().reshape(1)
    t = torch.cat([head.to(device=device, dtype=torch.float64), rest])

    def finish(_: object) -> tuple[float | None, bool]:
        total, holders, flags = t.tolist()
        return (total if holders > 0 else None), flags > 0

    if not dist.is_initialized():
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done.then(finish)
    return dist.all_reduce(t, async_op=True).get_future().then(finish)
