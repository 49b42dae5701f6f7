"""`rigpilot run train --slurm` on a real one-machine SLURM (slurmctld, slurmd, munge: tests/slurm_cluster.py).

The shipped tiny model and data, as 2 SLURM tasks (2 CPU ranks, gloo, the simulated 4×RTX 4090), through
the engine service and the CLI: one job runs to completion with its loss in `rigpilot metrics`, and
`rigpilot cancel` ends a second one, which SLURM's own accounting then records as CANCELLED.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from slurm_cluster import PARTITION, cluster
from test_service_engine import Engine, engine_home, leftover_job_processes, wait_for

from rigpilot.engine.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "examples" / "models" / "tiny-llama"
TINY_DATA = REPO / "examples" / "data" / "shakespeare.txt"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from cluster(tmp_path_factory.mktemp("slurm"))


@pytest.fixture
def engine(slurm, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    engine_home(tmp_path, monkeypatch)
    e = Engine(tmp_path)
    e.start()
    yield e
    e.stop()
    for p in leftover_job_processes(tmp_path):
        p.kill()


def run_train(capsys, *extra: str) -> str:
    args = ["run", "train", "--model", str(TINY_MODEL), "--data", str(TINY_DATA), "--gpus", "0,1",
            "--method", "scratch", "--seq", "64", "--precision", "fp32", "--env", "HF_HUB_OFFLINE=1",
            "--slurm", "--partition", PARTITION, "--time", "10", "--detach", *extra]  # fmt: skip
    assert cli_main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    m = re.search(r"job (\w+) submitted to SLURM as job (\d+)", out)
    assert m, out
    return m.group(1)


def job(engine: Engine, job_id: str) -> dict:
    with engine.client() as c:
        return engine.job(c, job_id)


def test_a_slurm_job_completes_with_its_loss_and_a_cancelled_one_is_cancelled_in_sacct(engine, slurm, capsys):
    job_id = run_train(capsys, "--steps", "4")
    first = job(engine, job_id)
    slurm_id = first["slurm"]["job_id"]
    # The script SLURM runs is the planner's export with this job's command and environment.
    script = Path(first["slurm"]["script"]).read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and f"#SBATCH --partition={PARTITION}" in script
    assert "rigpilot.engine.service.rankexec" in script and "#SBATCH --time=10" in script
    shown = slurm.run(["scontrol", "show", "job", slurm_id]).stdout
    assert "NumTasks=2" in shown and f"Partition={PARTITION}" in shown, shown

    done = wait_for(lambda: (j := job(engine, job_id))["state"] in ("completed", "failed", "cancelled") and j,
                    240, 0.5, "the SLURM job to end")  # fmt: skip
    assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
    assert done["slurm"]["state"] == "COMPLETED"
    assert slurm.accounting(slurm_id) == "COMPLETED"
    assert cli_main(["metrics", job_id]) == 0
    out = capsys.readouterr().out
    assert "progress: 4/4" in out and re.search(r"loss: \d", out), out
    assert cli_main(["jobs"]) == 0
    assert re.search(rf"{job_id}\s.*completed", capsys.readouterr().out)
    for rank in (0, 1):  # each SLURM task was one rank and logged into the job folder
        assert (Path(done["job_dir"]) / "logs" / f"rank{rank}.log").stat().st_size > 0
        assert json.loads((Path(done["job_dir"]) / "ranks" / f"rank{rank}.json").read_text())["exit"]["code"] == 0

    second = run_train(capsys, "--steps", "100000")
    slurm_second = job(engine, second)["slurm"]["job_id"]
    wait_for(lambda: job(engine, second)["slurm"]["state"] == "RUNNING", 60, 0.5, "the second job to run")
    assert cli_main(["jobs"]) == 0
    assert "SLURM: running" in capsys.readouterr().out
    assert cli_main(["cancel", second]) == 0
    capsys.readouterr()
    ended = wait_for(lambda: (j := job(engine, second))["state"] in ("completed", "failed", "cancelled") and j,
                     60, 0.5, "the cancelled SLURM job to end")  # fmt: skip
    assert ended["state"] == "cancelled" and ended["exit_reason"] == "cancelled by the user (scancel)"
    assert slurm.accounting(slurm_second) == "CANCELLED"
    assert slurm.run(["squeue", "-h", "-j", slurm_second]).stdout.strip() == ""  # nothing of it runs any more


def test_a_partition_slurm_does_not_have_is_refused_in_one_line(engine, capsys):
    args = ["run", "train", "--model", str(TINY_MODEL), "--data", str(TINY_DATA), "--gpus", "0,1",
            "--slurm", "--partition", "nosuchpartition", "--detach"]  # fmt: skip
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err == "rigpilot: error: SLURM refused the job: invalid partition specified: nosuchpartition\n"
    with engine.client() as c:
        assert c.request("jobs")["jobs"] == []  # nothing left behind
