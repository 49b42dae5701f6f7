"""What the engine benchmarks share: a throwaway engine service (its own XDG folders, a simulated machine), and for
the loop-speed benchmarks the torchrun launcher, the round loop and the rates."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"


def wait(predicate, timeout: float, what: str, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(interval)


@contextmanager
def scratch_engine(*service_args: str, profile: str = "4x-rtx4090") -> Iterator[tuple[subprocess.Popen, Path]]:
    """Start a service in a temporary home; yield (process, folder); stop it and its jobs after."""
    from rigpilot.engine.api.client import EngineClient

    with tempfile.TemporaryDirectory(prefix="rpbench") as tmp:
        root = Path(tmp)
        run = root / "r"
        run.mkdir(mode=0o700)
        os.environ.update(
            XDG_RUNTIME_DIR=str(run), XDG_STATE_HOME=str(root / "state"), XDG_CONFIG_HOME=str(root / "config"),
            RIGPILOT_SIMULATE=profile,
        )  # fmt: skip
        log = (root / "engine.log").open("ab")
        proc = subprocess.Popen([sys.executable, "-m", "rigpilot.engine.service", *service_args], cwd=REPO, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with EngineClient(autostart=False, timeout=5):
                        break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError((root / "engine.log").read_text()) from None
                    time.sleep(0.05)
            yield proc, root
        finally:
            with EngineClient(autostart=False, timeout=5) as c:
                for job in c.request("jobs")["jobs"]:
                    if job["state"] in ("queued", "starting", "running"):
                        c.request("cancel", job=job["id"])
            proc.terminate()
            proc.wait(30)
            _kill_jobs(root)


def _kill_jobs(root: Path) -> None:
    import psutil

    for p in psutil.process_iter():
        try:
            if p.environ().get("RIGPILOT_JOB_DIR", "").startswith(str(root)):
                p.kill()
        except (psutil.Error, OSError):
            pass


# --- loop-speed benchmarks: one torchrun whose ranks run every loop, round after round ------------------------


def steady_rate(times: list[float], warmup: int) -> float:
    """times[i]: when step i + 1 ended."""
    return (len(times) - warmup) / (times[-1] - times[warmup - 1])


def typical_rate(times: list[float], warmup: int) -> float:
    """1 / the median step after warm-up: steadier than the wall-clock rate when other work shares the cores."""
    return 1 / statistics.median(b - a for a, b in zip(times[warmup - 1 :], times[warmup:], strict=False))


def spread(values: list[float], digits: int = 2) -> str:
    """Median (min..max), as the speed tables print a loop's rounds."""
    return f"{statistics.median(values):7.{digits}f}  ({min(values):.{digits}f}..{max(values):.{digits}f})"


def engine_loop(spec: Any, rt: Any, job_dir: Path) -> tuple[float, list[dict[str, Any]]]:
    """The engine's own training loop (engine.workers.train.Trainer: setup, then run) in this rank, with all it
    does in a job: when the loop started after its set-up, and its step records in step order."""
    from rigpilot.engine.report import METRICS_DIR_ENV
    from rigpilot.engine.workers.train import Trainer

    os.environ[METRICS_DIR_ENV] = str(job_dir / "metrics")
    trainer = Trainer(spec, job_dir, rt)
    trainer.setup()
    started = time.time()
    trainer.run()
    steps: dict[int, dict[str, Any]] = {}
    for line in (job_dir / "metrics" / f"rank{rt.rank}.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") is None and isinstance(r.get("step"), int):
            steps[r["step"]] = r
    return started, [steps[s] for s in sorted(steps)]


def run_rounds(
    loops: list[str], rounds: int, run: Callable[[str, int], dict[str, Any]], warmup: int
) -> dict[str, list]:
    """Every loop once a round, the order rotated each round so drift favours none; the ranks meet before each.
    `run(name, round)` returns a dict with the step end "times"; they become "rate" and "typical"."""
    import torch.distributed as dist

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
    for rnd in range(rounds):
        for name in loops[rnd % len(loops) :] + loops[: rnd % len(loops)]:
            dist.barrier()
            out = run(name, rnd)
            times = out.pop("times")
            out.update(rate=steady_rate(times, warmup), typical=typical_rate(times, warmup))
            results[name].append(out)
    return results


def finish_ranks(results: dict[str, list], work: Path) -> None:
    """Rank 0 leaves the results for the launcher; every rank leaves the process group."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch_ranks(script: str, ranks: int, work: Path, argv: list[str], env: dict[str, str] | None = None) -> dict:
    """One torchrun of `script --rank-main --work WORK ARGV` on `ranks` CPU ranks; the results rank 0 wrote.
    A failed run exits with the ranks' last log lines."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", script,
           "--rank-main", "--work", str(work), *argv]  # fmt: skip
    log = work / "ranks.log"
    with log.open("wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if rc != 0:
        sys.exit(f"the ranks failed (exit {rc}):\n" + log.read_text()[-4000:])
    return json.loads((work / "results.json").read_text())


def forwarded(args: argparse.Namespace, *names: str) -> list[str]:
    """The launcher's own options, as the ranks' command line repeats them."""
    out = []
    for name in names:
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out
