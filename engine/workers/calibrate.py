"""Calibration (kind "calibrate"): what this machine really delivers, measured on the job's ranks.

- matmul TFLOP/s of every rank at a few square sizes, in the job's precision;
- all-reduce bandwidth of the whole group, as nccl-tests report it:
  algbw = bytes / time, busbw = algbw * 2(n-1)/n (the per-link rate a ring needs);
- point-to-point copy bandwidth for every ordered pair of ranks (send/recv).

Results go to output/calibration.json (rank 0), in the planner's calibration format
(engine/planner/calibration.py: `rigpilot plan --calibration` reads it, and the
engine keeps its machine's latest), and to every rank's metrics.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.planner.calibration import DTYPES, MachineCalibration, now_iso
from rigpilot.engine.report import report
from rigpilot.engine.workers import EXIT_OK
from rigpilot.engine.workers.metrics import status
from rigpilot.engine.workers.parallel_dims import init_runtime
from rigpilot.engine.workers.parallelize import precision_dtype

MIB = 1 << 20
GPU_MATMUL_SIZES = (1024, 2048, 4096, 8192)
CPU_MATMUL_SIZES = (128, 256, 512)
GPU_COMM_BYTES = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
CPU_COMM_BYTES = (256 * 1024, 1 * MIB, 4 * MIB)  # gloo on loopback: keep a CPU run short


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call after warm-up."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def matmul_tflops(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> dict[int, float]:
    out: dict[int, float] = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        iters = 20 if device.type == "cuda" else 3
        seconds = timed(functools.partial(torch.mm, a, b), device, iters)
        out[n] = 2 * n**3 / seconds / 1e12
    return out


def all_reduce_bandwidth(device: torch.device, world: int, sizes: tuple[int, ...]) -> list[dict[str, float]]:
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        iters = 20 if device.type == "cuda" else 3
        dist.barrier()
        seconds = timed(functools.partial(dist.all_reduce, t), device, iters)
        algbw = nbytes / seconds / 1e9
        rows.append(
            {"bytes": nbytes, "time_s": seconds, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world}
        )
    return rows


def p2p_bandwidth(device: torch.device, rank: int, world: int, nbytes: int) -> list[dict[str, float]]:
    """Every ordered pair in turn (the others wait), so each figure is one link alone."""
    rows = []
    t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    iters = 10 if device.type == "cuda" else 3
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            dist.barrier()
            if rank == src:
                seconds = timed(functools.partial(dist.send, t, dst=dst), device, iters, warmup=1)
            elif rank == dst:
                seconds = timed(functools.partial(dist.recv, t, src=src), device, iters, warmup=1)
            else:
                continue
            if rank == dst:  # the receiver's clock includes the whole transfer
                rows.append(
                    {"src": src, "dst": dst, "bytes": nbytes, "time_s": seconds, "gbps": nbytes / seconds / 1e9}
                )
    return rows


def machine_index(spec: JobSpec, rank: int, local_rank: int) -> int:
    """The machine's GPU index this rank measured (the supervisor lists them in RIGPILOT_GPUS)."""
    listed = [int(x) for x in os.environ.get("RIGPILOT_GPUS", "").split(",") if x.strip()]
    if local_rank < len(listed):
        return listed[local_rank]
    return spec.gpus[rank] if rank < len(spec.gpus) else rank


