"""The engine service's parts on their own: protocol, metrics cursor, stores, submission checks."""

import io
import json
import os
import sqlite3
import stat
import sys
import time
from pathlib import Path

import pytest

from rigpilot.engine.api import protocol
from rigpilot.engine.api.protocol import ProtocolError
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.hardware.telemetry import GpuSample, TelemetrySample
from rigpilot.engine.jobs.job_view import compare
from rigpilot.engine.jobs.metrics import PEAK_MEMORY_KEYS, MetricsSummary, read_records, summarize
from rigpilot.engine.jobs.store import QUEUED, JobRecord, JobStore
from rigpilot.engine.jobs.submission import describe, plan_prediction, prepare
from rigpilot.engine.jobs.telemetry_store import TelemetryStore
from rigpilot.engine.planner.plan import HostMemory, MemoryBreakdown, Parallelism, Plan, Timing, Workload
from rigpilot.engine.service import requests


def req(rtype, **args):
    return protocol.request(1, rtype, **args)


# -- protocol ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg, code",
    [
        ({"v": 1, "id": 1, "type": "launch_missiles"}, protocol.UNKNOWN_TYPE),
        ({"v": 2, "id": 1, "type": "jobs"}, protocol.UNSUPPORTED_VERSION),
        ({"id": 1, "type": "jobs"}, protocol.UNSUPPORTED_VERSION),
        (req("job"), protocol.INVALID),  # missing required arg
        (req("job", job=5), protocol.INVALID),
        (req("logs", job="x", rank=True), protocol.INVALID),  # a bool is not an int
        (req("jobs", colour="red"), protocol.INVALID),  # unknown arg
        ({"v": 1, "id": [1], "type": "jobs"}, protocol.INVALID),
        ({"v": 1, "id": 1, "type": "jobs", "args": []}, protocol.INVALID),
    ],
)
def test_bad_requests_are_refused_with_a_code(msg, code):
    with pytest.raises(ProtocolError) as e:
        requests.parse_request(msg)
    assert e.value.code == code


def test_good_requests_parse():
    r = requests.parse_request(req("metrics", job="abc", since_cursor={"0": 10}))
    assert (r.id, r.type, r.args) == (1, "metrics", {"job": "abc", "since_cursor": {"0": 10}})
    assert requests.parse_request(req("telemetry_history", since=12)).args["since"] == 12  # ints are numbers


@pytest.mark.parametrize(
    "line, fragment",
    [(b"\xff\xfe{}", "not UTF-8"), (b"{nope", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'{"a": NaN}', "JSON")],
)
def test_undecodable_messages(line, fragment):
    with pytest.raises(ProtocolError) as e:
        protocol.decode(line)
    assert e.value.code == protocol.BAD_MESSAGE and fragment in e.value.message


def test_oversized_message_is_fatal_and_large_ones_fit():
    ok = b'{"x": "' + b"a" * (protocol.MAX_MESSAGE_BYTES - 20) + b'"}\n'
    assert protocol.read_message(io.BytesIO(ok))["x"].startswith("aaa")
    big = io.BytesIO(b"a" * (protocol.MAX_MESSAGE_BYTES + 10) + b"\n")
    with pytest.raises(ProtocolError) as e:
        protocol.read_message(big)
    assert e.value.code == protocol.TOO_LARGE and e.value.fatal
    with pytest.raises(ProtocolError):
        protocol.encode({"x": "a" * protocol.MAX_MESSAGE_BYTES})


def test_submit_spec_is_checked_against_jobspec_fields():
    machine = load_profile("4x-rtx4090")
    kw = {"job_id": "abc123", "machine": machine, "max_cpu_ranks": 4}
    with pytest.raises(ProtocolError, match=r"spec\.train\.max_steps: expected an integer, got a string"):
        prepare({"kind": "train", "train": {"max_steps": "ten"}}, None, "/", **kw)
    with pytest.raises(ProtocolError, match=r"unknown field 'gpu'"):
        prepare({"kind": "script", "gpu": [0]}, None, "/", **kw)


# -- submission checks ---------------------------------------------------------------


@pytest.fixture
def submit(tmp_path):
    machine = load_profile("4x-rtx4090")

    def go(spec, plan=None, cap=4):
        return prepare(spec, plan, str(tmp_path), job_id="abc123", machine=machine, max_cpu_ranks=cap)

    return go


