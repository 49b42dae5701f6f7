"""A job on GPUs whose peer path the machine check found broken runs with NCCL_P2P_DISABLE=1, its record says why,
and a user's own --env of the variable wins (engine.jobs.machine_check)."""

from __future__ import annotations

import pytest

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs import machine_check
from rigpilot.engine.jobs.store import TERMINAL_STATES, JobStore
from rigpilot.engine.jobs.supervisor import Supervisor
from rigpilot.engine.jobspec.spec import JobSpec

from support.doctor_reports import clean_report, four_gpu_report
from support.engine import engine_home
from support.waiting import wait_for

PRINT_ENV = "import os\nprint('NCCL_P2P_DISABLE', os.environ['RANK'], os.environ.get('NCCL_P2P_DISABLE', 'unset'))\n"
CORRUPT_0_1 = (
    "Machine check of 2026-11-29 (simulated): Peer-to-peer copies between GPUs 0 and 1 over NODE returned wrong "
    "data: jobs on both run with NCCL_P2P_DISABLE=1 (traffic through host memory)"
)


def test_the_record_names_what_is_set_why_and_what_the_user_kept():
    report = four_gpu_report().to_dict()
    on_pair = machine_check.for_job(report, JobSpec(id="ab12cd", kind="script", script=["x.py"], gpus=[0, 1, 2]))
    assert on_pair is not None and on_pair["env"] == {"NCCL_P2P_DISABLE": "1"} and on_pair["yours"] == []
    assert [f["code"] for f in on_pair["findings"]] == ["p2p_corrupt"] and on_pair["simulated"] is True
    assert machine_check.lines(on_pair) == [CORRUPT_0_1]
    # GPUs that do not hold the pair, a clean check, no check, a SLURM job (other machines), the check itself: nothing.
    assert machine_check.for_job(report, JobSpec(id="ab12cd", kind="script", script=["x.py"], gpus=[1, 2])) is None
    assert (
        machine_check.for_job(
            clean_report().to_dict(), JobSpec(id="ab12cd", kind="script", script=["x.py"], gpus=[0, 1])
        )
        is None
    )
    assert machine_check.for_job(None, JobSpec(id="ab12cd", kind="script", script=["x.py"], gpus=[0, 1])) is None
    assert (
        machine_check.for_job(report, JobSpec(id="ab12cd", kind="script", script=["x.py"], gpus=[0, 1]), slurm=True)
        is None
    )
    assert machine_check.for_job(report, JobSpec(id="ab12cd", kind="doctor", gpus=[0, 1])) is None  # type: ignore[arg-type]
    # A stored check that cannot be read leaves the job as it would run unchecked (the planner says why).
    assert (
        machine_check.for_job({"schema": "rigpilot.doctor/1"}, JobSpec(id="ab12cd", kind="script", gpus=[0, 1])) is None
    )
    yours = machine_check.for_job(report, JobSpec(id="ab12cd", kind="script", script=["x.py"], gpus=[0, 1],
                                                  env={"NCCL_P2P_DISABLE": "0"}))  # fmt: skip
    assert yours is not None and yours["env"] == {} and yours["yours"] == ["NCCL_P2P_DISABLE"]
    assert (
        machine_check.lines(yours)[-1]
        == "NCCL_P2P_DISABLE is set by this job's --env, which stands over the machine check"
    )


@pytest.mark.slow
def test_a_job_on_the_broken_pair_runs_with_p2p_off_unless_its_own_env_says_otherwise(tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    script = tmp_path / "env.py"
    script.write_text(PRINT_ENV)
    store = JobStore(tmp_path / "engine.db")
    sup = Supervisor(store, tmp_path / "jobs", load_profile("4x-rtx4090"))
    sup.stored_check = lambda machine: four_gpu_report().to_dict()
    checked = sup.check({"kind": "script", "script": [str(script)], "gpus": [0, 1]}, None, str(tmp_path))
    assert CORRUPT_0_1 in checked["lines"]
    sup.start()
    try:
        plain = sup.submit({"kind": "script", "script": [str(script)], "gpus": [0, 1]}, None, str(tmp_path))
        kept = sup.submit({"kind": "script", "script": [str(script)], "gpus": [0, 1], "env": {"NCCL_P2P_DISABLE": "0"}},
                          None, str(tmp_path))  # fmt: skip
        assert plain["machine_check"]["env"] == {"NCCL_P2P_DISABLE": "1"}
        assert kept["machine_check"]["yours"] == ["NCCL_P2P_DISABLE"]
        for job in (plain, kept):
            wait_for(lambda j=job: store.get(j["id"]).state in TERMINAL_STATES, 240, 0.2, f"job {job['id']} to end")
    finally:
        sup.stop()
    for job, value in ((plain, "1"), (kept, "0")):
        assert store.get(job["id"]).state == "completed", store.get(job["id"]).last_log
        logs = tmp_path / "jobs" / job["id"] / "logs"
        printed = {(logs / f"rank{r}.log").read_text().split("NCCL_P2P_DISABLE", 1)[1].split()[1] for r in (0, 1)}
        assert printed == {value}
