"""Automatic recovery without processes: the policy, the restart decision, re-fitting, and GPU health.

The engine end to end (a real kill -9, a real relaunch) is in test_recovery_engine.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from rigpilot.engine.cli.commands import _note, restart_lines
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.health import fault_of, gpu_faults
from rigpilot.engine.hardware.nvml_backend import NvmlBackend
from rigpilot.engine.hardware.nvml_replay import FakeNvml, idle_samples
from rigpilot.engine.hardware.simulated import SimulatedBackend, load_profile
from rigpilot.engine.hardware.telemetry import GpuSample, Tier
from rigpilot.engine.jobs import recovery
from rigpilot.engine.jobs.limits import check_job_settings
from rigpilot.engine.jobs.store import CANCELLED, COMPLETED, FAILED, QUEUED, JobRecord, JobStore
from rigpilot.engine.jobspec.spec import JobSpec, Parallelism, TrainSettings


def train_spec(max_steps: int = 100, checkpoint_every: int = 50, **par: int) -> JobSpec:
    return JobSpec(
        id="j", kind="train", model="m", gpus=[0, 1, 2, 3], parallelism=Parallelism(**par),
        train=TrainSettings(max_steps=max_steps, checkpoint_every=checkpoint_every, grad_accum=2),
    )  # fmt: skip


# -- the policy -------------------------------------------------------------------------------


def test_default_policy_restarts_only_training_that_outlasts_its_checkpoint_interval():
    assert recovery.max_restarts_of(train_spec(100, 50)) == 3
    assert recovery.max_restarts_of(train_spec(50, 50)) == 0  # short: nothing to lose by starting it by hand
    assert recovery.max_restarts_of(train_spec(100, 0)) == 0  # no checkpoints: a restart would start over
    assert recovery.max_restarts_of(JobSpec(id="s", kind="script", script=["x.py"])) == 0
    explicit = train_spec(100, 50)
    explicit.max_restarts = 0
    assert recovery.max_restarts_of(explicit) == 0
    explicit.max_restarts = 7
    assert recovery.max_restarts_of(explicit) == 7


@pytest.mark.parametrize("value", [-1, 101])
def test_the_limit_is_checked_by_the_settings_schema(value):
    spec = train_spec()
    spec.max_restarts = value
    with pytest.raises(UserError, match=r"^max_restarts=-?\d+: must be in \[0, 100\]$"):
        check_job_settings(spec)


# -- re-fitting to the healthy GPUs -----------------------------------------------------------


def test_refit_shrinks_data_parallelism_to_a_divisor_and_keeps_the_global_batch():
    spec = train_spec(dp_replicate=4)
    fit = recovery.refit(spec, [0, 2, 3], simulated=False, max_cpu_ranks=4)
    # 3 GPUs are left, but 4 replicas only shrink evenly to 2: each then accumulates twice as much.
    assert (fit.gpus, fit.ranks, spec.gpus) == ([0, 2], 2, [0, 2])
    assert (spec.parallelism.dp_replicate, spec.parallelism.dp_shard, spec.train.grad_accum) == (2, 1, 4)
    assert fit.notes == [
        "data parallelism shrinks from dp 4 × fsdp 1 to dp 2 × fsdp 1",
        "gradient accumulation rises from 2 to 4 so each step still trains the same global batch",
    ]


def test_refit_keeps_tensor_parallel_and_shrinks_the_fsdp_degree():
    spec = train_spec(dp_shard=2, tp=2)
    fit = recovery.refit(spec, [0, 1, 3], simulated=False, max_cpu_ranks=4)
    assert (fit.ranks, spec.parallelism.tp, spec.parallelism.dp_shard, spec.train.grad_accum) == (2, 2, 1, 4)


def test_refit_refuses_when_the_model_split_no_longer_fits():
    spec = train_spec(tp=2, pp=2)
    with pytest.raises(recovery.CannotShrink, match=r"^tp 2 × pp 2 needs 4 GPUs and 3 healthy are left$"):
        recovery.refit(spec, [0, 1, 2], simulated=False, max_cpu_ranks=4)


# -- the decision -----------------------------------------------------------------------------


def record(job_dir: Path, spec: JobSpec, **kw) -> JobRecord:
    spec.write(job_dir)
    base = dict(id="j", seq=1, kind=spec.kind, name="n", state="running", gpus=list(spec.gpus),
                ranks=len(spec.gpus), simulated=False, created=0.0, max_restarts=recovery.max_restarts_of(spec))  # fmt: skip
    return JobRecord(**{**base, **kw})


FAILED_RANK = {"state": FAILED, "exit_reason": "rank 1 was killed by SIGKILL", "failed_rank": 1, "resumable": True,
               "error": None, "last_log": ["x"]}  # fmt: skip


def decide(rec, outcome, tmp_path, errors=(), faults=None, from_step=50):
    return recovery.after_failure(
        rec, dict(outcome), list(errors), tmp_path, lambda: dict(faults or {}),
        simulated=False, max_cpu_ranks=4, from_step=from_step,
    )  # fmt: skip


def test_a_failed_rank_requeues_the_job_to_resume_from_its_checkpoint(tmp_path):
    rec = record(tmp_path, train_spec(dp_replicate=4))
    changes = decide(rec, FAILED_RANK, tmp_path)
    assert changes["state"] == QUEUED and changes["run"] == 2 and changes["gpus"] == [0, 1, 2, 3]
    assert changes["exit_reason"] is None and changes["ended"] is None and not changes["resumable"]
    (entry,) = changes["restarts"]
    assert entry["run"] == 1 and entry["cause"] == "rank 1 was killed by SIGKILL" and entry["from_step"] == 50
    assert entry["left_out_gpus"] == [] and entry["notes"] == []
    assert JobSpec.read(tmp_path).resume is True


@pytest.mark.parametrize(
    ("outcome", "errors", "why"),
    [
        ({**FAILED_RANK, "error": {"error": "out_of_memory", "rank": 0}}, [], "out of memory would recur"),
        (FAILED_RANK, [{"rank": 1, "error": "user_error", "message": "empty dataset"}], "data or settings"),
    ],
)
def test_out_of_memory_and_user_errors_are_not_restarted_and_say_so(tmp_path, outcome, errors, why):
    rec = record(tmp_path, train_spec())
    changes = decide(rec, outcome, tmp_path, errors)
    assert changes["state"] == FAILED and changes["resumable"]
    assert (
        changes["exit_reason"].startswith("rank 1 was killed by SIGKILL; not restarted: ")
        and why in changes["exit_reason"]
    )
    assert JobSpec.read(tmp_path).resume is False  # job.json untouched


@pytest.mark.parametrize("state", [CANCELLED, COMPLETED])
def test_cancelled_and_completed_jobs_end_as_they_ended(tmp_path, state):
    rec = record(tmp_path, train_spec())
    outcome = {"state": state, "exit_reason": "cancelled by the user (stopped)" if state == CANCELLED else None}
    assert decide(rec, outcome, tmp_path, faults={1: "boom"}) == outcome


def test_no_restart_when_the_policy_is_off(tmp_path):
    rec = record(tmp_path, train_spec(50, 50))
    assert rec.max_restarts == 0
    assert decide(rec, FAILED_RANK, tmp_path) == FAILED_RANK


def test_the_limit_counts_restarts_in_a_row_and_a_manual_resume_starts_afresh(tmp_path):
    rec = record(tmp_path, train_spec(), max_restarts=2)
    for _ in (1, 2):
        changes = decide(rec, FAILED_RANK, tmp_path)
        assert changes["state"] == QUEUED
        rec.run, rec.restarts = changes["run"], changes["restarts"]
    assert recovery.restarts_in_a_row(rec) == 2
    stopped = decide(rec, FAILED_RANK, tmp_path)
    assert stopped["state"] == FAILED
    assert (
        stopped["exit_reason"]
        == "rank 1 was killed by SIGKILL; not restarted: it already restarted 2 times in a row (the limit)"
    )
    rec.run += 1  # the user resumed it: run 4 follows no automatic restart
    assert recovery.restarts_in_a_row(rec) == 0 and decide(rec, FAILED_RANK, tmp_path)["state"] == QUEUED


def test_a_faulty_gpu_is_left_out_and_the_job_refitted(tmp_path):
    rec = record(tmp_path, train_spec(dp_replicate=4))
    changes = decide(rec, FAILED_RANK, tmp_path, faults={1: "fell off the bus (NVML: GPU is lost)", 7: "not ours"})
    assert changes["state"] == QUEUED and changes["gpus"] == [0, 2] and changes["ranks"] == 2
    entry = changes["restarts"][0]
    assert entry["left_out_gpus"] == [1]
    assert entry["notes"][0] == "GPU 1 fell off the bus (NVML: GPU is lost): left out"
    spec = JobSpec.read(tmp_path)
    assert spec.gpus == [0, 2] and spec.parallelism.dp_replicate == 2 and spec.train.grad_accum == 4 and spec.resume


def test_a_layout_that_cannot_shrink_waits_for_the_user_with_one_line(tmp_path):
    rec = record(tmp_path, train_spec(tp=2, pp=2))
    changes = decide(rec, FAILED_RANK, tmp_path, faults={3: "reports 2 uncorrectable ECC errors"})
    assert changes["state"] == FAILED and changes["resumable"]
    assert changes["exit_reason"] == (
        "rank 1 was killed by SIGKILL; waiting for you, not restarted: GPU 3 reports 2 uncorrectable ECC errors, "
        "and tp 2 × pp 2 needs 4 GPUs and 3 healthy are left; fix or replace the GPU, then resume the job"
    )
    assert "\n" not in changes["exit_reason"]
    assert JobSpec.read(tmp_path).gpus == [0, 1, 2, 3]


def test_the_timeline_survives_the_store_and_reads_in_the_cli(tmp_path):
    store = JobStore(tmp_path / "engine.db")
    rec = record(tmp_path, train_spec(dp_replicate=4))
    store.insert(rec)
    changes = decide(rec, FAILED_RANK, tmp_path, faults={2: "reported XID 79 (fallen off the bus)"})
    store.update(rec, **changes)
    again = JobStore(tmp_path / "engine.db").get("j")
    assert again.restarts == rec.restarts and again.max_restarts == 3 and again.gpus == [0, 1]
    job = {**again.to_dict(), "state": "running"}
    assert _note(job) == "restarted 1×"
    lines = restart_lines(json.loads(json.dumps(job)))
    assert lines[0] == "restarted 1× (up to 3 in a row):"
    assert lines[1].endswith("run 1 → 2 from step 50: rank 1 was killed by SIGKILL")
    assert lines[2].strip() == "GPU 2 reported XID 79 (fallen off the bus): left out"


# -- GPU health -------------------------------------------------------------------------------


def test_simulated_faults_read_as_nvml_reports_them():
    backend = SimulatedBackend(load_profile("4x-rtx4090"), seed=1)
    assert gpu_faults(backend) == {}
    backend.set_fault(1, "lost")
    backend.set_fault(2, "xid 79")
    backend.set_fault(3, "xid 13")  # a kernel's own fault: the card is fine
    backend.set_fault(0, "ecc")
    assert gpu_faults(backend) == {
        0: "reports 1 uncorrectable ECC error",
        1: "fell off the bus (NVML: GPU is lost)",
        2: "reported XID 79 (fallen off the bus)",
    }
    fast = backend.sample_gpus(Tier.FAST)
    assert fast[1].health == "lost" and fast[1].gpu_util is None and fast[1].unavailable["gpu_util"] == "GPU lost"
    slow = backend.sample_gpus(Tier.SLOW)
    assert (slow[2].xid, slow[2].health, slow[0].ecc_uncorrected) == (79, "xid 79", 1)
    assert [fault_of(s) for s in slow] == [
        "reports 1 uncorrectable ECC error", "fell off the bus (NVML: GPU is lost)",
        "reported XID 79 (fallen off the bus)", None,
    ]  # fmt: skip
    backend.set_fault(1, None)
    assert 1 not in gpu_faults(backend)
    with pytest.raises(ValueError, match="unknown GPU fault 'melted'"):
        backend.set_fault(0, "melted")


def test_nvml_health_finds_a_lost_gpu_uncorrectable_ecc_and_hardware_xids():
    machine = load_profile("8x-h100-sxm")
    samples = idle_samples(machine)
    for s in samples:
        s.ecc_corrected, s.ecc_uncorrected = 0, 0
    samples[5].ecc_uncorrected = 2
    fake = FakeNvml(machine, lambda: samples)
    backend = NvmlBackend(fake, host_reader=lambda: copy.deepcopy(machine.host))
    assert backend.health() == {i: (None if i != 5 else "reports 2 uncorrectable ECC errors") for i in range(8)}
    fake.lose_gpu(2)
    fake.emit_xid(4, 79)
    fake.emit_xid(6, 13)  # an illegal address in the user's kernel: not the card's fault
    faults = gpu_faults(backend)
    assert faults == {
        2: "fell off the bus (NVML: GPU is lost)",
        4: "reported XID 79 (fallen off the bus)",
        5: "reports 2 uncorrectable ECC errors",
    }
    # The telemetry still reports the XID in the sample that first sees it.
    assert backend.sample_gpus(Tier.SLOW)[4].health == "xid 79"
    assert GpuSample(index=0, xid=13).xid == 13 and fault_of(GpuSample(index=0, xid=13)) is None


def test_the_cli_flag_reaches_the_spec_and_a_bad_value_is_one_line(capsys):
    from rigpilot.engine.cli.commands import build_spec
    from rigpilot.engine.cli.entry import build_parser, main

    args = build_parser().parse_args(["run", "script", "--max-restarts", "2", "--", "x.py"])
    assert build_spec(args)["max_restarts"] == 2
    args = build_parser().parse_args(["run", "train", "--model", "m", "--data", "d.txt"])
    assert "max_restarts" not in build_spec(args)
    with pytest.raises(SystemExit) as exited:
        main(["run", "script", "--max-restarts", "two", "--", "x.py"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a whole number: 'two'" in err


def test_a_resume_by_hand_refuses_a_faulty_gpu_in_one_line(tmp_path):
    rec = record(tmp_path, train_spec(tp=2, pp=2))
    recovery.refuse_faulty_gpus(rec, {7: "fell off the bus (NVML: GPU is lost)"})  # not the job's: fine
    with pytest.raises(UserError, match=r"^cannot resume j: GPU 3 reported XID 79 \(fallen off the bus\); reset"):
        recovery.refuse_faulty_gpus(rec, {3: "reported XID 79 (fallen off the bus)"})
