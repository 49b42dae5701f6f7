"""A real engine service for a test: its own XDG folders in tmp_path, a simulated machine, helpers to talk to it.

Jobs are small scripts (below) that report metrics through `rigpilot.report`; the gate script waits on a
file so the test decides when its job ends. The `engine` fixture built on this lives in tests/engine/conftest.py.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from rigpilot.engine.api.client import EngineClient
from rigpilot.engine.launch import warm

from support.paths import REPO
from support.waiting import wait_for
from support.worker_jobs import warm_socket

GATE_SCRIPT = """
import os, sys, time, pathlib
from rigpilot import report
rank = int(os.environ["RANK"])
gate = pathlib.Path(sys.argv[1])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} starts (run {os.environ['RIGPILOT_RUN']})", flush=True)
step = 0
while not gate.exists():
    report(step=step, loss=1.0 / (step + 1), tokens_per_s=1000.0, peak_memory=(3 + rank) * 2**30)
    step += 1
    time.sleep(0.1)
    if step > 900:
        sys.exit(5)  # a test that forgot its gate must not leave this running
report(step=step, loss=0.01)
print(f"rank {rank} done", flush=True)
"""


QUICK_SCRIPT = """
import os
from rigpilot import report
for step in range(1, 4):
    report(step=step, loss=4.0 - step, max_steps=3)
print("quick rank", os.environ["RANK"], "finished")
"""


CRASH_SCRIPT = """
import os, sys, time
from rigpilot import report
rank = int(os.environ["RANK"])
report(step=0, loss=1.0)
if rank == 1:
    time.sleep(0.5)
    print("rank 1 is about to fail", flush=True)
    raise RuntimeError("boom on rank 1")
while True:
    time.sleep(0.1)
"""


OOM_SCRIPT = """
import sys
from rigpilot import report
report(step=1, loss=2.0, peak_memory=20 * 2**30)
report(kind="error", error="out_of_memory", allocated=22 * 2**30, total=24 * 2**30)
print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
sys.exit(1)
"""


class Engine:
    """A service subprocess plus helpers; the XDG folders live in tmp_path."""

    def __init__(self, tmp: Path, *, warm_shared: bool = True):
        self.tmp = tmp
        # Its ranks fork from the test process's warm worker (support.worker_jobs.warm_socket) where they can.
        self.warm_shared = warm_shared
        self.proc: subprocess.Popen | None = None
        self.scripts = tmp / "scripts"
        self.scripts.mkdir(exist_ok=True)

    def start(self, *extra: str) -> None:
        self.log = (self.tmp / "engine.log").open("ab")
        cmd = [sys.executable, "-m", "rigpilot.engine.service", "--grace", "3", "--failure-grace", "2",
               "--telemetry-period", "0.25", *extra]  # fmt: skip
        env = dict(os.environ)
        shared = warm_socket(wait=False) if self.warm_shared else None
        if shared:
            env[warm.SHARED_ENV] = shared
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=self.log, env=env)
        wait_for(self._answers, 30, what="the engine service to start")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"service exited with {self.proc.returncode}: {(self.tmp / 'engine.log').read_text()}")
        try:
            with EngineClient(autostart=False, timeout=5) as c:
                return c.hello["pid"] == self.proc.pid
        except Exception:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self) -> EngineClient:
        c = EngineClient(autostart=False, timeout=30)
        c.connect()
        return c

    def script(self, name: str, text: str) -> str:
        p = self.scripts / name
        p.write_text(text)
        return str(p)

    def submit(self, c: EngineClient, script: str, *args: str, gpus: list[int], name: str = "") -> dict:
        spec = {"kind": "script", "script": [script, *args], "gpus": gpus, "name": name}
        return c.request("submit", spec=spec, cwd=str(self.tmp))["job"]

    def job(self, c: EngineClient, job_id: str) -> dict:
        return c.request("job", job=job_id)["job"]

    def wait_state(self, c: EngineClient, job_id: str, *states: str, timeout: float = 60) -> dict:
        return wait_job_state(c, job_id, *states, timeout=timeout)


def wait_job_state(c: EngineClient, job_id: str, *states: str, timeout: float = 60) -> dict:
    """The job's record, once its state is one of `states` (asked over `c`, which may be any engine's client)."""
    return wait_for(
        lambda: (j := c.request("job", job=job_id)["job"])["state"] in states and j, timeout, 0.1,
        f"job {job_id} to be {states}",
    )


def leftover_job_processes(root: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("RIGPILOT_JOB_DIR", "").startswith(str(root)):
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


def engine_home(base: Path, monkeypatch) -> None:
    """Point the engine's XDG folders into `base`, on the simulated 4×RTX 4090."""
    run_dir = base / "r"
    run_dir.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run_dir))
    monkeypatch.setenv("XDG_STATE_HOME", str(base / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(base / "config"))
    monkeypatch.setenv("RIGPILOT_SIMULATE", "4x-rtx4090")


def gate(engine: Engine, name: str) -> Path:
    return engine.tmp / f"gate-{name}"


def raw_exchange(sock: socket.socket, data: bytes) -> dict:
    sock.sendall(data)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return json.loads(buf)
