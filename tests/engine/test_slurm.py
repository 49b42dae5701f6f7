"""engine.jobs.slurm without a cluster: SLURM's states in Rigpilot's words, the command lines it runs
(here or through ssh), one-line refusals, and the script the engine submits being the planner's export."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs import slurm, slurm_state
from rigpilot.engine.jobs.store import QUEUED, JobRecord, JobStore
from rigpilot.engine.jobs.supervisor import Supervisor
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.models.formulas import spec_from_config
from rigpilot.engine.planner.export import slurm_script
from rigpilot.engine.planner.plan import Plan, Workload
from rigpilot.engine.planner.search import search

from support.dev_script import load_dev
from support.paths import REPO

TINY_MODEL = REPO / "examples" / "models" / "tiny-llama"


@pytest.mark.parametrize(
    ("slurm_state", "state"),
    [("PENDING", "starting"), ("CONFIGURING", "starting"), ("RUNNING", "starting"), ("COMPLETING", "starting"),
     ("COMPLETED", "completed"), ("FAILED", "failed"), ("CANCELLED", "cancelled"), ("CANCELLED by 0", "cancelled"),
     ("TIMEOUT", "failed"), ("NODE_FAIL", "failed"), ("OUT_OF_MEMORY", "failed"), ("PREEMPTED", "interrupted"),
     ("REQUEUED", "starting"), ("SUSPENDED", "starting")],
)  # fmt: skip
def test_slurm_states_map_onto_rigpilots(slurm_state, state):
    assert slurm.rigpilot_state(slurm_state) == state


def test_an_unknown_slurm_state_is_not_taken_for_an_end():
    with pytest.raises(ValueError, match="unknown SLURM job state 'HOVERING'"):
        slurm.rigpilot_state("HOVERING")


def test_the_queue_state_in_words():
    assert slurm_state.describe({"state": "PENDING", "reason": "Resources"}) == "SLURM: pending (Resources)"
    assert slurm_state.describe({"state": "RUNNING", "reason": "None"}) == "SLURM: running"
    assert slurm_state.describe({"state": "NODE_FAIL"}) == "SLURM: node fail"
    assert slurm_state.describe(None) == ""


@pytest.mark.parametrize(
    ("options", "message"),
    [({"partition": "gpu;rm -rf /"}, "--partition 'gpu;rm -rf /' is not a SLURM name"),
     ({"time": "two hours"}, "--time 'two hours' is not a SLURM time limit"),
     ({"login": "-oProxyCommand=sh"}, "--login '-oProxyCommand=sh' is not a host name"),
     ({"queue": "x"}, "unknown SLURM option 'queue'"),
     ({"account": ""}, "must be a non-empty string")],
)  # fmt: skip
def test_bad_slurm_options_are_refused_in_one_line(options, message):
    with pytest.raises(UserError, match=None) as e:
        slurm.check_options(options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_good_options_pass():
    ok = {"partition": "gpu", "account": "lab-1", "time": "1-00:30:00", "login": "me@login1.cluster.org"}
    assert slurm.check_options(ok) == ok


def test_through_a_login_node_every_command_runs_under_ssh():
    here, there = slurm.SlurmCommands(), slurm.SlurmCommands("me@login1")
    assert here.argv(["sbatch", "--parsable", "/jobs/a b/slurm.sh"]) == ["sbatch", "--parsable", "/jobs/a b/slurm.sh"]
    assert there.argv(["sbatch", "--parsable", "/jobs/a b/slurm.sh"]) == [
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "me@login1", "--", "sbatch --parsable '/jobs/a b/slurm.sh'"
    ]  # fmt: skip


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client here")
def test_an_unreachable_login_node_is_one_line():
    with pytest.raises(UserError) as e:
        slurm.SlurmCommands("nosuchhost.invalid").submit(Path("/tmp/x.sh"))
    text = str(e.value)
    assert text.startswith("SLURM refused the job: ssh could not reach nosuchhost.invalid: ") and "\n" not in text


def test_no_sbatch_here_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match=r"^sbatch is not installed here: install SLURM.s client commands"):
        slurm.SlurmCommands().submit(tmp_path / "slurm.sh")


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="SLURM's client commands are not installed")
def test_sbatch_refusing_is_one_line(monkeypatch, tmp_path):
    # sbatch reads its config and the script's directives before it contacts any controller.
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=localhost\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(conf))
    script = tmp_path / "slurm.sh"
    script.write_text("#!/bin/bash\n#SBATCH --time=2h\ntrue\n")
    with pytest.raises(UserError) as e:
        slurm.SlurmCommands().submit(script)
    assert str(e.value) == "SLURM refused the job: Invalid --time specification"


def test_sbatch_answers_are_read_with_or_without_a_cluster_name():
    def answering(text):
        return lambda argv, **kw: subprocess.CompletedProcess(argv, 0, text, "")

    assert slurm.SlurmCommands(runner=answering("4242\n")).submit(Path("s.sh")) == "4242"
    assert slurm.SlurmCommands(runner=answering("4243;cluster-b\n")).submit(Path("s.sh")) == "4243"
    with pytest.raises(UserError, match="not a job id"):
        slurm.SlurmCommands(runner=answering("Submitted batch job\n")).submit(Path("s.sh"))


def test_the_submitted_script_is_the_planners_export(tmp_path, monkeypatch):
    """The engine's SLURM script for a job with a plan: the export of that plan, with the job's command and ranks."""
    monkeypatch.setenv("RIGPILOT_SIMULATE", "4x-rtx4090")
    machine = load_profile("4x-rtx4090")
    model = spec_from_config(json.loads((TINY_MODEL / "config.json").read_text()))
    plan = search(model, machine, Workload(model=str(TINY_MODEL), seq_len=64, global_batch=4)).best
    job_dir = tmp_path / "jobs" / "ab12cd"
    job_dir.mkdir(parents=True)
    (job_dir / "plan.json").write_text(plan.to_json())
    store = JobStore(tmp_path / "engine.db")
    sup = Supervisor(store, tmp_path / "jobs", machine)
    rec = JobRecord(id="ab12cd", seq=1, kind="train", name="demo", state=QUEUED, gpus=[0, 1], ranks=2, simulated=True,
                    created=0.0, slurm={"partition": "gpu", "time": "30"})  # fmt: skip
    spec = JobSpec(id="ab12cd", kind="train", model=str(TINY_MODEL), env={"HF_HUB_OFFLINE": "1"})
    py = "/e/bin/python"
    text = slurm.job_script(sup, rec, spec, job_dir, py)
    env = slurm.job_environment(sup, rec, spec, job_dir, py)
    command = [py, "-u", "-m", "rigpilot.engine.launch.rankexec", str(job_dir), "--", py, "-u", "-m",
               "rigpilot.engine.workers", str(job_dir)]  # fmt: skip
    assert text == slurm_script(
        Plan.from_dict(plan.to_dict()), command=command, env=env, ranks_per_node=2, gpus_per_node=0,
        job_name="rigpilot-ab12cd", output=str(job_dir / "logs" / "launcher.log"), partition="gpu", time_limit="30",
    )  # fmt: skip
    # It is the plan's script: its layout and GPU order, and the job's own settings for the simulated CPU ranks.
    assert f"# Rigpilot plan, per node: {plan.parallelism.describe()}." in text
    assert "export HF_HUB_OFFLINE=1" in text
    assert "RIGPILOT_DIST_BACKEND" not in text and "RIGPILOT_SIMULATED" not in text  # read by nothing: not sent
    assert "export CUDA_VISIBLE_DEVICES=''" in text  # simulated GPUs: the ranks must not take a real one
    assert "export PYTHONUNBUFFERED=1" in text and "export RIGPILOT_JOB_DIR=" in text
    assert "export PATH=" not in text and "export HOME=" not in text  # the engine's own environment stays here
    store.close()


def _dev_script():
    return load_dev("rigpilot_dev_slurm")


def test_without_slurm_the_tests_say_in_one_line_why_they_skip_and_how_to_get_it(monkeypatch):
    dev = _dev_script()
    monkeypatch.setattr(dev, "missing_commands", lambda names: list(names))
    why = dev.slurm_skip_reason()
    assert why.startswith("SLURM is not installed (slurmctld, slurmd, munged, sbatch") and "\n" not in why
    assert "python3 dev.py test --install-system-deps installs slurm-wlm munge" in why


def test_slurm_flags_without_slurm_are_named(capsys):
    from rigpilot.engine.cli.entry import main as cli_main

    assert cli_main(["run", "train", "--model", "x", "--time", "10"]) == 2
    assert (
        capsys.readouterr().err == "rigpilot: error: --time is a SLURM option: add --slurm to submit the job to SLURM\n"
    )


def test_one_squeue_answers_for_every_job_and_forgotten_ones_are_looked_up_in_the_accounting():
    ran: list[list[str]] = []

    def cluster(argv, **kw):
        ran.append(argv)
        if argv[0] == "squeue":  # as slurmctld answers a list: the jobs it still knows, none it has forgotten
            return subprocess.CompletedProcess(argv, 0, "11|RUNNING|None|gpu|n1\n12|PENDING|Priority|gpu|\n", "")
        return subprocess.CompletedProcess(argv, 0, "13|COMPLETED|0:0|gpu|n2\n", "")

    states = slurm.SlurmCommands(runner=cluster).statuses(["11", "12", "13"])
    assert [a[0] for a in ran] == ["squeue", "sacct"] and "11,12,13" in ran[0]
    assert states["11"] == slurm.SlurmStatus("RUNNING", None, "gpu", None, "n1")
    assert states["12"] == slurm.SlurmStatus("PENDING", "Priority", "gpu", None, None)
    assert states["13"] == slurm.SlurmStatus("COMPLETED", None, "gpu", "0:0", "n2")


def test_the_supervisors_slurm_jobs_share_one_squeue_per_poll(tmp_path):
    ran: list[list[str]] = []

    def cluster(argv, **kw):
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, "21|RUNNING||gpu|n1\n22|RUNNING||gpu|n1\n", "")

    store = JobStore(tmp_path / "engine.db")
    sup = Supervisor(store, tmp_path / "jobs", load_profile("4x-rtx4090"))
    commands = slurm.SlurmCommands(runner=cluster)
    for job_id, slurm_id in (("aa", "21"), ("bb", "22")):
        rec = JobRecord(id=job_id, seq=int(slurm_id), kind="train", name=job_id, state="starting", gpus=[0], ranks=1,
                        simulated=True, created=0.0, slurm={"job_id": slurm_id, "state": "PENDING"})  # fmt: skip
        store.insert(rec)
        (tmp_path / "jobs" / job_id).mkdir(parents=True)
        sup._runs[job_id] = slurm.adopt(sup, rec)
    for run in list(sup._runs.values()):
        slurm.poll(sup, run, commands)
    assert [a[0] for a in ran] == ["squeue"]  # one query for both jobs
    assert sorted(ran[0][ran[0].index("-j") + 1].split(",")) == ["21", "22"]
    assert [store.get(j).slurm["state"] for j in ("aa", "bb")] == ["RUNNING", "RUNNING"]
    store.close()


def test_a_machine_without_slurm_configuration_is_named_so():
    said = (
        "sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
        "sbatch: error: fetch_config: DNS SRV lookup failed\n"
        "sbatch: error: _establish_config_source: failed to fetch config\n"
        "sbatch: fatal: Could not establish a configuration source\n"
    )  # what Debian's sbatch 22.05 says with no slurm.conf and no SRV record

    def no_config(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, "", said)

    with pytest.raises(UserError) as e:
        slurm.SlurmCommands(runner=no_config).test_only("#!/bin/bash\ntrue\n")
    assert str(e.value) == (
        "SLURM would refuse the job: no SLURM configuration here (no slurm.conf, no DNS SRV record): "
        "is this a SLURM client? Submit from a login node with --login HOST"
    )
