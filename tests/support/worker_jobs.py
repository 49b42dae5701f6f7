"""Real worker jobs: a job folder written from a spec, run by torchrun on CPU ranks with gloo, and what it wrote."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rigpilot.engine.jobspec.spec import JobSpec

from support.paths import REPO, SHAKESPEARE, TINY_LLAMA_CONFIG

JOB_TIMEOUT_S = 300
WARM_RANK = Path(__file__).with_name("warm_rank.py")
WARM_READY_S = 120  # the warm worker's imports, on a machine the other test worker keeps busy
# The environment the run started with: the warm worker's (a job whose import-time variables a test changed
# since is declined by it, and starts afresh, as it would in the engine).
_SESSION_ENV = dict(os.environ)
_warm: Any = None  # this test process's warm worker (engine.launch.warm.WarmWorker), started on first use


# One training recipe for every Llama run, so runs with the same data-parallel degree see the same
# batches and their losses can be compared across parallelisms.
LLAMA_TRAIN: dict[str, Any] = {
    "dataset": [str(SHAKESPEARE)],
    "method": "scratch",
    "precision": "fp32",
    "seq_len": 32,
    "micro_batch": 2,
    "grad_accum": 2,
    "max_steps": 12,
    "learning_rate": 1e-2,
    "warmup_steps": 2,
    "eval_every": 6,
    "checkpoint_every": 6,
    "seed": 1234,
}


def job_env(job_dir: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["RIGPILOT_METRICS_DIR"] = str(job_dir / "metrics")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def write_job(job_dir: Path, **spec: Any) -> Path:
    JobSpec.from_dict({"id": job_dir.name, **spec}).write(job_dir)
    return job_dir


def torchrun(job_dir: Path, nproc: int = 2, *, log_dir: Path | None = None, warm: bool = False) -> list[str]:
    """torchrun over the job's ranks; `warm`: each rank through support/warm_rank.py (forked when it can be)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir), "--redirects", "3"]
    if warm:
        return [*cmd, str(WARM_RANK), sys.executable, "-u", "-m", "rigpilot.engine.workers", str(job_dir)]
    return [*cmd, "-m", "rigpilot.engine.workers", str(job_dir)]


def warm_socket(wait: bool = True) -> str | None:
    """The socket of this test process's warm worker, started on first use; None when it cannot be had.
    `wait=False`: where its socket will be, without waiting for its imports (the engine looks when a job starts)."""
    global _warm
    from rigpilot.engine.launch import warm

    if _SESSION_ENV.get("RIGPILOT_TEST_WARM") == "0":  # every rank a fresh interpreter, as before
        return None
    if _warm is None:
        base = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/nonexistent")).parent
        if not base.is_dir():
            return None
        folder = base / f"warm-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
        folder.mkdir(mode=0o700, exist_ok=True)
        _warm = warm.WarmWorker(folder, folder / "warm-worker.log")
        env = {**_SESSION_ENV, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        env.pop(warm.SOCKET_ENV, None)
        _warm.start(sys.executable, env)
        atexit.register(_warm.stop)
        # Engines started later in this process, however (CLI, app, benchmarks), look for it too.
        os.environ[warm.SHARED_ENV] = str(_warm.socket_path)
    end = time.monotonic() + WARM_READY_S
    while wait and not _warm.ready():
        if not _warm.running() or time.monotonic() > end:
            return None
        time.sleep(0.1)
    return str(_warm.socket_path) if _warm.running() else None


def run_job(
    job_dir: Path,
    nproc: int = 2,
    expect: int = 0,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    *,
    warm: bool = True,
) -> subprocess.CompletedProcess:
    """Run the job under torchrun; `warm=False`: every rank a fresh interpreter, never forked."""
    socket_path = warm_socket() if warm else None
    proc = subprocess.run(
        torchrun(job_dir, nproc, log_dir=log_dir, warm=socket_path is not None),
        cwd=REPO,
        env={**job_env(job_dir), **({"RIGPILOT_WARM_SOCKET": socket_path} if socket_path else {}), **(env or {})},
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    if (proc.returncode == 0) != (expect == 0):
        pytest.fail(f"job {job_dir.name} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def records(job_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = job_dir / "metrics" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(job_dir: Path, rank: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(job_dir, rank) if r.get("loss") is not None}


def output_tensors(job_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(job_dir / "output" / "model.safetensors")


def notes_of(job: Path) -> list[str]:
    return [r["message"] for r in records(job) if r.get("kind") == "note"]


def save_random_llama(folder: Path, initializer_range: float) -> Path:
    """The tiny example Llama with seeded random weights, saved as a Hugging Face folder with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_LLAMA_CONFIG.parent, initializer_range=initializer_range)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_LLAMA_CONFIG.parent).save_pretrained(folder)
    return folder


def assert_loss_falls(job_dir: Path, margin: float) -> dict[int, float]:
    curve = losses(job_dir)
    steps = sorted(curve)
    first, last = curve[steps[0]], sum(curve[s] for s in steps[-3:]) / 3
    assert last < first - margin, f"loss did not fall: {curve}"
    return curve


def assert_same_curve(a: dict[int, float], b: dict[int, float], tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(abs(a[s] - b[s]) for s in a)
    assert worst < tol, f"curves differ by {worst}:\n{a}\n{b}"


def llama_job(root: Path, name: str, parallelism: dict[str, Any], nproc: int = 2, **train: Any) -> Path:
    job = write_job(
        root / name,
        kind="train",
        model=str(TINY_LLAMA_CONFIG),
        parallelism=parallelism,
        train={**LLAMA_TRAIN, **train},
    )
    run_job(job, nproc)
    return job


def resume_from(job: Path, step: int) -> Path:
    """A fresh job folder holding only `job`'s checkpoint at `step`, resumed to the same max_steps."""
    again = job.parent / f"{job.name}-resumed"
    spec = JobSpec.read(job)
    spec.resume = True
    spec.write(again)
    shutil.copytree(job / "checkpoints" / f"step-{step}", again / "checkpoints" / f"step-{step}")
    run_job(again, spec.parallelism.world_size)
    return again
