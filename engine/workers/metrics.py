"""Small measurements every worker reports: memory, MFU, phases, and the consensus helpers behind them."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def status(phase: str, step: int | None = None, **extra: float | int | str | bool | None) -> None:
    report(step, kind="status", phase=phase, **extra)


def world_sums(values: list[float], device: torch.device) -> list[float]:
    """Each of `values` summed over all ranks, in float64, in one all-reduce; every rank must call it."""
    t = torch.tensor(values, device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


@dataclass
class WindowSums:
    """A window of steps added up over the ranks: each step's loss (None where no rank holds one),
    whether any rank was asked to stop, and the window's step time summed over steps and ranks."""

    losses: list[float | None]
    flag: bool
    seconds: float


def window_sums_async(
    shares: list[torch.Tensor | None], flag: bool, seconds: float, device: torch.device
) -> torch.futures.Future[WindowSums]:
    """Each step's `shares` summed over the ranks that hold one, `flag` on any rank, `seconds` summed, as a
    future: the all-reduce runs in the background, so no rank waits for it where it is started.

    One all-reduce in float64 for the whole window: on CPU ranks a small all-reduce costs a step of a small
    model several percent, so the loop sends one per few steps rather than one per step. The shares stay
    tensors (no host sync to start it). A collective: every rank must start it with the same number of
    shares, in the same order as its other collectives on the default group.
    """
    holds = any(x is not None for x in shares)
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    head = [zero if x is None else x.detach().reshape(1).to(device=device, dtype=torch.float64) for x in shares]
    rest = torch.tensor([1.0 if holds else 0.0, 1.0 if flag else 0.0, seconds], dtype=torch.float64, device=device)
    t = torch.cat([*head, rest])

    def finish(_: object) -> WindowSums:
        *losses, holders, flags, total_seconds = t.tolist()
        return WindowSums([x if holders > 0 else None for x in losses], flags > 0, total_seconds)

    if not dist.is_initialized():
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done.then(finish)
    return dist.all_reduce(t, async_op=True).get_future().then(finish)