def test_submission_errors_name_the_problem(submit, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    (tmp_path / "data.txt").write_text("some text\n")
    bad_model = tmp_path / "bad-model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text("{not json")
    cases = [
        ({"kind": "train", "model": "gpt2"}, "needs a dataset"),
        ({"kind": "train", "model": "gpt2", "train": {"dataset": ["missing.txt"]}}, "does not exist"),
        ({"kind": "train", "model": "gpt2", "train": {"dataset": ["empty.jsonl"]}}, "is empty"),
        ({"kind": "train", "model": "./bad-model", "train": {"dataset": ["data.txt"]}}, "not valid JSON"),
        ({"kind": "script", "gpus": [7], "script": ["x.py"]}, "GPU 7 does not exist"),
        ({"kind": "script", "gpus": [0, 0], "script": ["x.py"]}, "twice"),
        ({"kind": "script", "script": ["nope.py"]}, "does not exist"),
        ({"kind": "infer", "model": "gpt2"}, "needs prompts"),
        ({"kind": "train", "model": "gpt2", "gpus": [0, 1], "parallelism": {"tp": 4},
          "train": {"dataset": ["data.txt"]}}, "must multiply"),
    ]  # fmt: skip
    for spec, message in cases:
        with pytest.raises(UserError, match=message):
            submit(spec)


def test_submission_fills_in_defaults(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    sub = submit({"kind": "train", "model": "gpt2", "gpus": [1, 2], "train": {"dataset": ["data.txt"]}})
    assert sub.spec.parallelism.dp_replicate == 2 and sub.ranks == 2 and sub.spec.simulated
    assert sub.spec.train.dataset == [str(tmp_path / "data.txt")]
    (tmp_path / "s.py").write_text("pass\n")
    sub = submit({"kind": "script", "script": ["s.py", "--x"]}, cap=2)
    assert sub.spec.gpus == [0, 1, 2, 3] and sub.ranks == 2  # simulated ranks are capped
    assert sub.spec.script == [str(tmp_path / "s.py"), "--x"]


PLAN = {
    "schema": "rigpilot.plan",
    "parallelism": {"gpu_indices": [2, 3], "dp": 2, "tp": 1, "pp": 1, "zero_stage": 3, "shard_degree": 2,
                    "micro_batch": 4, "checkpointing": "full"},
    "memory": [{"gpu": 2, "total": 5 * 2**30}, {"gpu": 3, "total": 6 * 2**30}],
    "timing": {"step_s": 0.5, "tokens_per_s": 1200.0},
}  # fmt: skip


def test_plan_prediction_reads_the_planners_plan():
    want = {"peak_memory_bytes": 6 * 2**30, "tokens_per_s": 1200.0, "step_time_s": 0.5}
    got = plan_prediction(PLAN)
    assert {k: got[k] for k in want} == want and "--micro-batch 2" in got["suggestion"]
    assert plan_prediction({"best": PLAN, "runners_up": []})["peak_memory_bytes"] == 6 * 2**30  # a search result
    assert plan_prediction(None) is None and plan_prediction({"other": 1}) is None


def test_plan_layout_fills_in_gpus_and_degrees(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    plan = planner_plan(gpu_indices=[2, 3], zero_stage=3, shard_degree=2, backend="fsdp", micro_batch=4,
                        checkpointing="full")  # fmt: skip
    sub = submit({"kind": "train", "model": "gpt2", "train": {"dataset": ["data.txt"]}}, plan=plan)
    p = sub.spec.parallelism
    assert sub.spec.gpus == [2, 3] and (p.dp_replicate, p.dp_shard, p.tp, p.pp) == (1, 2, 1, 1)
    assert sub.predicted["peak_memory_bytes"] == 3 * 2**30
    # The plan is read as the planner wrote it (Plan.from_dict): a partial one is refused in one line.
    with pytest.raises(UserError, match="malformed plan"):
        submit({"kind": "train", "model": "gpt2", "train": {"dataset": ["data.txt"]}}, plan={**PLAN, "schema_version": 1})


def planner_plan(task="train", seq_len=256, precision="fp32", **par) -> dict:
    """A plan as the planner writes it (Plan.to_dict), so the field names are the real ones."""
    layout = {"gpu_indices": [0, 1], "dp": 2, "micro_batch": 2, "grad_accum": 4, "checkpointing": "selective", **par}
    gpus = layout["gpu_indices"]
    mem = [MemoryBreakdown(gpu=g, stage=0, weights=1, gradients=1, optimizer=1, activations=1, kv_cache=0, buffers=0,
                           overhead=0, total=3 * 2**30, capacity=24 * 2**30, headroom=21 * 2**30) for g in gpus]  # fmt: skip
    plan = Plan(
        workload=Workload(model="tiny", task=task, seq_len=seq_len, precision=precision, global_batch=16),
        parallelism=Parallelism(**layout), memory=mem, host=HostMemory(needed=2**30, available=None),
        timing=Timing(step_s=0.5, compute_s=0.4, exposed_comm_s=0.1, bubble_s=0.0, tokens_per_s=8192.0),
        machine="simulated: 4×RTX 4090", gpu_names=["RTX 4090"] * len(gpus), model_params=10**6,
    )  # fmt: skip
    return json.loads(json.dumps(plan.to_dict()))


TRAIN = {"kind": "train", "model": "gpt2", "train": {"dataset": ["data.txt"], "micro_batch": 8, "grad_accum": 1,
         "seq_len": 64, "precision": "bf16", "activation_checkpointing": "none"}}  # fmt: skip


def test_plan_settings_decide_over_the_submissions_and_are_recorded(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    sub = submit(TRAIN, plan=planner_plan())
    t, p = sub.spec.train, sub.spec.parallelism
    assert (t.micro_batch, t.grad_accum, t.activation_checkpointing, t.seq_len, t.precision) == (
        2, 4, "selective", 256, "fp32")  # fmt: skip
    assert sub.spec.gpus == [0, 1] and (p.dp_replicate, p.dp_shard, p.tp, p.pp) == (2, 1, 1, 1)
    taken = {"gpus": [0, 1], "micro_batch": 2, "grad_accum": 4, "activation_checkpointing": "selective",
             "seq_len": 256, "precision": "fp32"}  # fmt: skip
    assert {k: sub.from_plan[k] for k in taken} == taken and sub.from_plan["parallelism"]["dp_replicate"] == 2
    # The record keeps it: `predicted` is what the supervisor stores in the job's row.
    assert sub.predicted["from_plan"] == sub.from_plan and sub.predicted["plan_notes"] == []
    assert sub.predicted["peak_memory_bytes"] == 3 * 2**30 and sub.predicted["tokens_per_s"] == 8192.0
    # A search result runs under its best plan.
    best = submit(TRAIN, plan={"schema": "rigpilot.plan-search/1", "best": planner_plan(seq_len=128)})
    assert best.spec.train.seq_len == 128


def test_zero_1_and_2_plans_run_as_fsdp2_without_resharding_after_forward(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    for stage in (1, 2):
        plan = planner_plan(gpu_indices=[0, 1, 2, 3], dp=4, zero_stage=stage, shard_degree=4, backend="deepspeed")
        sub = submit(TRAIN, plan=plan)
        p = sub.spec.parallelism
        assert (p.dp_replicate, p.dp_shard, sub.ranks) == (1, 4, 4) and sub.from_plan["zero_stage"] == stage
        assert p.reshard_after_forward is False and sub.from_plan["parallelism"]["reshard_after_forward"] is False
        # ZeRO-2 is exactly what runs; ZeRO-1 runs as ZeRO-2, and says so.
        notes = sub.predicted.get("plan_notes") or []
        assert notes == [] if stage == 2 else ("ZeRO-1" in notes[0] and "gradients are sharded too" in notes[0])
    hsdp_plan = planner_plan(gpu_indices=[0, 1, 2, 3], dp=4, zero_stage=3, shard_degree=2, backend="fsdp")
    hsdp = submit(TRAIN, plan=hsdp_plan)
    p = hsdp.spec.parallelism
    assert (p.dp_replicate, p.dp_shard) == (2, 2) and hsdp.notes == [] and p.reshard_after_forward is True


LLAMA_TRAIN = {**TRAIN, "model": "llama-2-7b"}  # a Llama-style preset: pipeline and tensor parallel run it


def test_pipeline_plans_accumulate_through_the_schedule(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    sub = submit(LLAMA_TRAIN, plan=planner_plan(dp=1, pp=2, grad_accum=4, pipeline_schedule="1f1b"))
    p, t = sub.spec.parallelism, sub.spec.train
    assert (p.pp, p.pp_microbatches, p.pp_schedule, t.grad_accum) == (2, 4, "1F1B", 1)
    sub = submit(LLAMA_TRAIN, plan=planner_plan(dp=1, pp=2, grad_accum=1, pipeline_schedule="1f1b"))
    assert sub.spec.parallelism.pp_schedule == "GPipe"  # 1F1B needs a micro-batch per stage
    assert "GPipe runs instead" in sub.predicted["plan_notes"][0]


def test_pipeline_stages_alone_get_a_micro_batch_per_stage(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    sub = submit({**LLAMA_TRAIN, "gpus": [0, 1], "parallelism": {"pp": 2}})
    p = sub.spec.parallelism
    assert (p.pp, p.pp_microbatches, p.pp_schedule) == (2, 2, "1F1B")
    assert any("default to the number of stages (2)" in n for n in sub.notes)
    # Micro-batches the user chose are kept; 1F1B then falls back to GPipe and says so.
    sub = submit({**LLAMA_TRAIN, "gpus": [0, 1], "parallelism": {"pp": 2, "pp_microbatches": 1}})
    assert (sub.spec.parallelism.pp_microbatches, sub.spec.parallelism.pp_schedule) == (1, "GPipe")
    sub = submit({**LLAMA_TRAIN, "gpus": [0, 1], "parallelism": {"pp": 2, "pp_schedule": "gpipe"}})
    assert sub.spec.parallelism.pp_schedule == "GPipe"
    with pytest.raises(UserError, match="pp_schedule='zigzag': must be one of 1F1B, GPipe"):
        submit({**LLAMA_TRAIN, "gpus": [0, 1], "parallelism": {"pp": 2, "pp_schedule": "zigzag"}})


def test_offloading_plans_run_as_fsdp2_with_cpu_offload(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    plan = planner_plan(zero_stage=3, shard_degree=2, backend="fsdp", offload_optimizer=True, offload_params=True)
    sub = submit(TRAIN, plan=plan)
    p = sub.spec.parallelism
    assert p.cpu_offload and (p.dp_replicate, p.dp_shard) == (1, 2) and sub.from_plan["cpu_offload"] is True
    assert any("offloaded to CPU RAM" in line for line in describe(sub))
    # The plan's host RAM was for the simulated machine; the CPU ranks run on this host: both are named.
    ram = next(line for line in describe(sub) if line.startswith("host RAM"))
    assert "simulated machine's" in ram and "this host, which runs the CPU ranks" in ram
    # A script splits its work itself: the plan only brings predictions.
    (tmp_path / "s.py").write_text("pass\n")
    sub = submit({"kind": "script", "script": ["s.py"]}, plan=plan)
    assert sub.spec.gpus == [0, 1, 2, 3] and "from_plan" not in sub.predicted and not sub.spec.parallelism.cpu_offload


def test_what_the_engine_cannot_run_is_refused_in_the_capability_contracts_words(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    with pytest.raises(UserError) as e:
        submit({**LLAMA_TRAIN, "gpus": [0, 1], "train": {**TRAIN["train"], "method": "qlora"}, "parallelism": {"tp": 2}})
    assert "QLoRA" in str(e.value) and "tensor parallel" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="CPU offload runs with FSDP2 data parallelism only"):
        submit({**LLAMA_TRAIN, "gpus": [0, 1], "parallelism": {"tp": 2, "cpu_offload": True}})
    with pytest.raises(UserError, match=r"pipeline parallel runs .*'gpt2' is not one of them"):
        submit({**TRAIN, "gpus": [0, 1], "parallelism": {"pp": 2}})
    with pytest.raises(UserError, match="this plan does not run here: CPU offload"):
        submit(LLAMA_TRAIN, plan=planner_plan(tp=2, dp=1, offload_params=True, offload_optimizer=True))
    sub = submit({**LLAMA_TRAIN, "train": {**TRAIN["train"], "method": "qlora"}})
    assert sub.spec.train.method == "qlora" and sub.model_type == "llama"


def test_fewer_cpu_ranks_than_gpus_keep_the_global_batch(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    plan = planner_plan(gpu_indices=[0, 1, 2, 3], dp=4, grad_accum=2, micro_batch=1)
    sub = submit(TRAIN, plan=plan, cap=2)
    p, t = sub.spec.parallelism, sub.spec.train
    assert sub.ranks == 2 and p.dp_replicate * p.dp_shard == 2
    assert t.micro_batch * t.grad_accum * 2 == 1 * 2 * 4  # the plan's 8 sequences per step
    assert any("gradient accumulation rises from 2 to 4" in n for n in sub.notes)


def test_plans_for_another_task_and_user_degrees(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    with pytest.raises(UserError, match="made for inference, not for a train job"):
        submit(TRAIN, plan=planner_plan(task="infer"))
    sub = submit({**TRAIN, "gpus": [0, 1], "parallelism": {"dp_shard": 2}}, plan=planner_plan())
    assert (sub.spec.parallelism.dp_replicate, sub.spec.parallelism.dp_shard) == (1, 2)
    assert "parallelism" not in sub.from_plan and sub.spec.train.micro_batch == 2
    with pytest.raises(UserError, match="precision='fp8': must be one of fp32, bf16, fp16"):
        submit({**TRAIN, "train": {**TRAIN["train"], "precision": "fp8"}})
    two_nodes = planner_plan(dp=4, nodes=2)  # a plan for 2 nodes of 2 GPUs, submitted to one engine
    with pytest.raises(UserError, match=r"this plan spans 2 nodes: run it with --nodes local,NODE"):
        submit(TRAIN, plan=two_nodes)


# -- metrics ------------------------------------------------------------------------------


def test_metrics_cursor_returns_complete_lines_once(tmp_path):
    d = tmp_path / "metrics"
    d.mkdir()
    r0, r1 = d / "rank0.jsonl", d / "rank1.jsonl"
    r0.write_text(json.dumps({"time": 1.0, "rank": 0, "step": 0, "loss": 3.0}) + "\n" + '{"time": 3.0, "ra')
    r1.write_text(json.dumps({"time": 2.0, "rank": 1, "step": 0, "loss": 3.1}) + "\nnot json\n")
    records, cursor, more = read_records(d, {})
    assert [(r["rank"], r["time"]) for r in records] == [(0, 1.0), (1, 2.0)] and not more
    assert read_records(d, cursor)[0] == []  # nothing new: the half line waits
    with r0.open("a") as f:
        f.write('nk": 0, "step": 1, "loss": 2.5}\n')
    records, cursor2, _ = read_records(d, cursor)
    assert [r["step"] for r in records] == [1]
    assert cursor2["1"] == r1.stat().st_size


def test_metrics_are_paged_by_size(tmp_path):
    d = tmp_path / "metrics"
    d.mkdir()
    with (d / "rank0.jsonl").open("w") as f:
        for i in range(2000):
            f.write(json.dumps({"time": float(i), "rank": 0, "step": i, "loss": 1.0}) + "\n")
    cursor, seen, pages = {}, [], 0
    while True:
        records, cursor, more = read_records(d, cursor, max_bytes=8192)
        seen += [r["step"] for r in records]
        pages += 1
        if not more:
            break
    assert seen == list(range(2000)) and pages > 5


def test_summary_progress_eta_memory_and_tokens():
    s = MetricsSummary(max_steps=100)
    for step in range(11):
        s.add({"time": 100.0 + step, "rank": 0, "step": step, "loss": 5.0 - step * 0.1, "tokens_per_s": 900.0})
        s.add({"time": 100.0 + step, "rank": 1, "step": step, "peak_memory": 2**30 + step})
    s.add({"time": 111.0, "rank": 0, "kind": "status", "phase": "training"})
    d = s.to_dict(now=110.0)
    assert d["step"] == 10 and d["fraction"] == 0.1 and d["eta_s"] == pytest.approx(90.0)
    assert d["loss"] == pytest.approx(4.0) and d["tokens_per_s"] == 900.0 and d["phase"] == "training"
    assert d["peak_memory_by_rank"] == {"1": 2**30 + 10}


def test_tokens_per_s_is_the_sum_of_each_ranks_latest_value():
    s = MetricsSummary()
    s.add({"time": 1.0, "rank": 0, "step": 1, "tokens_per_s": 100.0})
    s.add({"time": 1.0, "rank": 1, "step": 1, "tokens_per_s": 110.0})
    assert s.tokens_per_s == 210.0  # rank 0 is one rank, not the job
    s.add({"time": 2.0, "rank": 0, "step": 2, "tokens_per_s": 120.0})
    assert s.tokens_per_s == 230.0
    s.add({"time": 2.0, "rank": 1, "step": 2, "loss": 1.0})  # no rate in this record: the last one stands
    s.add({"time": 3.0, "rank": 2, "step": 2, "tokens_per_s": 50})
    assert s.to_dict()["tokens_per_s"] == 280.0


def test_the_steady_speed_is_each_ranks_median_of_its_latest_ten_steps_and_the_slowest_ranks_step_time():
    s = MetricsSummary()
    for step in range(1, 21):  # the first steps warm up: slow, and out of the last ten
        for rank, tps in ((0, 100.0 * step), (1, 50.0)):
            s.add({"time": float(step), "rank": rank, "step": step, "tokens_per_s": tps,
                   "step_time": 9.0 if step < 5 else 1.0 + rank * 0.5 + (step == 20)})  # fmt: skip
    d = s.to_dict()
    # rank 0's last ten rates are 1100 … 2000 (median 1550); rank 1's all 50; the latest is 2000 + 50
    assert d["steady_tokens_per_s"] == 1550.0 + 50.0 and d["tokens_per_s"] == 2050.0
    assert d["steady_step_time_s"] == 1.5  # steps 11–20: the slower rank's 1.5 s (step 20's 2.5 s is one of ten)
    from rigpilot.engine.jobs.job_view import compare

    assert compare({"tokens_per_s": 3200.0}, d)["tokens_per_s"] == {"predicted": 3200.0, "measured": 1600.0}
    assert compare({"step_time_s": 1.0}, d)["step_time_s"] == {"predicted": 1.0, "measured": 1.5}
    # A job finished under an engine before the steady figures: its frozen progress reads as it did then.
    from rigpilot.engine.jobs.job_view import with_steady

    old = {"tokens_per_s": 2050.0, "steps_per_s": 0.5}
    assert compare({"tokens_per_s": 3200.0, "step_time_s": 1.0}, with_steady(old)) == {
        "peak_memory_bytes": {"predicted": None, "measured": None},
        "tokens_per_s": {"predicted": 3200.0, "measured": 2050.0},
        "step_time_s": {"predicted": 1.0, "measured": 2.0},
    }
    assert with_steady(d) is d and with_steady(None) is None


def test_the_loss_shown_is_the_latest_steps_whichever_node_its_rank_zero_is_on():
    s = MetricsSummary()
    s.add({"rank": 2, "step": 3, "loss": 1.3})  # this node's ranks are 2 and 3; rank 0's node is late
    s.add({"rank": 0, "step": 1, "loss": 1.9})  # rank 0's first step arrives after: it does not win
    assert s.to_dict()["loss"] == 1.3
    s.add({"rank": 0, "step": 3, "loss": 1.3000001})  # the same step: rank 0's figure is the one shown
    s.add({"rank": 2, "step": 3, "loss": 1.3})
    assert s.to_dict()["loss"] == 1.3000001
    s.add({"rank": 2, "step": 2, "loss": 1.5, "run": 2})  # resumed from step 1: the new run's steps count
    assert s.to_dict()["loss"] == 1.5


def test_train_worker_records_feed_peak_memory_and_the_comparison(tmp_path):
    """Records shaped exactly as engine.workers.train writes them, through the files and the summary."""
    assert "peak_memory" in PEAK_MEMORY_KEYS and "max_allocated" in PEAK_MEMORY_KEYS
    d = tmp_path / "metrics"
    d.mkdir()
    for rank in (0, 1):
        lines = [{"time": 10.0, "rank": rank, "step": None, "kind": "status", "phase": "training", "max_steps": 4}]
        for step in range(1, 5):
            lines.append({"time": 10.0 + step, "rank": rank, "step": step, "loss": 3.0 - step * 0.1, "lr": 1e-3,
                          "grad_norm": 1.5, "tokens_per_s": 1000.0 + rank, "step_time": 0.256, "mfu": None,
                          "peak_memory": (2 + rank) * 2**30 + step})  # fmt: skip
        (d / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary, _ = summarize(d, max_steps=4)
    progress = summary.to_dict()
    assert progress["peak_memory_by_rank"] == {"0": 2 * 2**30 + 4, "1": 3 * 2**30 + 4}
    assert progress["tokens_per_s"] == 2001.0 and progress["step"] == 4 and progress["fraction"] == 1.0
    predicted = {"peak_memory_bytes": 4 * 2**30, "tokens_per_s": 1800.0, "step_time_s": 0.3}
    comparison = compare(predicted, progress)
    assert comparison["peak_memory_bytes"] == {"predicted": 4 * 2**30, "measured": 3 * 2**30 + 4}
    assert comparison["tokens_per_s"] == {"predicted": 1800.0, "measured": 2001.0}
    assert comparison["step_time_s"]["measured"] == pytest.approx(0.256)  # the steps' own time, as the app shows it
    # An out-of-memory record's allocator peak counts too.
    summary.add({"time": 20.0, "rank": 1, "kind": "error", "error": "out_of_memory", "max_allocated": 5 * 2**30})
    assert summary.to_dict()["peak_memory_by_rank"]["1"] == 5 * 2**30


# -- stores -------------------------------------------------------------------------------


def test_job_store_round_trip_and_lookup(tmp_path):
    store = JobStore(tmp_path / "engine.db")
    rec = JobRecord(id="ab12cd", seq=store.next_seq(), kind="script", name="demo", state=QUEUED, gpus=[0, 2],
                    ranks=2, simulated=True, created=time.time(), predicted={"peak_memory_bytes": 5})  # fmt: skip
    store.insert(rec)
    store.update(rec, state="failed", failed_rank=1, last_log=["x", "y"], cancel_requested=True)
    again = JobStore(tmp_path / "engine.db").get("ab12cd")
    assert again == rec
    assert [r.id for r in store.find("ab1")] == ["ab12cd"] and [r.id for r in store.find("demo")] == ["ab12cd"]
    assert store.find("zz") == []
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_job_store_adds_columns_for_new_fields_and_old_rows_read_as_defaults(tmp_path):
    db = tmp_path / "engine.db"
    store = JobStore(db)
    rec = JobRecord(id="ab12cd", seq=1, kind="train", name="old", state=QUEUED, gpus=[0], ranks=1,
                    simulated=True, created=1.0)  # fmt: skip
    store.insert(rec)
    store.close()
    # A table as an older engine made it: without the newest fields' columns.
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE jobs DROP COLUMN last_log")
    con.execute("ALTER TABLE jobs DROP COLUMN resumable")
    con.commit()
    con.close()
    again = JobStore(db)
    old = again.get("ab12cd")
    assert old.last_log == [] and old.resumable is False and old.name == "old"
    again.update(old, last_log=["a"], resumable=True)
    assert JobStore(db).get("ab12cd") == old


def test_a_jobs_wall_time_adds_up_its_runs():
    from rigpilot.engine.jobs.job_view import wall_s

    rec = JobRecord(id="ab12cd", seq=1, kind="train", name="x", state="completed", gpus=[0], ranks=1,
                    simulated=True, created=0.0, started=500.0, ended=520.0, run=2)  # fmt: skip
    runs = {"runs": [{"run": 1, "seconds": 300.0}, {"run": 2, "seconds": 20.0}]}
    assert wall_s(rec, runs, now=600.0) == 320.0
    # Without every run timed (an engine from before energy records), the last run's own span.
    assert wall_s(rec, {"runs": runs["runs"][1:]}, now=600.0) == 20.0
    rec.ended = None  # still running: up to now
    assert wall_s(rec, None, now=530.0) == 30.0
    rec.started = None
    assert wall_s(rec, None, now=530.0) is None


def test_telemetry_store_thins_old_samples_and_pages(tmp_path):
    now = [10_000.0]
    ts = TelemetryStore(tmp_path / "t.db", min_interval=1.0, full_window=100, coarse_interval=10, retention=300,
                        prune_every=1e9, clock=lambda: now[0])  # fmt: skip
    for i in range(400):
        sample = TelemetrySample(time=10_000.0 + i, gpus=[GpuSample(index=0, gpu_util=float(i))])
        assert ts.add(sample)
        assert not ts.add(TelemetrySample(time=10_000.0 + i + 0.3, gpus=[]))  # faster than 1 Hz: skipped
    now[0] = 10_400.0
    ts.prune()
    samples, more = ts.since(None)
    times = [s["time"] - 10_000.0 for s in samples]
    assert not more and times[-100:] == [float(t) for t in range(300, 400)]  # the last 100 s in full
    assert times[:20] == [float(t) for t in range(100, 300, 10)]  # older: one per 10 s, none before 300 s ago
    page, more = ts.since(10_350.0, limit=10)
    assert more and page[0]["time"] == 10_351.0 and page[0]["gpus"][0]["gpu_util"] == 351.0


def test_systemd_unit_keeps_jobs_alive_on_stop(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    from rigpilot.engine.launch.systemd import install_unit

    path = install_unit()
    assert path == tmp_path / "systemd" / "user" / "rigpilot-engine.service"
    text = path.read_text()
    assert "KillMode=process" in text and "-m rigpilot.engine.service" in text and "WantedBy=default.target" in text


def test_install_systemd_uses_the_packaged_unit_when_rigpilot_is_the_package(tmp_path, monkeypatch, capsys):
    from rigpilot.engine.cli.entry import main
    from rigpilot.engine.launch import systemd

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    shipped = tmp_path / "usr-lib" / systemd.UNIT_NAME
    shipped.parent.mkdir()
    shipped.write_text("[Unit]\n")
    monkeypatch.setattr(systemd, "PACKAGED_UNIT", shipped)
    monkeypatch.setattr(systemd, "PACKAGED_PREFIX", Path(sys.prefix).resolve())  # as if this were /opt/rigpilot
    assert main(["engine", "--install-systemd"]) == 0
    assert f"the package installed the unit already ({shipped})" in capsys.readouterr().out
    assert not (tmp_path / "config").exists()  # nothing written into the home folder
    monkeypatch.setattr(systemd, "PACKAGED_PREFIX", tmp_path / "elsewhere")  # a pip or source install
    assert main(["engine", "--install-systemd"]) == 0
    assert (tmp_path / "config" / "systemd" / "user" / systemd.UNIT_NAME).is_file()


def test_runtime_dir_falls_back_to_a_private_tmp_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    from rigpilot.engine.paths import runtime_dir

    d = runtime_dir()
    assert d == tmp_path / f"rigpilot-{os.getuid()}"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_run_train_flags_become_the_job_spec():
    from rigpilot.engine.cli.commands import build_spec
    from rigpilot.engine.cli.entry import build_parser

    words = ["run", "train", "--model", "gpt2", "--data", "chat.jsonl", "--seq", "128", "--tp", "2"]
    spec = build_spec(build_parser().parse_args(words))
    assert spec["train"] == {"dataset": ["chat.jsonl"], "seq_len": 128}  # answers only unless asked
    assert spec["parallelism"] == {"tp": 2}
    spec = build_spec(build_parser().parse_args([*words, "--train-on-prompts"]))
    assert spec["train"]["train_on_prompts"] is True


def test_a_layout_wider_than_the_simulated_cpu_ranks_shrinks_its_data_parallelism(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    gpus = [0, 1, 2, 3]
    train = {"kind": "train", "model": "llama-2-7b", "gpus": gpus, "train": {"dataset": ["data.txt"]}}
    sub = submit({**train, "parallelism": {"dp_shard": 4}}, cap=2)
    p = sub.spec.parallelism
    assert (p.dp_replicate, p.dp_shard, sub.ranks, sub.spec.gpus) == (1, 2, 2, gpus)
    note, accumulation = sub.predicted["plan_notes"]
    assert "4 GPUs run as 2 CPU ranks" in note and "fsdp 4 to dp 1 × fsdp 2" in note
    assert sub.spec.train.grad_accum == 2 and "rises from 1 to 2" in accumulation
    sub = submit({**train, "parallelism": {"dp_replicate": 2, "tp": 2}}, cap=3)  # tp kept; dp 3 // 2 = 1
    assert (sub.spec.parallelism.dp_replicate, sub.spec.parallelism.tp, sub.ranks) == (1, 2, 2)
    wide = submit({**train, "parallelism": {"tp": 4}}, cap=2)  # wider than the cap: the ranks share the cores
    assert (wide.ranks, wide.spec.parallelism.tp) == (4, 4) and "share this machine's cores" in wide.notes[0]
    # A plan for the four GPUs runs the same way.
    sub = submit(train, plan=planner_plan(gpu_indices=gpus, dp=4, zero_stage=3, shard_degree=4, backend="fsdp"), cap=2)
    assert (sub.spec.parallelism.dp_shard, sub.ranks) == (2, 2)
    assert any("run as 2 CPU ranks" in n for n in sub.predicted["plan_notes"])


def test_a_sequence_longer_than_the_models_context_is_refused_before_launch(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    train = {"kind": "train", "model": "m", "train": {"dataset": ["data.txt"], "seq_len": 512}}
    with pytest.raises(UserError, match=r"sequence length 512 is longer than the model's context of 64 tokens; use --seq 64"):
        submit(train)
    assert submit({**train, "train": {"dataset": ["data.txt"], "seq_len": 64}}).model_type == "llama"
    # Left unset, the sequence length follows the model's context, and the job says so.
    sub = submit({**train, "train": {"dataset": ["data.txt"]}})
    assert sub.spec.train.seq_len == 64 and any("the model's context" in n for n in sub.notes)


def test_a_simulated_plan_too_big_for_this_hosts_ram_says_so_without_refusing(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    plan = planner_plan()
    plan["model_params"] = 7 * 10**9  # 112 GB of fp32 weights, gradients and AdamW moments
    sub = submit(TRAIN, plan=plan)
    assert any("run out of memory; simulated machines run small models" in n for n in sub.notes)
    assert not any("simulated machines" in n for n in submit(TRAIN, plan=planner_plan()).notes)


def test_run_flags_reach_the_job_spec():
    from rigpilot.engine.cli.commands import build_spec
    from rigpilot.engine.cli.entry import build_parser

    words = ["run", "train", "--model", "m", "--data", "d.txt", "--method", "qlora", "--pp", "2", "--pp-microbatches",
             "4", "--pp-schedule", "gpipe", "--precision", "fp32", "--checkpointing", "full", "--save-merged",
             "--cpu-offload", "--seed", "7", "--check"]  # fmt: skip
    args = build_parser().parse_args(words)
    spec = build_spec(args)
    assert args.check and spec["train"]["method"] == "qlora" and spec["train"]["save_merged"] is True
    assert spec["parallelism"] == {"pp": 2, "pp_microbatches": 4, "pp_schedule": "GPipe", "cpu_offload": True}
    assert (spec["train"]["precision"], spec["train"]["activation_checkpointing"], spec["train"]["seed"]) == ("fp32", "full", 7)
    spec = build_spec(build_parser().parse_args(
        ["run", "infer", "--model", "m", "--prompt", "hi", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
         "--precision", "fp32", "--tp", "2", "--sequence-parallel"]))  # fmt: skip
    assert spec["infer"] == {"prompts": ["hi"], "precision": "fp32", "temperature": 0.7, "top_p": 0.9, "seed": 3}
    for bad in (["--lr", "nan"], ["--lr", "inf"], ["--seed", "-1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "train", "--model", "m", *bad])


@pytest.mark.parametrize(
    ("section", "setting", "value", "words"),
    [
        ("train", "max_steps", 10**30, "train setting max_steps=1e+30: must be in [1, 100,000,000]"),
        ("train", "grad_accum", 10**30, "train setting grad_accum=1e+30: must be in [1, 65536]"),
        ("train", "eval_fraction", -1, "train setting eval_fraction=-1: must be in [0, 1)"),
        ("train", "keep_checkpoints", -1, "train setting keep_checkpoints=-1: must be in [0, 1,000,000]"),
        ("train", "lora_rank", -1, "train setting lora_rank=-1: must be in [1, 65536]"),
        ("train", "seed", 2**63, "train setting seed=9.22e+18: must be in [0, 9,223,372,036,854,775,807]"),
        ("train", "learning_rate", 0, "train setting learning_rate=0: must be in (0, 10]"),
        ("parallelism", "pp_schedule", "bogus", "parallelism setting pp_schedule='bogus': must be one of 1F1B, GPipe"),
        ("parallelism", "tp", 0, "parallelism setting tp=0: must be in [1, 512]"),
    ],
)
def test_every_job_setting_has_a_range_refused_in_one_line(submit, tmp_path, section, setting, value, words):
    (tmp_path / "data.txt").write_text("hello\n")
    spec = json.loads(json.dumps(TRAIN))
    spec.setdefault(section, {})[setting] = value
    with pytest.raises(UserError) as e:
        submit(spec)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_names_paths_and_environments_are_bounded(submit, tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    with pytest.raises(UserError, match=r"model m+…m+ is 100,000 bytes long; paths have at most 4,095 bytes"):
        submit({**TRAIN, "model": "m" * 100_000})
    with pytest.raises(UserError, match="not a valid variable name"):
        submit({**TRAIN, "env": {"A=B": "1"}})
    with pytest.raises(UserError, match=r"train\.text_field is 10,000 characters long; at most 256"):
        submit({**TRAIN, "train": {**TRAIN["train"], "text_field": "t" * 10_000}})
    with pytest.raises(UserError, match="GPU index -1 is out of range"):
        submit({**TRAIN, "gpus": [-1]})


def test_resume_checks_its_environment_as_submit_does():
    from rigpilot.engine.jobs.limits import ENV_VALUE_MAX, check_env

    check_env({"HF_TOKEN": "hf_x" * 10, "A_1": ""})
    for env, words in (({"A=B": "1"}, "not a valid variable name"), ({"X": "v" * (ENV_VALUE_MAX + 1)}, "characters long")):
        with pytest.raises(UserError, match=words):
            check_env(env)