def _driver() -> tuple[str | None, int | None]:
    """The NVIDIA driver version and the machine's GPU count, from NVML, when it answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML here (a CPU run, a container without the library): identity by names alone
        return None, None
    return (version.decode() if isinstance(version, bytes) else str(version)), int(count)


def run_calibrate(spec: JobSpec, job_dir: Path) -> int:
    runtime = init_runtime(spec)
    device, rank, world = runtime.device, runtime.rank, runtime.world_size
    precision = (
        (spec.train.precision if spec.train else None) or (spec.infer.precision if spec.infer else None) or "bf16"
    )
    gpu = device.type == "cuda"
    # GPUs: every dtype the planner plans in. CPU ranks: the job's one (they are labelled and never applied).
    dtypes = DTYPES if gpu else (precision,)
    status("calibrating", precision=precision)
    tflops: dict[str, dict[int, float]] = {}
    for name in dtypes:
        tflops[name] = matmul_tflops(device, precision_dtype(name), GPU_MATMUL_SIZES if gpu else CPU_MATMUL_SIZES)
        for n, value in tflops[name].items():
            report(kind="calibration", test="matmul", dtype=name, size=n, tflops=value)
    all_reduce = all_reduce_bandwidth(device, world, GPU_COMM_BYTES if gpu else CPU_COMM_BYTES) if world > 1 else []
    for row in all_reduce:
        report(None, kind="calibration", test="all_reduce", **row)  # no step: none of the row is taken for one
    p2p = p2p_bandwidth(device, rank, world, (GPU_COMM_BYTES if gpu else CPU_COMM_BYTES)[-1]) if world > 1 else []
    for row in p2p:
        report(None, kind="calibration", test="p2p", **row)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    name = torch.cuda.get_device_name(device) if gpu else platform.processor() or platform.machine()
    index = machine_index(spec, rank, runtime.local_rank)
    mine = {"rank": rank, "gpu": index, "device": name, "matmul_tflops": tflops, "p2p": p2p}
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        per_rank = sorted(gathered or [], key=lambda r: r["rank"])
        driver, count = _driver() if gpu else (None, None)
        result = calibration_file(
            per_rank, all_reduce, simulated=spec.simulated or not gpu, device_type=device.type,
            backend=runtime.backend, precision=precision, driver=driver, gpu_count=count,
        )  # fmt: skip
        out = job_dir / "output"
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"[rank0] calibration written to {out / 'calibration.json'}", flush=True)
    status("done", exit_code=EXIT_OK)
    return EXIT_OK


def calibration_file(
    per_rank: list[dict[str, Any]], all_reduce: list[dict[str, float]], *, simulated: bool, device_type: str,
    backend: str, precision: str, driver: str | None, gpu_count: int | None,
) -> dict[str, Any]:  # fmt: skip
    """The ranks' rows as the planner's calibration file (engine/planner/calibration.py)."""
    gpus = {r["rank"]: r["gpu"] for r in per_rank}
    matmul: dict[str, dict[int, float]] = {}
    for r in per_rank:
        for dtype, by_size in r["matmul_tflops"].items():
            # The largest square reaches the GEMM rate a training step's big matmuls see.
            matmul.setdefault(dtype, {})[r["gpu"]] = by_size[max(by_size)]
    bus = {}
    if all_reduce:
        group = ",".join(str(g) for g in sorted(gpus.values()))
        bus[group] = max(all_reduce, key=lambda row: row["bytes"])["busbw_gbps"]
    p2p: dict[str, float] = {}
    for r in per_rank:
        for row in r["p2p"]:
            p2p[f"{gpus[row['src']]}->{gpus[row['dst']]}"] = row["gbps"]
    cal = MachineCalibration(
        measured_at=now_iso(),
        simulated=simulated,
        gpus={r["gpu"]: r["device"] for r in per_rank},
        device_type=device_type,
        backend=backend,
        precision=precision,
        gpu_count=gpu_count,
        driver=driver,
        matmul_tflops=matmul,
        bus_bandwidth_gbs=bus,
        p2p_gbs=p2p,
        detail={
            "ranks": [
                {"rank": r["rank"], "gpu": r["gpu"], "device": r["device"],
                 "matmul_tflops": {d: {str(k): v for k, v in by.items()} for d, by in r["matmul_tflops"].items()}}
                for r in per_rank
            ],
            "all_reduce": all_reduce,
            "p2p": [row for r in per_rank for row in r["p2p"]],
        },
    )  # fmt: skip
    return cal.to_dict()
