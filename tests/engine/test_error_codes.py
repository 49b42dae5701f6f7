"""Refusals carry a reason and fields from where they are raised to where a client acts on them: over the
engine's socket (the error reply's `reason` and `fields`), back out of the client as an EngineError, and into
the GUI's offered fix, which reads the fields and never the sentence."""

from __future__ import annotations

import socket

import pytest

from rigpilot.app.engine_link import CONNECTED, EngineLink
from rigpilot.app.planner.model import error_text
from rigpilot.app.planner.page import PlannerPage
from rigpilot.app.wizard.state import EXAMPLES, TINY_MODEL
from rigpilot.engine import paths
from rigpilot.engine.api import protocol
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.diskspace import DiskFull
from rigpilot.engine.errors import UserError
from rigpilot.engine.given_path import PathRefused

from support.engine import Engine, engine_home, leftover_job_processes, raw_exchange

TINY = str(EXAMPLES / TINY_MODEL)  # a 256-token context


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        base = tmp_path_factory.mktemp("engine")
        engine_home(base, mp)
        e = Engine(base)
        e.start()
        try:
            yield e
        finally:
            e.stop()
            for p in leftover_job_processes(base):
                p.kill()


def ask(rtype: str, **args) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(60)
        s.connect(str(paths.socket_path()))
        return raw_exchange(s, protocol.encode(protocol.request(1, rtype, **args)))


# -- the wire ---------------------------------------------------------------------------------------------------


def test_a_plan_longer_than_the_models_context_is_refused_with_its_reason_and_fields(engine):
    reply = ask("plan", model=TINY, workload={"task": "train", "seq_len": 2048})
    err = reply["error"]
    assert reply["ok"] is False and err["code"] == protocol.USER_ERROR  # the class older clients decide on
    assert err["reason"] == "seq_too_long"
    assert err["fields"] == {"setting": "seq_len", "value": 2048, "limit": 256}
    assert "--" not in err["fields"]["setting"]  # a setting's key, never a CLI flag
    assert err["message"]  # the one line, for clients that show it as it is


def test_a_submission_longer_than_the_models_context_names_the_job_setting(engine):
    data = engine.tmp / "data.txt"
    data.write_text("hello world\n" * 20)
    spec = {"kind": "train", "model": TINY, "train": {"dataset": [str(data)], "seq_len": 1024}, "gpus": [0]}
    err = ask("check", spec=spec)["error"]
    assert (err["code"], err["reason"]) == (protocol.USER_ERROR, "seq_too_long")
    assert err["fields"] == {"setting": "train.seq_len", "value": 1024, "limit": 256}


def test_bad_path_and_not_found_are_ordinary_refusals_with_their_old_fields_kept(engine):
    missing = str(engine.tmp / "no-such-data.txt")
    spec = {"kind": "train", "model": TINY, "train": {"dataset": [missing]}, "gpus": [0]}
    err = ask("check", spec=spec)["error"]
    assert (err["code"], err["reason"]) == (protocol.BAD_PATH, "bad_path")
    assert err["fields"] == {"path": missing, "problem": "missing"}
    assert (err["path"], err["problem"]) == (missing, "missing")  # where clients of protocol 1 read them

    err = ask("job", job="zz9999")["error"]
    assert (err["code"], err["reason"], err["fields"]) == (protocol.NOT_FOUND, "not_found", {})

    err = ask("no_such_request")["error"]  # a protocol error: its class is its reason
    assert (err["code"], err["reason"], err["fields"]) == (protocol.UNKNOWN_TYPE, "unknown_type", {})


def test_the_client_raises_the_reason_and_fields(engine):
    with engine.client() as c, pytest.raises(EngineError) as refused:
        c.request("plan", model=TINY, workload={"task": "train", "seq_len": 300})
    e = refused.value
    assert (e.code, e.reason, e.fields) == ("user_error", "seq_too_long", {"setting": "seq_len", "value": 300, "limit": 256})


def test_a_planner_refusal_that_names_settings_carries_its_terms_to_the_client(engine):
    """The sentence names settings by flag for the CLI; its terms let the app name its controls instead."""
    with engine.client() as c, pytest.raises(EngineError) as refused:
        c.request("plan", model=TINY, workload={"task": "infer", "method": "qlora"})
    e = refused.value
    assert str(e) == "--method qlora is a way to train; for quantized inference use --quant int8 or --quant 4bit"
    assert e.reason == "method_is_for_training" and e.fields["terms"]["refs"]["method"] == {
        "setting": "method", "value": "qlora"}
    assert error_text(e) == ("Method “QLoRA (4-bit base)” is a way to train; for quantized inference use "
                             "Weights “8-bit (LLM.int8)” or Weights “4-bit (NF4)”")  # fmt: skip


