"""The machine check's ranks (job kind "doctor"): what only torch can measure, each check bounded by a deadline.

One rank per GPU. Each rank checks its own GPU (matmul at each precision, memory bandwidth); rank 0, which
sees every GPU of the job, copies a known pattern between each pair in both directions and compares it
bit for bit (the consumer-card case where peer copies return wrong data), and times the same copy
through host memory; then every pair runs an all-reduce in its own group, and all GPUs one together.

A collective that does not finish by its deadline is a hang: the ranks agree on it over a separate gloo
group (a hung NCCL kernel holds its GPU until the process ends, so no later collective could be trusted),
rank 0 writes what was measured with the pair named, and the ranks leave at once rather than hang in
teardown. The engine completes the report with what NVML says (engine/jobs/doctor_store.py).

On a simulated machine the same code runs on CPU ranks over gloo; the simulated machine's planted link
faults (RIGPILOT_SIMULATED_LINK_FAULTS, "0-1:corrupt,2-3:hang") stand in for a broken peer path: a
corrupt pair's copies come back with flipped words, a hung pair's second rank never joins its all-reduce.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rigpilot.engine.hardware.doctor import DEADLINE_ENV, FAULTS_ENV, LINK_FAULTS, SCHEMA
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.planner.calibration import now_iso
from rigpilot.engine.report import report
from rigpilot.engine.workers import ERROR_PREFIX, EXIT_OK
from rigpilot.engine.workers.calibrate import machine_index, sync, timed
from rigpilot.engine.workers.metrics import status
from rigpilot.engine.workers.parallel_dims import init_runtime

MIB = 1 << 20
GPU_DEADLINE_S = 30.0  # NCCL's first collective on a pair connects it: seconds, not milliseconds
CPU_DEADLINE_S = 15.0  # gloo on a busy 2-core machine: a sound pair must never look hung
OUTPUT = Path("output") / "doctor.json"
EXIT_HUNG = 3  # a check outlived its deadline: the job ends failed, its report written and naming the check


class Sizes:
    def __init__(self, gpu: bool):
        self.matmul = (4096, 8192) if gpu else (256,)
        self.memory = 1024 * MIB if gpu else 32 * MIB
        self.copy = 256 * MIB if gpu else 4 * MIB
        self.all_reduce = 64 * MIB if gpu else 1 * MIB
        self.iters = 10 if gpu else 3


def parse_faults(text: str | None) -> dict[tuple[int, int], str]:
    """{(a, b): fault} from "0-1:corrupt,2-3:hang"; anything unreadable is left out (engine.hardware.simulated
    LINK_FAULTS says what each does)."""
    out: dict[tuple[int, int], str] = {}
    for item in (text or "").split(","):
        pair, _, fault = item.strip().partition(":")
        a, _, b = pair.partition("-")
        if a.isdigit() and b.isdigit() and a != b and fault in LINK_FAULTS:
            out[(min(int(a), int(b)), max(int(a), int(b)))] = fault
    return out


def _check(name: str, status_: str, seconds: float, figures: dict[str, Any], why: str | None = None) -> dict[str, Any]:
    return {"check": name, "status": status_, "seconds": round(seconds, 4), "figures": figures, "why": why}


# -- one GPU ---------------------------------------------------------------------------------------------
def _dtypes(gpu: bool) -> dict[str, torch.dtype]:
    if gpu:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}
    return {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_check(device: torch.device, sizes: Sizes, peaks: dict[str, float | None]) -> dict[str, Any]:
    t0 = time.perf_counter()
    tflops: dict[str, float] = {}
    gpu = device.type == "cuda"
    for name, dtype in _dtypes(gpu).items():
        if gpu:
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        best = 0.0
        for n in sizes.matmul:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            seconds = timed(functools.partial(torch.mm, a, b), device, sizes.iters, warmup=1)
            best = max(best, 2 * n**3 / seconds / 1e12)
        tflops[name] = round(best, 3)
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
    figures = {"tflops": tflops, "peak_tflops": {k: v for k, v in peaks.items() if k in tflops and v}}
    return _check("matmul", "ok", time.perf_counter() - t0, figures)


def memory_check(device: torch.device, sizes: Sizes, peak_gbs: float | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    src = torch.empty(sizes.memory, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(functools.partial(dst.copy_, src), device, sizes.iters, warmup=1)
    gbs = 2 * sizes.memory / seconds / 1e9  # a copy reads and writes every byte
    del src, dst  # 1 GiB each on a GPU: not held through the pair checks
    return _check("memory_bandwidth", "ok", time.perf_counter() - t0, {"gbs": round(gbs, 2), "peak_gbs": peak_gbs})


def _peaks(name: str, memory: int | None) -> tuple[dict[str, float | None], float | None]:
    from rigpilot.engine.hardware.specs import match_spec

    spec = match_spec(name, memory)
    if spec is None:
        return {}, None
    return {d: spec.peak_tflops(d) for d in ("bf16", "fp16", "tf32", "fp32")}, spec.memory_bandwidth_gbs


def software_check() -> dict[str, Any]:
    """The driver's CUDA against the one PyTorch was built for: a newer build than the driver runs nothing."""
    t0 = time.perf_counter()
    figures: dict[str, Any] = {"torch": torch.__version__, "cuda_torch": torch.version.cuda}
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        finally:
            pynvml.nvmlShutdown()
        figures["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        figures["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except Exception:  # no NVML in this process: the engine's own reading stands
        return _check("software", "skipped", time.perf_counter() - t0, figures, "nvml_unavailable")
    too_new = figures["cuda_torch"] and _version(figures["cuda_torch"]) > _version(figures["cuda_driver"])
    return _check("software", "fail" if too_new else "ok", time.perf_counter() - t0, figures,
                  "cuda_too_new" if too_new else None)  # fmt: skip


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:2] if x.isdigit())


