"""One Layout from plan to mesh: made once from a plan, the CLI's degrees or job.json, valid from the moment it exists."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs.submission import apply_plan_layout, parse_plan, prepare
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.layout import LAYOUT_SETTINGS, Layout, accumulation_of_plan
from rigpilot.engine.planner.plan import (
    HostMemory,
    MemoryBreakdown,
    Parallelism,
    Plan,
    Timing,
    Workload,
    parallelism_from_dict,
)
from rigpilot.engine.planner.search import SearchOptions, _sharding_options

# --- validation ---------------------------------------------------------------------------------------------------


def test_every_degree_out_of_its_range_is_refused_with_its_setting_and_bounds() -> None:
    for name, bad, hi in (("dp_replicate", 0, 4096), ("dp_shard", 5000, 4096), ("tp", 513, 512), ("pp", -1, 512),
                          ("pp_microbatches", 0, 4096)):  # fmt: skip
        with pytest.raises(UserError, match=rf"^parallelism setting {name}={bad}: must be in \[1, {hi}\]$") as e:
            Layout(**{name: bad})
        assert e.value.reason == "out_of_range"
        assert e.value.fields == {"setting": f"parallelism.{name}", "value": bad, "lo": 1, "hi": hi}
    with pytest.raises(UserError, match="must be a whole number") as e:
        Layout(tp=True)  # type: ignore[arg-type]
    assert e.value.reason == "bad_layout"


def test_a_layout_whose_degrees_do_not_multiply_to_the_ranks_is_refused() -> None:
    layout = Layout(dp_shard=2, tp=2)
    assert layout.fitted(4) is layout
    with pytest.raises(UserError, match=r"\(dp 1 × fsdp 2 × tp 2 × pp 1 = 4\) must multiply to the number of ranks \(8\)") as e:
        layout.fitted(8)
    assert e.value.reason == "bad_layout" and e.value.fields["product"] == 4 and e.value.fields["ranks"] == 8
    # No degrees given: plain data parallel over every rank.
    assert Layout().fitted(6) == Layout(dp_replicate=6)


def test_schedules_are_spelled_one_way_and_old_spellings_are_read() -> None:
    for given, stored in (("1f1b", "1F1B"), ("1F1B", "1F1B"), ("gpipe", "GPipe"), ("GPIPE", "GPipe"), ("GPipe", "GPipe")):
        assert Layout(pp=2, pp_schedule=given).pp_schedule == stored
    with pytest.raises(UserError, match="pp_schedule='zigzag': must be one of 1F1B, GPipe") as e:
        Layout(pp_schedule="zigzag")
    assert e.value.reason == "not_a_choice" and e.value.fields["choices"] == ["1F1B", "GPipe"]


def test_a_layout_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Layout().tp = 2  # type: ignore[misc]


def test_the_clis_degrees_are_the_layouts_and_only_the_given_ones_are_sent() -> None:
    from rigpilot.engine.cli.commands import build_spec
    from rigpilot.engine.cli.entry import build_parser

    args = build_parser().parse_args(["run", "train", "--model", "m", "--dp", "2", "--tp", "2", "--pp-schedule",
                                      "gpipe", "--sequence-parallel"])  # fmt: skip
    assert build_spec(args)["parallelism"] == {"dp_replicate": 2, "tp": 2, "pp_schedule": "GPipe", "sequence_parallel": True}
    assert [a.option_strings[0] for a in build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
            ._subparsers._group_actions[0].choices["train"]._actions if a.dest in LAYOUT_SETTINGS] == [
        "--dp", "--fsdp", "--tp", "--pp", "--pp-microbatches", "--pp-schedule", "--sequence-parallel", "--cpu-offload"]  # fmt: skip
    layout = Layout.from_settings(dp_replicate=2, dp_shard=None, tp=2, pp_schedule="gpipe", sequence_parallel=True)
    assert (layout.dp_replicate, layout.tp, layout.pp_schedule, layout.sequence_parallel) == (2, 2, "GPipe", True)
    with pytest.raises(UserError, match=r"parallelism setting tp=1000: must be in \[1, 512\]"):
        Layout.from_settings(tp=1000)


def test_the_cli_refuses_a_degree_out_of_range_in_the_engines_words(capsys: pytest.CaptureFixture[str]) -> None:
    from rigpilot.engine.cli.entry import main

    # Refused by argparse from the declaration, naming the flag, before anything is sent.
    with pytest.raises(SystemExit) as exited:
        main(["run", "train", "--model", "gpt2", "--data", "x.txt", "--tp", "1000", "--check"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --tp: parallelism setting tp=1000: must be in [1, 512]" in err
    assert "Traceback" not in err


# --- job.json ---------------------------------------------------------------------------------------------------

OLD_JOB = {  # a job.json as Rigpilot wrote it before the Layout (spec_version 1)
    "id": "20250101-000000-abcd", "kind": "train", "name": "", "model": "gpt2", "trust_remote_code": False,
    "gpus": [0, 1, 2, 3], "simulated": True,
    "parallelism": {"dp_replicate": 1, "dp_shard": 2, "reshard_after_forward": False, "tp": 1, "pp": 2,
                    "sequence_parallel": False, "pp_schedule": "1f1b", "pp_microbatches": 4, "cpu_offload": False},
    "train": {"dataset": ["data.txt"], "grad_accum": 1, "micro_batch": 2}, "infer": None, "script": None, "env": {},
    "resume": False, "max_restarts": None, "spec_version": 1,
}  # fmt: skip


def test_an_old_job_json_loads_and_round_trips_keeping_its_parallelism_key(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text(json.dumps(OLD_JOB))
    spec = JobSpec.read(tmp_path)
    assert isinstance(spec.parallelism, Layout)
    assert spec.parallelism == Layout(dp_shard=2, reshard_after_forward=False, pp=2, pp_microbatches=4)
    assert spec.parallelism.pp_schedule == "1F1B"  # the old spelling, read as the one
    spec.write(tmp_path)
    written = json.loads((tmp_path / "job.json").read_text())
    assert written["parallelism"] == {**OLD_JOB["parallelism"], "pp_schedule": "1F1B"}
    assert JobSpec.from_dict(written) == spec
    # A job.json without the object (a script job written by hand) has the default layout.
    assert JobSpec.from_dict({"id": "x", "kind": "script"}).parallelism == Layout()


def test_a_job_json_with_a_degree_out_of_range_is_refused_in_one_line() -> None:
    with pytest.raises(UserError, match="parallelism setting pp=0"):
        JobSpec.from_dict({**OLD_JOB, "parallelism": {**OLD_JOB["parallelism"], "pp": 0}})


# --- one formula from plan to mesh -----------------------------------------------------------------------------


def _sharding_plans() -> list[Parallelism]:
    """Every sharding option the planner offers (both searches: the engine's and --export deepspeed), as plans."""
    out, seen = [], set()
    for export in (None, "deepspeed"):
        for dp, tp, pp in [(dp, 1, 1) for dp in (1, 2, 4, 8)] + [(1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]:
            for backend, zero, shard, off_opt, off_par in _sharding_options(dp, tp, pp, dp * tp * pp, SearchOptions(export=export)):
                key = (dp, tp, pp, backend, zero, shard, off_opt, off_par)
                if key not in seen:
                    seen.add(key)
                    out.append(Parallelism(gpu_indices=list(range(dp * tp * pp)), dp=dp, tp=tp, pp=pp, zero_stage=zero,
                                           shard_degree=shard, backend=backend, offload_optimizer=off_opt,
                                           offload_params=off_par))  # fmt: skip
    return out


def _plan(par: Parallelism, task: str = "train") -> Plan:
    mem = [MemoryBreakdown(gpu=g, stage=0, weights=1, gradients=1, optimizer=1, activations=1, kv_cache=0, buffers=0,
                           overhead=0, total=3, capacity=2**40, headroom=2**40 - 3) for g in par.gpu_indices]  # fmt: skip
    return Plan(workload=Workload(model="tiny", task=task, seq_len=64, precision="fp32"), parallelism=par, memory=mem,
                host=HostMemory(needed=1, available=None), timing=Timing(step_s=1, compute_s=1, exposed_comm_s=0,
                bubble_s=0), machine="simulated: 4×RTX 4090", gpu_names=["RTX 4090"] * len(par.gpu_indices), model_params=10**6)  # fmt: skip


def test_every_sharding_option_maps_to_one_layout_in_the_plan_the_job_and_the_mesh() -> None:
    """Once plan.py's mesh_shape/reshard_after_forward and capability.layout_of_plan disagreed on 9 of 41 options
    (DeepSpeed ZeRO-1/2: the plan said "reshard", the job ran FSDP2 without). Now each reads Layout.from_plan."""
    plans = _sharding_plans()
    assert len(plans) >= 41
    for par in plans:
        layout = Layout.from_plan(par)
        d = _plan(par).to_dict()["parallelism"]
        # The plan's JSON (what launchers and the memory tracer read) and its object say the layout's degrees.
        assert d["mesh_shape"] == layout.mesh_shape == par.mesh_shape, par
        assert d["reshard_after_forward"] is layout.reshard_after_forward is par.reshard_after_forward, par
        assert Layout.from_plan(parallelism_from_dict(d)) == layout, par
        assert layout.world_size == par.world_size, par
        # The submission takes the same layout for a job that leaves its degrees open.
        spec = JobSpec(id="j", kind="train")
        apply_plan_layout(spec, _plan(par))
        assert dataclasses.replace(spec.parallelism, pp_microbatches=layout.pp_microbatches) == layout, par


def test_a_plans_micro_batches_are_the_pipelines_under_pp_and_accumulation_otherwise() -> None:
    piped = Parallelism(gpu_indices=[0, 1], dp=1, pp=2, grad_accum=6, pipeline_schedule="gpipe")
    assert (Layout.from_plan(piped).pp_microbatches, Layout.from_plan(piped).pp_schedule) == (6, "GPipe")
    assert accumulation_of_plan(piped) == 1
    flat = Parallelism(gpu_indices=[0, 1], dp=2, grad_accum=6)
    assert Layout.from_plan(flat).pp_microbatches == 1 and accumulation_of_plan(flat) == 6


# --- submission ------------------------------------------------------------------------------------------------


def test_a_submission_reads_its_plan_with_plan_from_dict(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("hello\n")
    par = Parallelism(gpu_indices=[0, 1], dp=2, zero_stage=2, shard_degree=2, backend="fsdp", micro_batch=2, grad_accum=3)
    plan = json.loads(_plan(par).to_json())
    assert parse_plan(plan) == Plan.from_dict(plan)
    assert parse_plan({"schema": "rigpilot.plan-search/1", "best": plan}) == Plan.from_dict(plan)
    spec = {"kind": "train", "model": "gpt2", "train": {"dataset": ["data.txt"]}}
    sub = prepare(spec, plan, str(tmp_path), job_id="check", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)
    assert sub.spec.parallelism == Layout(dp_shard=2, reshard_after_forward=False)
    assert (sub.spec.train.micro_batch, sub.spec.train.grad_accum) == (2, 3)
    # A plan written by hand or by a script, with only what a job needs (no version, no predictions), runs as the
    # same layout: older engines took such files.
    for cut in ({k: plan[k] for k in ("schema_version", "workload", "parallelism")},
                {k: plan[k] for k in ("workload", "parallelism")}):  # fmt: skip
        sub = prepare(spec, cut, str(tmp_path), job_id="check", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)
        assert sub.spec.parallelism == Layout(dp_shard=2, reshard_after_forward=False)
    # A plan file from a newer Rigpilot, or not a plan at all, is refused in one line before anything is made.
    not_a_plan = {"workload": plan["workload"], "layers": 3}
    for bad, reason in (({**plan, "schema_version": 99}, "plan_too_new"), ({**plan, "schema": "other"}, "not_a_plan"),
                        (not_a_plan, "not_a_plan"), ({k: v for k, v in plan.items() if k != "workload"}, "user_error")):  # fmt: skip
        with pytest.raises(UserError) as refused:
            prepare(spec, bad, str(tmp_path), job_id="check", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)
        assert refused.value.reason == reason, str(refused.value)
    assert "has no schema_version" in str(refused_line(spec, not_a_plan, tmp_path))


def refused_line(spec: dict, plan: dict, tmp_path) -> str:
    try:
        prepare(spec, plan, str(tmp_path), job_id="check", machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)
    except UserError as e:
        return str(e)
    raise AssertionError("the plan was accepted")


def test_a_plan_file_with_a_degree_that_is_not_a_whole_number_is_refused_in_one_line() -> None:
    plan = json.loads(_plan(Parallelism(gpu_indices=[0, 1], dp=2)).to_json())
    plan["parallelism"]["dp"] = "2"
    loaded = Plan.from_dict({k: v for k, v in plan.items() if k not in ("runs_here", "runs_here_reason")})
    assert not loaded.runs_here and "parallelism.dp must be a whole number" in loaded.runs_here_reason
    with pytest.raises(UserError, match=r"malformed plan: parallelism\.dp must be a whole number") as e:
        Layout.from_plan(loaded)
    assert e.value.reason == "bad_layout"


def test_a_job_json_with_a_layout_out_of_range_reads_as_damaged_not_as_a_traceback(tmp_path: Path) -> None:
    from rigpilot.engine.jobs.job_folders import read_job
    from rigpilot.engine.jobspec.spec import UnreadableSpec

    job = tmp_path / "job-x"
    job.mkdir()
    JobSpec.from_dict({"id": "job-x", "kind": "train", "model": "m", "train": {"dataset": ["a.txt"]}}).write(job)
    data = json.loads((job / "job.json").read_text())
    data["parallelism"]["tp"] = 0
    (job / "job.json").write_text(json.dumps(data))
    with pytest.raises(UnreadableSpec, match="tp=0"):
        JobSpec.read(job)
    record, how = read_job(job)
    assert how == "damaged" and record is not None and "tp=0" in record.exit_reason


def test_a_plan_that_does_not_say_leaves_the_jobs_master_weights_and_one_that_does_decides(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("hello\n")
    plan = json.loads(_plan(Parallelism(gpu_indices=[0, 1], dp=2)).to_json())
    plan["workload"]["precision"] = "bf16"
    spec = {"kind": "train", "model": "gpt2", "train": {"dataset": ["data.txt"], "master_weights": "bf16"}}
    machine = load_profile("4x-rtx4090")
    assert plan["workload"]["master_weights"] is None  # made without asking: the job's own choice stands
    sub = prepare(spec, plan, str(tmp_path), job_id="a", machine=machine, max_cpu_ranks=2)
    assert sub.spec.train.master_weights == "bf16"
    plan["workload"].pop("master_weights")  # a plan file from before the setting existed
    sub = prepare(spec, plan, str(tmp_path), job_id="b", machine=machine, max_cpu_ranks=2)
    assert sub.spec.train.master_weights == "bf16"
    plan["workload"]["master_weights"] = "fp32"  # its memory was computed for fp32: the plan decides
    sub = prepare(spec, plan, str(tmp_path), job_id="c", machine=machine, max_cpu_ranks=2)
    assert sub.spec.train.master_weights == "fp32"