# -- the GUI's fix, through a real engine -------------------------------------------------------------------------


def test_the_planner_pages_fix_comes_from_the_engines_fields(qtbot, engine, monkeypatch):
    link = EngineLink()
    page = PlannerPage(link)
    qtbot.addWidget(page)
    link.start()
    try:
        qtbot.waitUntil(lambda: link.state == CONNECTED, timeout=20000)
        page.seq_len.setValue(2048)
        page.picker.set_model(TINY, chosen=False)
        with qtbot.waitSignal(page.sig_plan_failed, timeout=30000):
            page.plan_button.click()
        assert page.fix_button.isVisibleTo(page) and page.fix_button.text() == "Use 256 tokens (the model's context)"
        with qtbot.waitSignal(page.sig_plan_ready, timeout=30000):
            page.fix_button.click()
        assert page.seq_len.value() == 256 and page.plan is not None and page.plan["workload"]["seq_len"] == 256
    finally:
        link.stop()


# -- the reply, unit by unit --------------------------------------------------------------------------------------


def test_a_refusals_class_reason_and_fields_on_the_wire():
    e = UserError("too long", reason="seq_too_long", setting="train.seq_len", value=9, limit=4)
    err = protocol.refusal_reply(7, e)["error"]
    assert err == {"code": "user_error", "message": "too long", "reason": "seq_too_long",
                   "fields": {"setting": "train.seq_len", "value": 9, "limit": 4}}  # fmt: skip
    full = protocol.refusal_reply(1, DiskFull("/x", free=10, needed=20))["error"]
    assert (full["code"], full["reason"], full["folder"], full["fields"]["needed_bytes"]) == ("disk_full", "disk_full", "/x", 20)
    bad = protocol.refusal_reply(1, PathRefused("no such file", path="/a", problem="missing"))["error"]
    assert (bad["code"], bad["path"], bad["fields"]) == ("bad_path", "/a", {"path": "/a", "problem": "missing"})
    # A field JSON cannot carry goes as its text: the reply is still sent.
    odd = protocol.refusal_reply(1, UserError("x", reason="r", where=engine_home, ratio=float("nan")))
    assert protocol.encode(odd) and isinstance(odd["error"]["fields"]["where"], str)


def test_an_older_engines_error_still_gives_the_client_its_fields():
    old = EngineError.of_reply({"code": "bad_path", "message": "gone", "path": "/a", "problem": "missing"})
    assert (old.code, old.reason, old.fields) == ("bad_path", "bad_path", {"path": "/a", "problem": "missing"})
    assert str(old) == "gone" and EngineError.of_reply("not an object").code == protocol.INTERNAL  # type: ignore[arg-type]


def test_a_ranks_refusal_records_its_reason_and_fields(tmp_path, monkeypatch):
    """A worker's refusal reaches the job's error record (engine.jobs.runs takes the rank's record as
    the job's `error`) with its reason and fields, as the engine's own refusals reach clients."""
    import json

    from rigpilot.engine.jobspec.spec import JobSpec
    from rigpilot.engine.workers import __main__ as worker

    JobSpec(id="j1", kind="train").write(tmp_path)
    refusal = UserError("sequence too long", reason="seq_too_long", setting="train.seq_len", value=300, limit=256,
                        path=tmp_path, rank=7)  # fmt: skip  (a Path goes as text; `rank` is the record's own)

    def refuse(spec, job_dir):
        raise refusal

    monkeypatch.setattr(worker, "run", refuse)
    monkeypatch.delenv(worker.METRICS_DIR_ENV, raising=False)
    assert worker.main([str(tmp_path)]) == worker.EXIT_USER_ERROR
    [record] = [json.loads(line) for f in (tmp_path / "metrics").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert record["error"] == "user_error" and record["reason"] == "seq_too_long"
    assert (record["setting"], record["value"], record["limit"], record["path"]) == ("train.seq_len", 300, 256, str(tmp_path))
    assert record["rank"] != 7
