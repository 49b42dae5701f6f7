"""A throwaway engine service for the engine benchmarks: its own XDG folders, a simulated machine."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
