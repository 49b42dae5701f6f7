"""Automatic recovery end to end: a real engine service, real torchrun jobs, a real kill -9.

The engine and its helpers are test_service_engine's (isolated XDG folders, a simulated 4×RTX 4090,
CPU ranks). Each test here launches several runs, so all are slow.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from rigpilot.engine.cli.entry import main as cli_main

from support.engine import CRASH_SCRIPT, GATE_SCRIPT, OOM_SCRIPT, gate, leftover_job_processes
from support.paths import SHAKESPEARE
from support.paths import TINY_LLAMA_CONFIG as TINY_LLAMA
from support.waiting import wait_for

pytestmark = pytest.mark.slow

USER_ERROR_SCRIPT = """
import sys
from rigpilot import report
report(step=1, loss=2.0)
report(kind="error", error="user_error", message="the dataset has no text field 'text'")
sys.exit(2)
"""

TRAIN = {
    "dataset": [str(SHAKESPEARE)], "method": "scratch", "precision": "fp32", "seq_len": 32, "micro_batch": 2,
    "grad_accum": 2, "max_steps": 20, "learning_rate": 1e-2, "warmup_steps": 2, "eval_every": 0,
    "checkpoint_every": 4, "seed": 1234,
}  # fmt: skip


def rank_state(job: dict, rank: int) -> dict | None:
    try:
        return json.loads((Path(job["job_dir"]) / "ranks" / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def kill_rank(job: dict, rank: int) -> float:
    """SIGKILL the rank's worker process (what torchrun started under the rank wrapper); the time it died."""
    state = wait_for(lambda: (s := rank_state(job, rank)) and "child_pid" in s and s, 60, 0.02, f"rank {rank} to start")
    os.kill(state["child_pid"], signal.SIGKILL)
    return time.time()


def final_losses(c, job_id: str) -> dict[int, float]:
    """Step → rank 0's loss, the latest run's where a step was trained twice."""
    out: dict[int, float] = {}
    for r in c.all_metrics(job_id)[0]:
        if r.get("rank") == 0 and r.get("kind") is None and r.get("loss") is not None:
            out[r["step"]] = r["loss"]
    return out


def test_kill_9_a_rank_mid_run_resumes_from_its_checkpoint_to_the_uninterrupted_loss(engine):
    engine.start()
    spec = {"kind": "train", "model": str(TINY_LLAMA), "env": {"HF_HUB_OFFLINE": "1"}, "train": TRAIN}
    with engine.client() as c:
        reference = c.request("submit", spec={**spec, "gpus": [2, 3], "name": "uninterrupted"})["job"]
        job = c.request("submit", spec={**spec, "gpus": [0, 1], "name": "killed"})["job"]
        assert job["max_restarts"] == 3  # the default: 20 steps outlast the checkpoint interval of 4
        complete = Path(job["job_dir"]) / "checkpoints" / "step-4" / "COMPLETE"
        wait_for(complete.exists, 240, 0.02, "the first checkpoint")
        kill_rank(job, 1)
        done = engine.wait_state(c, job["id"], "completed", "failed", "cancelled", timeout=240)
        assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
        (restart,) = done["restarts"]
        assert restart["run"] == 1 and done["run"] == 2 and restart["left_out_gpus"] == []
        assert restart["cause"] == "rank 1 was killed by SIGKILL"
        assert 4 <= restart["from_step"] < 20
        ref = engine.wait_state(c, reference["id"], "completed", "failed", timeout=240)
        assert ref["state"] == "completed" and ref["restarts"] == []
        mine, theirs = final_losses(c, job["id"]), final_losses(c, reference["id"])
    assert mine[20] == theirs[20]  # bit for bit, as a resume by hand is
    assert mine == theirs
    log = (Path(done["job_dir"]) / "logs" / "rank0.log").read_text()
    assert f"resumed from step-{restart['from_step']} at step {restart['from_step']}" in log
    assert not leftover_job_processes(engine.tmp)


