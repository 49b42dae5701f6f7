"""The engine service's parts on their own: protocol, metrics cursor, stores, submission checks."""

import io
import json
import os
import stat
import time

import pytest

from engine.errors import UserError
from engine.hardware.simulated import load_profile
from engine.hardware.telemetry import GpuSample, TelemetrySample
from engine.service import protocol
from engine.service.metrics import MetricsSummary, read_records
from engine.service.protocol import ProtocolError
from engine.service.store import QUEUED, JobRecord, JobStore
from engine.service.submission import plan_prediction, prepare
from engine.service.telemetry_store import TelemetryStore


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
        protocol.parse_request(msg)
    assert e.value.code == code


def test_good_requests_parse():
    r = protocol.parse_request(req("metrics", job="abc", since_cursor={"0": 10}))
    assert (r.id, r.type, r.args) == (1, "metrics", {"job": "abc", "since_cursor": {"0": 10}})
    assert protocol.parse_request(req("telemetry_history", since=12)).args["since"] == 12  # ints are numbers


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
    sub = submit({"kind": "train", "model": "gpt2", "train": {"dataset": ["data.txt"]}}, plan=PLAN)
    p = sub.spec.parallelism
    assert sub.spec.gpus == [2, 3] and (p.dp_replicate, p.dp_shard, p.tp, p.pp) == (1, 2, 1, 1)
    assert sub.predicted["peak_memory_bytes"] == 6 * 2**30


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
    from engine.service.systemd import install_unit

    path = install_unit()
    assert path == tmp_path / "systemd" / "user" / "rigpilot-engine.service"
    text = path.read_text()
    assert "KillMode=process" in text and "-m engine.service" in text and "WantedBy=default.target" in text


def test_runtime_dir_falls_back_to_a_private_tmp_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    from engine.service.paths import runtime_dir

    d = runtime_dir()
    assert d == tmp_path / f"rigpilot-{os.getuid()}"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