# -- pairs, in rank 0 ------------------------------------------------------------------------------------
def _pattern(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, generator=g).to(device)


def copy_check(
    a: int, b: int, devices: dict[int, torch.device], sizes: Sizes, fault: str | None
) -> dict[str, Any]:  # fmt: skip
    """A pattern copied GPU a -> b and b -> a, compared word for word; the copy's rate against the host path."""
    t0 = time.perf_counter()
    corrupt = fault == "corrupt"
    if fault == "stall":  # the simulated peer copy that never returns: the watchdog's to catch
        time.sleep(3600)
    da, db = devices[a], devices[b]
    mismatched = 0
    for src, dst, seed in ((da, db, a * 1000 + b), (db, da, b * 1000 + a)):
        x = _pattern(sizes.copy, seed, src)
        y = x.to(dst, copy=True)  # on CPU ranks `to` the same device would hand back x itself
        if corrupt:  # the simulated broken peer path: what a bad P2P copy looks like, a few words flipped
            y.view(-1)[:: max(1, y.numel() // 7)] ^= 0x5A5A5A5A
        sync(dst)
        mismatched += int((y.cpu() != x.cpu()).sum())
    x = _pattern(sizes.copy, 7, da)
    out = torch.empty_like(x, device=db)
    peer_s = timed(lambda: out.copy_(x, non_blocking=True), da, sizes.iters, warmup=1)
    sync(db)
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=da.type == "cuda")

    def through_host() -> None:
        staged.copy_(x)
        out.copy_(staged)

    host_s = timed(through_host, da, sizes.iters, warmup=1)
    sync(db)
    figures = {
        "bytes": sizes.copy,
        "correct": mismatched == 0,
        "mismatched": mismatched,
        "gbs": round(sizes.copy / peer_s / 1e9, 3),
        "host_gbs": round(sizes.copy / host_s / 1e9, 3),
    }
    return _check("p2p_copy", "ok" if mismatched == 0 else "fail", time.perf_counter() - t0, figures)


# -- collectives with a deadline ------------------------------------------------------------------------
def all_reduce_check(
    group: Any, members: int, device: torch.device, sizes: Sizes, deadline_s: float, *, stay_out: bool
) -> dict[str, Any]:  # fmt: skip
    """busbw of an all-reduce in `group`, or status timeout when it does not finish within the deadline."""
    t0 = time.perf_counter()
    figures: dict[str, Any] = {"bytes": sizes.all_reduce, "deadline_s": deadline_s}
    if stay_out:  # the simulated hung peer: never joins, so its partner's all-reduce cannot finish
        time.sleep(deadline_s)
        return _check("all_reduce", "timeout", time.perf_counter() - t0, figures, "all_reduce_hung")
    t = torch.ones(sizes.all_reduce // 4, dtype=torch.float32, device=device)
    end = time.monotonic() + deadline_s
    started = None
    for i in range(1 + sizes.iters):  # the first connects the group and is left out of the timing
        if i == 1:
            sync(device)
            started = time.perf_counter()
        work = dist.all_reduce(t, group=group, async_op=True)
        while not _done(work):
            if time.monotonic() > end:
                return _check("all_reduce", "timeout", time.perf_counter() - t0, figures, "all_reduce_hung")
            time.sleep(0.002)
    sync(device)
    seconds = (time.perf_counter() - (started or t0)) / sizes.iters
    algbw = sizes.all_reduce / seconds / 1e9
    figures["busbw_gbs"] = round(algbw * 2 * (members - 1) / members, 3)
    return _check("all_reduce", "ok", time.perf_counter() - t0, figures)


def _done(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # gloo's own timeout fired first: the collective failed, which is a hang to us
        return False


# -- the report as far as it got ---------------------------------------------------------------------------
class Draft:
    """What rank 0 has measured so far, written as the ranks' half of the report (the engine completes it)."""

    def __init__(
        self, job_dir: Path, spec: JobSpec, backend: str, device: torch.device, started: float,
        per_gpu: list[Any], pairs: list[tuple[int, int]], results: dict[tuple[int, int], list[dict[str, Any]]],
    ) -> None:  # fmt: skip
        self.job_dir, self.spec, self.backend, self.device, self.started = job_dir, spec, backend, device, started
        self.per_gpu, self.pairs, self.results = per_gpu, pairs, results
        self.stopped: dict[str, Any] | None = None
        self.group_checks: list[dict[str, Any]] = []

    def write(self) -> None:
        gpus = sorted(r["gpu"] for r in self.per_gpu)
        body = {
            "schema": SCHEMA,
            "measured_at": now_iso(),
            "duration_s": round(time.perf_counter() - self.started, 2),
            "simulated": bool(self.spec.simulated or self.device.type != "cuda"),
            "device_type": self.device.type,
            "backend": self.backend,
            "machine": {"gpus": {str(r["gpu"]): r["name"] for r in self.per_gpu}, "torch": torch.__version__},
            "complete": self.stopped is None,
            "stopped": self.stopped,
            "gpus": [{"gpu": r["gpu"], "name": r["name"], "checks": r["checks"]}
                     for r in sorted(self.per_gpu, key=lambda r: r["gpu"])],
            "pairs": [{"gpus": [a, b], "checks": self.results[(a, b)]} for a, b in self.pairs],
            "groups": [{"gpus": gpus, "checks": self.group_checks}] if self.group_checks else [],
            "findings": [],
            "actions": {},
        }  # fmt: skip
        out = self.job_dir / OUTPUT
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(".doctor.json.tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, out)
        print(f"[rank0] machine check written to {out}", flush=True)


class Watchdog:
    """Bounds a check that has no deadline of its own (a peer copy blocks in the driver): when it outlives the
    deadline, what was measured is written with the check named, and the rank ends, which ends the job."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s

    @contextlib.contextmanager
    def arm(self, draft: Draft, gpus: list[int], check: str) -> Iterator[None]:
        timer = threading.Timer(self.deadline_s, self._fire, args=(draft, gpus, check))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _fire(self, draft: Draft, gpus: list[int], check: str) -> None:
        a, b = gpus
        draft.results[(a, b)].append({"check": check, "status": "timeout", "seconds": self.deadline_s,
                                      "figures": {"deadline_s": self.deadline_s}, "why": f"{check}_hung"})  # fmt: skip
        draft.stopped = {"code": f"{check}_hung", "severity": "fail", "gpus": gpus,
                         "fields": {"deadline_s": self.deadline_s, "check": check}}  # fmt: skip
        try:
            draft.write()
        finally:
            # The job's reason (engine.jobs.runs reads the failed rank's error record): a code, its facts, a line.
            what = "a peer-to-peer copy" if check == "p2p_copy" else check
            line = f"{what} between GPUs {a} and {b} did not finish within {self.deadline_s:g} s"
            report(kind="error", error=f"{check}_hung", message=line, gpus=f"{a},{b}", deadline_s=self.deadline_s)
            print(f"{ERROR_PREFIX} the machine check stopped: {line}", file=sys.stderr, flush=True)
            os._exit(EXIT_HUNG)


# -- the job ---------------------------------------------------------------------------------------------
def run_doctor(spec: JobSpec, job_dir: Path) -> int:
    runtime = init_runtime(spec)
    device, rank, world = runtime.device, runtime.rank, runtime.world_size
    gpu = device.type == "cuda"
    sizes = Sizes(gpu)
    started = time.perf_counter()
    deadline = float(os.environ.get(DEADLINE_ENV) or (GPU_DEADLINE_S if gpu else CPU_DEADLINE_S))
    faults = parse_faults(os.environ.get(FAULTS_ENV)) if spec.simulated else {}
    # Hangs are agreed on over gloo: a group that cannot itself be stuck behind a hung NCCL kernel.
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=deadline * 4 + 120))
    index = machine_index(spec, rank, runtime.local_rank)
    name = torch.cuda.get_device_name(device) if gpu else (platform.processor() or platform.machine() or "CPU")
    memory = torch.cuda.get_device_properties(device).total_memory if gpu else None

    status("checking", check="matmul", gpu=index)
    peaks, peak_gbs = _peaks(name, memory) if gpu else ({}, None)
    checks: list[dict[str, Any]] = [matmul_check(device, sizes, peaks)]
    status("checking", check="memory_bandwidth", gpu=index)
    checks.append(memory_check(device, sizes, peak_gbs))
    if rank == 0 and gpu:
        checks.append(software_check())
    per_gpu: list[Any] = [None] * world
    dist.all_gather_object(per_gpu, {"rank": rank, "gpu": index, "name": name, "checks": checks}, group=control)
    ranks_of = {r["gpu"]: r["rank"] for r in per_gpu}
    gpus = sorted(ranks_of)
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    results: dict[tuple[int, int], list[dict[str, Any]]] = {p: [] for p in pairs}
    draft = Draft(job_dir, spec, runtime.backend, device, started, per_gpu, pairs, results)
    watchdog = Watchdog(deadline)

    if rank == 0:  # rank 0 sees every GPU of the job (CUDA_VISIBLE_DEVICES lists them all)
        devices = {g: torch.device("cuda", ranks_of[g]) if gpu else device for g in gpus}
        for a, b in pairs:
            status("checking", check="p2p_copy", gpus=f"{a},{b}")
            with watchdog.arm(draft, [a, b], "p2p_copy"):
                results[(a, b)].append(copy_check(a, b, devices, sizes, faults.get((a, b))))
    try:
        dist.barrier(group=control)
    except RuntimeError:  # rank 0's watchdog ended the check: it wrote the report and said why
        os._exit(EXIT_HUNG)

    stopped = None
    for a, b in pairs:
        members = [ranks_of[a], ranks_of[b]]
        group = dist.new_group(members, timeout=datetime.timedelta(seconds=deadline * 2 + 60))
        mine = None
        if rank in members:
            if rank == members[0]:  # one progress line per pair, not one per rank
                status("checking", check="all_reduce", gpus=f"{a},{b}")
            stay_out = faults.get((a, b)) == "hang" and rank == members[1]
            mine = all_reduce_check(group, 2, device, sizes, deadline, stay_out=stay_out)
        seen: list[Any] = [None] * world
        dist.all_gather_object(seen, mine, group=control)
        done = [c for c in seen if c is not None]
        hung = any(c["status"] == "timeout" for c in done)
        if done:
            results[(a, b)].append(next((c for c in done if c["status"] == "timeout"), done[0]))
        if hung:
            stopped = {"code": "all_reduce_hung", "severity": "fail", "gpus": [a, b],
                       "fields": {"deadline_s": deadline, "check": "all_reduce"}}  # fmt: skip
            break
    group_checks = []
    if stopped is None and world > 2:
        if rank == 0:
            status("checking", check="all_reduce", gpus=",".join(map(str, gpus)))
        mine = all_reduce_check(None, world, device, sizes, deadline, stay_out=False)
        seen = [None] * world
        dist.all_gather_object(seen, mine, group=control)
        worst = next((c for c in seen if c["status"] == "timeout"), seen[0])
        group_checks.append(worst)
        if worst["status"] == "timeout":
            stopped = {"code": "all_reduce_hung", "severity": "fail", "gpus": gpus,
                       "fields": {"deadline_s": deadline, "check": "all_reduce"}}  # fmt: skip

    draft.stopped, draft.group_checks = stopped, group_checks
    if rank == 0:
        draft.write()
    status("done", exit_code=EXIT_OK)
    if stopped is not None:
        # A hung collective stays queued on its GPU: tearing the groups down would wait on it forever.
        dist.barrier(group=control)
        os._exit(EXIT_OK)
    return EXIT_OK