def test_a_job_that_keeps_failing_stops_after_its_restarts_with_the_cause(engine, capsys):
    engine.start()
    script = engine.script("crash.py", CRASH_SCRIPT)
    with engine.client() as c:
        spec = {"kind": "script", "script": [script], "gpus": [0, 1], "name": "crashy", "max_restarts": 1}
        job = c.request("submit", spec=spec)["job"]
        done = engine.wait_state(c, job["id"], "failed", "completed", "cancelled", timeout=120)
    assert done["run"] == 2 and len(done["restarts"]) == 1
    assert [r["run"] for r in done["restarts"]] == [1]
    assert all(r["cause"] == "rank 1 exited with code 1" for r in done["restarts"])
    assert (
        done["exit_reason"]
        == "rank 1 exited with code 1; not restarted: it already restarted 1 time in a row (the limit)"
    )
    assert done["resumable"]
    assert cli_main(["jobs"]) == 0
    assert "failed  0,1   step 0" in (out := capsys.readouterr().out) and "restarted 1×; rank 1: rank 1 exited" in out
    assert cli_main(["job", job["id"]]) == 0
    out = capsys.readouterr().out
    assert "restarted 1× (up to 1 in a row):" in out and "run 1 → 2 from the start: rank 1 exited with code 1" in out


def test_cancel_out_of_memory_and_user_errors_are_not_restarted(engine):
    engine.start()
    scripts = {
        "oom": engine.script("oom.py", OOM_SCRIPT),
        "bad-data": engine.script("user_error.py", USER_ERROR_SCRIPT),
        "cancelled": engine.script("gate.py", GATE_SCRIPT),
    }
    with engine.client() as c:
        jobs = {}
        for gpu, (name, script) in enumerate(scripts.items()):
            args = [str(gate(engine, "never"))] if name == "cancelled" else []
            spec = {"kind": "script", "script": [script, *args], "gpus": [gpu], "name": name, "max_restarts": 3}
            jobs[name] = c.request("submit", spec=spec)["job"]
        engine.wait_state(c, jobs["cancelled"]["id"], "running")
        c.request("cancel", job=jobs["cancelled"]["id"])
        ended = {n: engine.wait_state(c, j["id"], "failed", "completed", "cancelled") for n, j in jobs.items()}
    assert {n: (j["state"], j["run"], j["restarts"]) for n, j in ended.items()} == {
        "oom": ("failed", 1, []), "bad-data": ("failed", 1, []), "cancelled": ("cancelled", 1, []),
    }  # fmt: skip
    assert ended["oom"]["exit_reason"].endswith("; not restarted: out of memory would recur under the same plan")
    assert ended["bad-data"]["exit_reason"] == (
        "rank 0 exited with code 2: the dataset has no text field 'text'; "
        "not restarted: a rank reported a problem with the job's data or settings"
    )
    assert ended["cancelled"]["exit_reason"].startswith("cancelled by the user")


def test_a_gpu_that_fell_off_the_bus_is_left_out_and_the_job_runs_on_the_others(engine):
    engine.start()
    script = engine.script("gate.py", GATE_SCRIPT)
    with engine.client() as c:
        spec = {"kind": "script", "script": [script, str(gate(engine, "f"))], "gpus": [1, 2], "max_restarts": 1}
        job = c.request("submit", spec=spec)["job"]
        engine.wait_state(c, job["id"], "running")
        told = c.request("simulate_fault", gpu=2, fault="lost")
        assert told["health"] == "fell off the bus (NVML: GPU is lost)"
        wait_for(lambda: c.request("telemetry_history", since=time.time() - 5)["samples"][-1]["gpus"][2]["health"] == "lost",
                 10, what="telemetry to show GPU 2 lost")  # fmt: skip
        kill_rank(job, 1)
        again = wait_for(lambda: (j := engine.job(c, job["id"]))["run"] == 2 and j["state"] == "running" and j, 60,
                         what="run 2 to be running")  # fmt: skip
        assert again["run"] == 2 and again["gpus"] == [1] and again["ranks"] == 1
        (restart,) = again["restarts"]
        assert (
            restart["left_out_gpus"] == [2]
            and restart["notes"][0] == "GPU 2 fell off the bus (NVML: GPU is lost): left out"
        )
        log = Path(job["job_dir"]) / "logs" / "rank0.log"
        wait_for(lambda: "rank 0 of 1 starts (run 2)" in log.read_text(), 30, what="run 2 on one rank")
        gate(engine, "f").touch()
        done = engine.wait_state(c, job["id"], "completed", "failed")
        assert done["state"] == "completed"
        c.request("simulate_fault", gpu=2, fault=None)
