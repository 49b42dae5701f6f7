"""`rigpilot run train --slurm` on a real one-machine SLURM (slurmctld, slurmd, munge: tests/support/slurm_cluster.py).

The shipped tiny model and data, as 2 SLURM tasks (2 CPU ranks, gloo, the simulated 4×RTX 4090), through
the engine service and the CLI: one job runs to completion with its loss in `rigpilot metrics`, and
`rigpilot cancel` ends a second one, which SLURM's own accounting then records as CANCELLED.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rigpilot.engine.cli.entry import main as cli_main

from support.engine import Engine, engine_home, leftover_job_processes
from support.paths import REPO
from support.slurm_cluster import PARTITION, cluster
from support.waiting import wait_for

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


def wait_ended(engine: Engine, job_id: str, timeout: float, what: str) -> dict:
    return wait_for(lambda: (j := job(engine, job_id))["state"] in ("completed", "failed", "cancelled") and j,
                    timeout, 0.5, what)  # fmt: skip


def test_a_slurm_job_completes_with_its_loss_and_a_cancelled_one_is_cancelled_in_sacct(engine, slurm, capsys):
    job_id = run_train(capsys, "--steps", "4")
    first = job(engine, job_id)
    slurm_id = first["slurm"]["job_id"]
    # The script SLURM runs is the planner's export with this job's command and environment.
    script = Path(first["slurm"]["script"]).read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and f"#SBATCH --partition={PARTITION}" in script
    assert "rigpilot.engine.launch.rankexec" in script and "#SBATCH --time=10" in script
    shown = slurm.run(["scontrol", "show", "job", slurm_id]).stdout
    assert "NumTasks=2" in shown and f"Partition={PARTITION}" in shown, shown

    done = wait_ended(engine, job_id, 240, "the SLURM job to end")
    assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
    assert done["slurm"]["state"] == "COMPLETED"
    assert slurm.accounting(slurm_id) == "COMPLETED"
    assert cli_main(["metrics", job_id]) == 0
    out = capsys.readouterr().out
    assert "progress: 4/4" in out and re.search(r"loss: \d", out), out
    assert cli_main(["jobs"]) == 0
    assert re.search(rf"{job_id}\s.*completed", capsys.readouterr().out)
    assert cli_main(["logs", job_id, "--rank", "1"]) == 0 and capsys.readouterr().out.strip()
    assert cli_main(["logs", job_id, "--rank", "-1"]) == 0  # SLURM's own output of the job
    assert f"--- run 1: sbatch --parsable {first['slurm']['script']}" in capsys.readouterr().out
    for rank in (0, 1):  # each SLURM task was one rank and logged into the job folder
        assert (Path(done["job_dir"]) / "logs" / f"rank{rank}.log").stat().st_size > 0
        assert json.loads((Path(done["job_dir"]) / "ranks" / f"rank{rank}.json").read_text())["exit"]["code"] == 0

    second = run_train(capsys, "--steps", "100000")
    slurm_second = job(engine, second)["slurm"]["job_id"]
    wait_for(lambda: job(engine, second)["slurm"]["state"] == "RUNNING", 60, 0.5, "the second job to run")
    assert cli_main(["jobs"]) == 0
    assert "SLURM: running" in capsys.readouterr().out
    # The job runs on in SLURM without the engine; a new engine follows it again.
    engine.stop()
    engine.start()
    wait_for(lambda: (job(engine, second).get("progress") or {}).get("step") is not None, 120, 0.5, "steps")
    assert job(engine, second)["state"] == "running"
    assert cli_main(["cancel", second]) == 0
    capsys.readouterr()
    ended = wait_ended(engine, second, 60, "the cancelled SLURM job to end")
    assert ended["state"] == "cancelled" and ended["exit_reason"] == "cancelled by the user (scancel)"
    assert slurm.accounting(slurm_second) == "CANCELLED"
    assert slurm.run(["squeue", "-h", "-j", slurm_second]).stdout.strip() == ""  # nothing of it runs any more

    # Resumed: submitted to SLURM again as a new SLURM job, appending to the same folder.
    assert cli_main(["resume", second, "--detach"]) == 0
    capsys.readouterr()
    again = wait_for(lambda: (j := job(engine, second))["slurm"]["job_id"] != slurm_second and j, 30, 0.5, "resubmission")
    assert again["run"] == 2 and again["state"] in ("starting", "running")
    with engine.client() as c:
        c.request("cancel", job=second)
    wait_for(lambda: job(engine, second)["state"] == "cancelled", 60, 0.5, "the resumed job to be cancelled")
    assert slurm.accounting(again["slurm"]["job_id"]) == "CANCELLED"


def test_a_partition_slurm_does_not_have_is_refused_in_one_line(engine, capsys):
    args = ["run", "train", "--model", str(TINY_MODEL), "--data", str(TINY_DATA), "--gpus", "0,1",
            "--slurm", "--partition", "nosuchpartition", "--detach"]  # fmt: skip
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err == "rigpilot: error: SLURM refused the job: invalid partition specified: nosuchpartition\n"
    with engine.client() as c:
        assert c.request("jobs")["jobs"] == []  # nothing left behind


@pytest.fixture
def login_node(slurm, tmp_path):
    """A real sshd on loopback in front of the test cluster, and an `ssh` that reaches it by the name `rigtest-login`.

    The `ssh` on PATH is the real client with this test's config (-F): its port, key and host name.
    """
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd).exists() or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("no OpenSSH server here (Debian: openssh-server): the ssh path to a login node is not tried")
    d = tmp_path / "ssh"
    d.mkdir(mode=0o700)
    for key in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "client.pub").read_text())
    port = socket_port()
    # The login node's sessions see the cluster's config, and this checkout's code as the engine does.
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host\nAuthorizedKeysFile {d}/authorized_keys\n"
        f"PidFile {d}/sshd.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        f"UsePAM no\nStrictModes no\nSetEnv SLURM_CONF={slurm.conf} PYTHONPATH={REPO}\n"
    )  # fmt: skip
    (d / "ssh_config").write_text(
        f"Host rigtest-login\n  HostName 127.0.0.1\n  Port {port}\n  User root\n  IdentityFile {d}/client\n"
        f"  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d}/ssh_config "$@"\n')
    (bin_dir / "ssh").chmod(0o755)
    log = (d / "sshd.log").open("wb")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # Debian's sshd insists on its privilege separation folder
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=log)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    def answers() -> bool:
        assert proc.poll() is None, (d / "sshd.log").read_text()
        return subprocess.run(["ssh", "rigtest-login", "true"], env=env, capture_output=True).returncode == 0

    wait_for(answers, 20, 0.2, "sshd to accept the test key")
    yield bin_dir, d / "sshd.log"
    proc.terminate()
    proc.wait(10)
    log.close()


def socket_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_job_submitted_through_a_login_node_runs_and_is_followed_over_ssh(engine, slurm, login_node, capsys, monkeypatch):
    bin_dir, sshd_log = login_node
    engine.stop()  # the engine finds `ssh` on its PATH, as a user's would
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CONF")  # only the login node knows the cluster
    engine.start()
    args = ["run", "train", "--model", str(TINY_MODEL), "--data", str(TINY_DATA), "--gpus", "0,1", "--steps", "2",
            "--method", "scratch", "--seq", "64", "--precision", "fp32", "--env", "HF_HUB_OFFLINE=1",
            "--slurm", "--login", "rigtest-login", "--detach"]  # fmt: skip
    assert cli_main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    m = re.search(r"job (\w+) submitted to SLURM through rigtest-login as job (\d+)", out)
    assert m, out
    done = wait_ended(engine, m.group(1), 180, "the job submitted over ssh to end")
    assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
    assert done["progress"]["step"] == 2 and done["progress"]["loss"] is not None
    assert slurm.accounting(m.group(2)) == "COMPLETED"
    launcher = (Path(done["job_dir"]) / "logs" / "launcher.log").read_text()
    assert "--- run 1: ssh -o BatchMode=yes -o ConnectTimeout=10 rigtest-login -- sbatch --parsable " in launcher
    assert "Accepted publickey for root" in sshd_log.read_text()


def test_check_puts_the_job_to_slurm_and_queues_nothing_and_a_script_goes_with_bare_slurm(engine, slurm, capsys, tmp_path):
    check = ["run", "train", "--model", str(TINY_MODEL), "--data", str(TINY_DATA), "--gpus", "0,1",
             "--method", "scratch", "--seq", "64", "--slurm", "--check"]  # fmt: skip
    known = slurm.run(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split()  # earlier tests' jobs included
    assert cli_main([*check, "--partition", PARTITION, "--time", "10"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"SLURM: would be submitted with sbatch (partition {PARTITION}, time 10)" in out, out
    # slurmctld's own answer to the request (sbatch --test-only): the 2 tasks, on this cluster's node.
    assert re.search(rf"^SLURM: Job \d+ to start at \S+ using 2 processors on nodes \S+ in partition {PARTITION}$",
                     out, re.M), out  # fmt: skip
    assert cli_main([*check, "--partition", "nosuchpartition"]) == 2
    assert capsys.readouterr().err == (
        "rigpilot: error: SLURM would refuse the job: invalid partition specified: nosuchpartition\n"
    )
    assert slurm.run(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split() == known  # SLURM queued nothing
    with engine.client() as c:
        assert c.request("jobs")["jobs"] == []  # nor did the engine

    # A user's own script, and --slurm alone: the cluster's default partition, one SLURM task per rank.
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n")
    assert cli_main(["run", "script", "--gpus", "0,1", "--slurm", "--detach", "--", str(script)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"job (\w+) submitted to SLURM as job (\d+)", out)
    assert m, out
    done = wait_ended(engine, m.group(1), 120, "the script's SLURM job to end")
    assert done["state"] == "completed", (done["exit_reason"], done["last_log"])
    assert slurm.accounting(m.group(2)) == "COMPLETED"
    for rank in (0, 1):
        assert f"rank {rank} of 2" in (Path(done["job_dir"]) / "logs" / f"rank{rank}.log").read_text()
