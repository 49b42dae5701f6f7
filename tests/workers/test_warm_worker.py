"""The warm worker (engine.launch.warm): ranks forked with torch imported, start-up phases, who may use it.

The end-to-end test runs one engine with its warm worker and one plain torchrun
job to compare with; the rest are quick checks of the pieces.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from rigpilot.engine.cli import commands
from rigpilot.engine.jobs.job_view import startup_phase
from rigpilot.engine.jobs.metrics import MetricsSummary
from rigpilot.engine.launch import warm

from support.engine import Engine, engine_home, leftover_job_processes
from support.paths import TINY_LLAMA_CONFIG
from support.waiting import wait_for
from support.worker_jobs import LLAMA_TRAIN, losses, run_job, write_job

TRAIN = {**LLAMA_TRAIN, "max_steps": 4, "eval_every": 0, "checkpoint_every": 0}


def test_import_time_variables_must_agree_and_torchruns_own_may_differ():
    base = {"HOME": "/home/a", "HF_HOME": "/h", "PATH": "/bin"}
    assert warm.import_time_mismatch(base, dict(base)) is None
    assert warm.import_time_mismatch({**base, "HF_HOME": "/other"}, base) == "HF_HOME"
    assert warm.import_time_mismatch({**base, "PYTHONHASHSEED": "1"}, base) == "PYTHONHASHSEED"
    # Set by torchrun per rank, or by the engine per job, and read later: no reason to decline.
    job = {**base, "TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "RANK": "1",
           "PYTHONUNBUFFERED": "1", "RIGPILOT_JOB_ID": "ab12cd", "CUDA_VISIBLE_DEVICES": "0,1"}  # fmt: skip
    assert warm.import_time_mismatch(job, base) is None
    assert warm.enabled({}) and not warm.enabled({warm.ENABLE_ENV: "0"}) and not warm.enabled({warm.ENABLE_ENV: "off"})
    assert warm.memory_allows(warm.MIN_AVAILABLE_BYTES) and not warm.memory_allows(warm.MIN_AVAILABLE_BYTES - 1)


def test_start_up_phases_read_from_the_workers_status_records():
    summary = MetricsSummary()
    seen = [startup_phase(summary.phase)]
    for phase in ("importing", "loading model", "training"):
        summary.add({"kind": "status", "phase": phase, "rank": 0, "time": 1.0})
        seen.append(startup_phase(summary.phase))
    assert seen == ["launching", "importing", "loading weights", "first step"]
    assert commands.format_record({"kind": "status", "phase": "importing", "module": "torch", "rank": 1}) == (
        "[rank 1] importing torch"
    )


def test_the_app_shows_the_start_up_phase_of_a_starting_job():
    from rigpilot.app.jobs.model import progress_of

    assert progress_of({"state": "starting", "startup_phase": "loading weights", "progress": {}}) == (
        None, "starting: loading weights…",
    )  # fmt: skip
    assert progress_of({"state": "starting", "progress": {}}) == (None, "")


def test_no_warm_worker_when_turned_off(tmp_path, monkeypatch):
    from rigpilot.engine.hardware.simulated import load_profile
    from rigpilot.engine.jobs.store import JobStore
    from rigpilot.engine.jobs.supervisor import Supervisor, SupervisorOptions

    engine_home(tmp_path, monkeypatch)
    started: list[str] = []
    monkeypatch.setattr(warm.WarmWorker, "start", lambda self, python, env, niceness: started.append(python))
    store = JobStore(tmp_path / "engine.db")

    def tended(options: SupervisorOptions | None = None) -> Supervisor:
        sup = Supervisor(store, tmp_path / "jobs", load_profile("4x-rtx4090"), options=options)
        sup.warm_tending.check_at = 0.0  # past the engine's first seconds
        sup._tend_warm()
        return sup

    monkeypatch.setenv(warm.ENABLE_ENV, "1")
    monkeypatch.setattr(warm, "memory_allows", lambda available=None: False)
    assert tended().warm is not None and started == []  # memory is short: not now
    monkeypatch.setattr(warm, "memory_allows", lambda available=None: True)
    assert tended().warm is not None and started == [sys.executable]  # idle, memory to spare: it starts
    assert tended(SupervisorOptions(warm_worker=False)).warm is None
    monkeypatch.setenv(warm.ENABLE_ENV, "0")
    assert tended().warm is None
    assert started == [sys.executable]


def _as_nobody(code: str, *args: str) -> subprocess.CompletedProcess:
    user = pwd.getpwnam("nobody")
    return subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", sys.executable, "-c", code,
         *args],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip


ASK_AS_ANOTHER_USER = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(json.dumps({"connect": e.errno}))
    sys.exit()
try:  # the warm worker may have answered and closed already
    socket.send_fds(s, [b"F"], [0, 1, 2])
    s.sendall(json.dumps({"python": sys.executable, "args": ["-m", "rigpilot.engine.workers", "/tmp"], "env": {},
                          "cwd": "/"}).encode() + b"\\n")
except OSError:
    pass
print(s.makefile().readline().strip() or json.dumps({"closed": True}))
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to act as another user")
def test_a_job_runs_through_the_warm_worker_survives_its_death_and_matches_the_plain_path(monkeypatch, capsys):
    # A short runtime folder that another user can be let into (pytest's tmp folders are private to root).
    base = Path(tempfile.mkdtemp(prefix="rpwarm", dir="/tmp"))
    engine = Engine(base, warm_shared=False)  # its own warm worker, not the test run's
    try:
        engine_home(base, monkeypatch)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv(warm.ENABLE_ENV, "1")  # tests/conftest.py turns it off for the other tests
        engine.start()
        sock = wait_for(lambda: next((base / "r").rglob(warm.SOCKET_NAME), None), 90, 0.1, "the warm worker")
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600

        # Another user: shut out by the folder and socket permissions, and by SO_PEERCRED once they are opened.
        assert "connect" in json.loads(_as_nobody(ASK_AS_ANOTHER_USER, str(sock)).stdout)
        opened = [base, base / "r", sock.parent]
        for d in opened:
            d.chmod(0o711)
        sock.chmod(0o666)
        answer = json.loads(_as_nobody(ASK_AS_ANOTHER_USER, str(sock)).stdout)
        assert answer == {"declined": "another user"}
        sock.chmod(0o600)
        for d in opened:
            d.chmod(0o700)

        warm_pid = next(int(p.pid) for p in _processes_with(str(sock)))
        with engine.client() as c:
            spec = {"kind": "train", "model": str(TINY_LLAMA_CONFIG), "gpus": [0, 1],
                    "parallelism": {"dp_replicate": 2}, "train": TRAIN}  # fmt: skip
            job = c.request("submit", spec=spec)["job"]
            job_dir = Path(job["job_dir"])
            phases = set()

            environs: list[dict[str, str]] = []

            def forked() -> bool:
                view = engine.job(c, job["id"])
                phases.add(view.get("startup_phase"))
                try:
                    states = [json.loads((job_dir / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
                except (OSError, ValueError):
                    return False
                if not all("child_pid" in s for s in states):
                    return False
                with contextlib.suppress(psutil.Error):  # it may have finished already
                    env = psutil.Process(states[0]["child_pid"]).environ()
                    if "RIGPILOT_JOB_ID" not in env:
                        return False  # forked a moment ago: not yet in the job's environment
                    environs.append(env)
                return True

            wait_for(forked, 60, 0.02, "both ranks to start")
            os.kill(warm_pid, signal.SIGKILL)  # the job must not be lost with it
            done = engine.wait_state(c, job["id"], "completed", "failed", timeout=120)
            assert done["state"] == "completed", done.get("exit_reason")
            assert "launching" in phases
            # What the kernel shows for the forked rank is the job's environment, so the engine finds it by its token.
            assert environs and environs[0]["RIGPILOT_JOB_ID"] == job["id"] and warm.ENV_ROOM_VAR not in environs[0]
            ranks = [json.loads((job_dir / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
            logs = [job_dir / "logs" / "rank0.log", *base.rglob("warm-worker.log"), base / "engine.log"]
            assert all(r.get("warm") and r["exit"]["code"] == 0 for r in ranks), "\n".join(f.read_text()[:2000] for f in logs)
            capsys.readouterr()
            assert commands.follow(c, job["id"]) == 0
            printed = capsys.readouterr().out
        for line in ("[rank 0] importing torch", "[rank 0] importing transformers", "[rank 0] loading model"):
            assert line in printed

        plain = write_job(base / "plain", kind="train", model=str(TINY_LLAMA_CONFIG),
                          parallelism={"dp_replicate": 2}, train=TRAIN)  # fmt: skip
        run_job(plain, 2, env={"OMP_NUM_THREADS": "1"}, warm=False)
        assert losses(job_dir) == losses(plain) and len(losses(plain)) == 4  # bit for bit
    finally:
        engine.stop()
        for p in leftover_job_processes(base):
            p.kill()
        for p in _processes_with(str(base)):
            p.kill()
        shutil.rmtree(base, ignore_errors=True)


def _processes_with(text: str) -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(text in a for a in p.info["cmdline"] or []):
            found.append(p)
    return found


def test_a_request_that_is_not_a_worker_rank_is_declined():
    own = {"HOME": "/root"}
    request = {"python": sys.executable, "args": ["-u", "train.py"], "env": own, "cwd": "/"}
    assert warm._decline(request, own) == "not a Rigpilot worker rank"
    request = {"python": "/usr/bin/python3.9", "args": ["-u", "-m", warm.WORKER_MODULE, "/j"], "env": own, "cwd": "/"}
    assert warm._decline(request, own) == "another Python interpreter"
    request = {"python": sys.executable, "args": ["-u", "-m", warm.WORKER_MODULE, "/j"], "env": own, "cwd": "/"}
    assert warm._decline(request, own) is None
    assert warm._decline({**request, "env": {"HOME": "/home/x"}}, own) == "HOME differs from the warm worker's"
    assert warm._decline({**request, "env": {"HOME": "/root", "X": "y" * 200_000}}, own) == "environment too large"


def test_without_a_warm_worker_the_rank_starts_as_before(tmp_path):
    """No socket, or a stale one a killed warm worker left: fork_rank says no, and rankexec execs the rank."""
    command = [sys.executable, "-u", "-m", warm.WORKER_MODULE, str(tmp_path)]
    assert warm.fork_rank(str(tmp_path / "absent.sock"), command, dict(os.environ), str(tmp_path)) is None
    import socket

    stale = tmp_path / warm.SOCKET_NAME
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # the file stays, nothing listens: as after kill -9
    assert warm.fork_rank(str(stale), command, dict(os.environ), str(tmp_path)) is None
