"""`rigpilot doctor` on a simulated machine through a real engine: planted link faults are found, named and acted on.

The check runs as a job of gloo CPU ranks, one per simulated GPU; a "corrupt" link's peer copies come back with
flipped words, a "hang" link's all-reduce never finishes. The engine completes and stores the report, and a
report says which pairs the engine sends through host memory (NCCL_P2P_DISABLE=1).
"""

import json
import os
import subprocess
import sys

import pytest

from rigpilot.engine.api.client import EngineError

from support.engine import wait_job_state
from support.paths import REPO
from support.waiting import wait_for


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "rigpilot.engine.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip


def stored_report(c) -> dict:
    answer = wait_for(lambda: (a := c.request("doctor_report"))["running"] is None and a, 60, what="the stored check")
    return answer


def test_planted_corruption_and_hang_are_found_named_and_acted_on(engine):
    engine.start()
    with engine.client() as c:
        assert c.request("doctor_report") == {"report": None, "why": "never", "running": None}
        c.request("simulate_link_fault", gpus=[1, 0], fault="corrupt")
        c.request("simulate_link_fault", gpus=[2, 3], fault="hang")
        job = c.request("doctor_start", deadline_s=10)["job"]  # roomy: a loaded CI machine must not time out a sound pair
        assert job["kind"] == "doctor" and job["gpus"] == [0, 1, 2, 3] and job["ranks"] == 4
        with pytest.raises(EngineError) as refused:
            c.request("doctor_start")
        assert refused.value.reason == "doctor_running" and refused.value.fields["job"] == job["id"]
        wait_job_state(c, job["id"], "completed", timeout=180)
        answer = stored_report(c)
    report = answer["report"]
    assert report["schema"] == "rigpilot.doctor/1" and report["simulated"] is True and report["backend"] == "gloo"
    assert [g["name"] for g in report["gpus"]] == ["NVIDIA GeForce RTX 4090"] * 4  # the simulated GPUs, labelled
    codes = {(f["code"], tuple(f["gpus"])) for f in report["findings"]}
    assert ("p2p_corrupt", (0, 1)) in codes
    assert ("all_reduce_hung", (2, 3)) in codes
    pair01 = next(p for p in report["pairs"] if p["gpus"] == [0, 1])
    copy = next(c for c in pair01["checks"] if c["check"] == "p2p_copy")
    assert copy["status"] == "fail" and copy["figures"]["correct"] is False and copy["figures"]["mismatched"] > 0
    assert pair01["link"] == "NODE" and pair01["p2p_reported"] == "unsupported"  # the profile's topology
    # The hang ends the collectives: the pairs after it and the all-GPU all-reduce are not run, and it says so.
    assert report["complete"] is False and report["stopped"]["gpus"] == [2, 3]
    assert report["actions"] == {"nccl_env": {"NCCL_P2P_DISABLE": "1"}, "pairs": [[0, 1], [2, 3]],
                                 "because": ["all_reduce_hung", "p2p_corrupt"]}  # fmt: skip
    for g in report["gpus"]:
        names = {c["check"]: c for c in g["checks"]}
        assert names["matmul"]["figures"]["tflops"]["fp32"] > 0 and names["memory_bandwidth"]["figures"]["gbs"] > 0
        assert names["nvml_vs_smi"]["status"] == "skipped" and names["nvml_vs_smi"]["why"] == "simulated"
        assert names["health"]["status"] == "ok"

    # What the engine does about it: a job holding a broken pair runs with NCCL's P2P off, and says why.
    with engine.client() as c:
        script = engine.script("env.py", "import os; print('P2P', os.environ.get('NCCL_P2P_DISABLE'))\n")
        ran = engine.submit(c, script, gpus=[0, 1])
        untouched = engine.submit(c, script, gpus=[1, 2])
        assert ran["machine_check"]["env"] == {"NCCL_P2P_DISABLE": "1"} and untouched.get("machine_check") is None
        ran = wait_job_state(c, ran["id"], "completed", timeout=120)
        wait_job_state(c, untouched["id"], "completed", timeout=120)
    log = next((p for p in engine.tmp.rglob(f"{ran['id']}/logs/rank0.log")), None)
    assert log is not None and "P2P 1" in log.read_text()

    shown = cli("doctor", "--show")
    assert shown.returncode == 1, shown.stderr  # a failure found: a script can tell
    assert "Peer-to-peer copies between GPUs 0 and 1 over NODE returned wrong data" in shown.stdout
    assert "An all-reduce over GPUs 2 and 3 over NODE did not finish within 10 s" in shown.stdout
    assert "simulated: CPU ranks over gloo" in shown.stdout
    assert "Traceback" not in shown.stdout + shown.stderr


def test_a_clean_check_from_the_command_line_and_its_refusals(engine):
    engine.start()
    run = cli("doctor", "--gpus", "0,1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "machine check started" in run.stdout and "checking p2p_copy on GPUs 0,1" in run.stdout
    assert "Copy correct?" in run.stdout and "WRONG" not in run.stdout
    assert "The driver reports no peer-to-peer access between any of the GPUs" in run.stdout
    as_json = json.loads(cli("doctor", "--show", "--json").stdout)
    assert as_json["report"]["complete"] is True and as_json["report"]["actions"] == {}
    assert [p["gpus"] for p in as_json["report"]["pairs"]] == [[0, 1]]
    for args, words in [
        (("doctor", "--gpus", "9"), "GPU 9"),
        (("doctor", "--deadline", "0"), "--deadline takes seconds from 1 to 600"),
        (("doctor", "--gpus", "x"), "expected GPU indices"),
    ]:
        r = cli(*args)
        assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    with engine.client() as c:
        for gpus, fault, reason in [([0, 0], "hang", "unknown_link_fault"), ([0, 9], "hang", "unknown_gpu"),
                                    ([0, 1], "melt", "unknown_link_fault")]:  # fmt: skip
            with pytest.raises(EngineError) as e:
                c.request("simulate_link_fault", gpus=gpus, fault=fault)
            assert e.value.reason == reason


def test_a_stalled_peer_copy_is_cut_off_named_and_kept(engine):
    """A peer copy blocks in the driver with no deadline of its own: the watchdog writes what was measured, names
    the pair, and ends the job, whose report the engine still keeps."""
    engine.start()
    with engine.client() as c:
        c.request("simulate_link_fault", gpus=[0, 1], fault="stall")
        job = c.request("doctor_start", gpus=[0, 1, 2], deadline_s=2)["job"]
        ended = wait_job_state(c, job["id"], "failed", timeout=180)
        report = stored_report(c)["report"]
    assert report["complete"] is False
    assert report["stopped"]["code"] == "p2p_copy_hung" and report["stopped"]["gpus"] == [0, 1]
    assert [(f["code"], f["gpus"]) for f in report["findings"] if f["severity"] == "fail"] == [("p2p_copy_hung", [0, 1])]
    assert report["actions"]["pairs"] == [[0, 1]]
    assert len(report["gpus"]) == 3  # the per-GPU checks before it are kept
    assert "a peer-to-peer copy between GPUs 0 and 1 did not finish within 2 s" in ended["exit_reason"]
