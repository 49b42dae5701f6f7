"""What telemetry costs: microseconds per sample and CPU share of one core at 1 Hz and 10 Hz.

    .venv/bin/python benchmarks/telemetry_sample.py [--seconds 10]

Measures the simulated 8×H100 machine, the real NVML backend code running
against a fake-NVML replay of it (the code path of a real machine, minus the
driver), and the real GPUs when NVML finds any. Target: under 1% of one core
at 1 Hz for 8 GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from rigpilot.engine.hardware.sampler import Sampler
from rigpilot.engine.hardware.simulated import SimulatedBackend, load_profile
from rigpilot.engine.hardware.telemetry import Tier


def per_sample_us(backend, tier: Tier, n: int = 300) -> float:
    backend.sample_gpus(tier)  # warm caches and counters
    times = []
    for _ in range(n):
        t = time.perf_counter()
        backend.sample_gpus(tier)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def cpu_share(backend, hz: float, seconds: float) -> tuple[float, int]:
    """Share of one core the sampler thread uses at `hz`, from process CPU time over wall time."""
    sampler = Sampler(backend, period=1.0 / hz, slow_period=5.0)
    count = 0

    def on_sample(_):
        nonlocal count
        count += 1

    sampler.subscribe(on_sample)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0) * 100, count


def report(name: str, backend, seconds: float) -> None:
    n = len(backend.machine().gpus)
    fast, slow = per_sample_us(backend, Tier.FAST), per_sample_us(backend, Tier.SLOW)
    one, c1 = cpu_share(backend, 1.0, seconds)
    ten, c10 = cpu_share(backend, 10.0, seconds)
    verdict = "meets" if one < 1.0 else "MISSES"
    print(
        f"{name:<34} {n:>4} {fast:>10.0f} {slow:>10.0f} {one:>9.3f}% ({c1:>3}) {ten:>9.3f}% ({c10:>3})   {verdict} <1% at 1 Hz"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="wall time per CPU-share run")
    args = ap.parse_args()
    print(f"{'backend':<34} {'GPUs':>4} {'fast µs':>10} {'slow µs':>10} {'CPU @1Hz (n)':>16} {'CPU @10Hz (n)':>16}")
    machine = load_profile("8x-h100-sxm")
    report("simulated 8×H100 SXM", SimulatedBackend(machine), args.seconds)

    from rigpilot.engine.hardware.nvml_backend import NvmlBackend, NvmlUnavailable
    from rigpilot.engine.hardware.nvml_replay import FakeNvml

    fake = FakeNvml(machine, SimulatedBackend(machine))
    report("NVML code on fake-NVML 8×H100", NvmlBackend(nvml=fake), args.seconds)

    with contextlib.suppress(NvmlUnavailable):
        real = NvmlBackend()
        if real.machine().gpus:
            report(f"real NVML: {real.machine().summary_name}", real, args.seconds)
        else:
            print("real NVML: no GPUs found")
        real.close()
        return
    print("real NVML: not available on this machine (no driver)")


if __name__ == "__main__":
    main()
