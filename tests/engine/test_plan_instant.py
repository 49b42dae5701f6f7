"""The instant planner: the formula's answer before any trace, traces kept on disk (engine.planner.trace_cache),
and plans the tracer cannot trace answered without starting it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from rigpilot.engine.api import protocol
from rigpilot.engine.cli.entry import main
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner import trace_cache, verify
from rigpilot.engine.planner.plan import LoraSettings, Plan, Workload
from rigpilot.engine.planner.search import SearchOptions, search
from rigpilot.engine.service import planworker
from rigpilot.engine.service.requests import REQUEST_SCHEMAS

from support.tracer import counting_tracer, no_warm_tracer, stand_in_python, stand_in_tracer

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip
PROFILE = "8x-h100-sxm"
pytestmark = pytest.mark.usefixtures(no_warm_tracer.__name__)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    chosen = tmp_path / "cache"
    monkeypatch.setenv(trace_cache.ENV_CACHE, str(chosen))
    monkeypatch.setenv(verify.ENV_SWITCH, "1")
    return chosen / "rigpilot-traces"  # Rigpilot's own folder inside the one chosen


def plans_of(folder: Path, **work: object) -> list[Plan]:
    w = Workload(model=str(folder), task="train", seq_len=64, global_batch=8, **work)  # type: ignore[arg-type]
    result = search(describe_model(str(folder)), load_profile(PROFILE), w, options=SearchOptions(suggest=False))
    return verify.to_trace(result)


# -- the cache -----------------------------------------------------------------------------------------


def test_a_repeated_check_starts_no_tracer_and_gives_the_same_figures(tiny, cache, monkeypatch):
    started = stand_in_tracer(monkeypatch)
    plans = plans_of(tiny)
    first = verify.trace_all(plans)
    assert started and all(a["ok"] and not a.get("cached") for a in first)
    assert len(started) <= min(len(plans), os.cpu_count() or 1)  # one tracer per core at most, not one per plan
    n = len(started)
    again = verify.trace_all(plans_of(tiny))  # a new search: new Plan objects, the same plans
    assert len(started) == n  # no tracer process the second time
    assert [a["peak"] for a in again] == [a["peak"] for a in first] and all(a["cached"] for a in again)
    # The engine's planner, asked again, finds them too: its note says so.
    result = planworker.plan(load_profile(PROFILE), str(tiny), {"seq_len": 64, "global_batch": 8},
                             options={"suggest": False})["result"]  # fmt: skip
    assert len(started) == n
    assert result["trace"]["cached"] == result["trace"]["traced"] == len(plans)
    assert "from the trace cache" in result["best"]["verification"]


def test_what_the_trace_reads_keys_the_cache_and_nothing_else(tiny, cache, tmp_path):
    python = os.path.realpath(os.sys.executable)
    plan = plans_of(tiny)[0]
    key = trace_cache.key(plan, python=python)
    assert key is not None
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "config.json").write_text(json.dumps(TINY_LLAMA))
    same = [
        dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, model=str(moved))),
        dataclasses.replace(plan, parallelism=dataclasses.replace(plan.parallelism, gpu_indices=[7])),
    ]
    for other in same:
        assert trace_cache.key(other, python=python) == key
    changed = [
        dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, seq_len=128)),
        dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, master_weights="bf16")),
        dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, optimizer="adamw8bit")),
        dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, optimizer_in_backward=True)),
        dataclasses.replace(plan, workload=dataclasses.replace(plan.workload, method="lora", lora=LoraSettings())),
        dataclasses.replace(plan, parallelism=dataclasses.replace(plan.parallelism, micro_batch=plan.parallelism.micro_batch + 1)),
        dataclasses.replace(plan, parallelism=dataclasses.replace(
            plan.parallelism, checkpointing="none" if plan.parallelism.checkpointing == "full" else "full")),
    ]
    assert len({trace_cache.key(p, python=python) for p in changed} | {key}) == len(changed) + 1
    (tiny / "config.json").write_text(json.dumps({**TINY_LLAMA, "hidden_size": 128}))
    assert trace_cache.key(plan, python=python) != key  # the config's bytes, not its path
    assert trace_cache.key(plan, python=python, trust_remote_code=True) is None  # its own code may change


@pytest.mark.parametrize("damage", [b"\x00\xffnot json", b"[1, 2]", b'{"key": "another", "answer": {}}',
                                    b'{"key": "K", "answer": {"ok": false, "reason": "x"}}',
                                    b'{"key": "K", "answer": {"ok": true, "peak": "many"}}', b""])  # fmt: skip
def test_a_damaged_entry_is_traced_again_quietly(tiny, cache, monkeypatch, caplog, damage):
    started = stand_in_tracer(monkeypatch)
    plan = plans_of(tiny)[0]
    verify.trace(plan)
    key = trace_cache.key(plan, python=os.sys.executable)
    entry = cache / f"{key}.json"
    assert entry.is_file() and len(started) == 1
    entry.write_bytes(damage.replace(b'"K"', json.dumps(key).encode()))
    with caplog.at_level(logging.DEBUG):
        answer = verify.trace(plan)
    assert answer["ok"] and not answer.get("cached") and len(started) == 2  # traced again
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert json.loads(entry.read_text())["answer"]["peak"] == answer["peak"]  # and kept whole again


def test_a_chosen_folder_keeps_its_mode_and_its_other_files(cache, monkeypatch):
    """RIGPILOT_TRACE_CACHE names a folder that may be shared or hold other things: Rigpilot writes, tightens and
    evicts only inside its own folder there."""
    monkeypatch.setattr(trace_cache, "MAX_ENTRIES", 1)
    chosen = cache.parent
    chosen.mkdir(mode=0o775)
    os.chmod(chosen, 0o775)
    mine = [chosen / f"user{n}.json" for n in range(3)]
    for path in mine:
        path.write_text("{}")
    for n in range(3):
        trace_cache.store(f"{n:064x}", {"ok": True, "peak": n, "method": "m"})
    assert stat.S_IMODE(chosen.stat().st_mode) == 0o775 and all(p.exists() for p in mine)
    assert [p.name for p in cache.iterdir()] == [f"{2:064x}.json"]


def test_the_cache_is_private_and_bounded(tiny, cache, monkeypatch):
    monkeypatch.setattr(trace_cache, "MAX_ENTRIES", 3)
    old = os.umask(0o022)
    try:
        cache.mkdir(parents=True)
        os.chmod(cache, 0o755)  # left open by something else: tightened on the next write
        for n in range(5):
            trace_cache.store(f"{n:064x}", {"ok": True, "peak": n, "method": "m"})
            os.utime(cache / f"{n:064x}.json", (1000 + n, 1000 + n))  # in the order written, whatever the clock
    finally:
        os.umask(old)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    kept = sorted(p.name for p in cache.iterdir())
    assert kept == [f"{n:064x}.json" for n in (2, 3, 4)]  # the oldest went
    assert all(stat.S_IMODE((cache / name).stat().st_mode) == 0o600 for name in kept)
    assert trace_cache.load(f"{4:064x}") == {"ok": True, "peak": 4, "method": "m"}
    assert trace_cache.load(f"{0:064x}") is None
    os.chmod(cache, 0o777)  # anyone could have planted an entry: none is believed until the folder is ours again
    assert trace_cache.load(f"{4:064x}") is None
    trace_cache.store(f"{5:064x}", {"ok": True, "peak": 5, "method": "m"})
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and trace_cache.load(f"{4:064x}") is not None


def test_an_unwritable_cache_only_costs_the_cache(tiny, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(trace_cache.ENV_CACHE, str(blocker))
    started = stand_in_tracer(monkeypatch)
    assert verify.trace(plans_of(tiny)[0])["ok"] and verify.trace(plans_of(tiny)[0])["ok"]
    assert len(started) == 2


# -- plans the tracer cannot trace ------------------------------------------------------------------------


def test_qlora_plans_say_why_without_starting_a_tracer(tiny, cache, monkeypatch):
    started = counting_tracer(monkeypatch)
    plans = plans_of(tiny, method="qlora", lora=LoraSettings())
    answers = verify.trace_all(plans)
    assert plans and not started
    assert all(not a["ok"] and "QLoRA plans are not traced" in a["reason"] for a in answers)
    assert "the formula's figure stands" in answers[0]["reason"]


# -- the answer never waits on the trace -------------------------------------------------------------------


def test_rigpilot_plan_prints_the_formulas_plan_while_the_trace_is_held(tiny, cache, monkeypatch, capsys, tmp_path):
    cue = tmp_path / "go"
    started = stand_in_tracer(monkeypatch, cue)
    outcome: dict[str, int] = {}
    argv = ["plan", "--model", str(tiny), "--simulate", PROFILE, "--seq", "64", "--batch", "8"]
    worker = threading.Thread(target=lambda: outcome.setdefault("rc", main(argv)))
    worker.start()
    shown = ""
    try:
        for _ in range(2000):  # the formula's answer and the check's start appear with the tracer held
            shown += capsys.readouterr().out
            if ("Memory check:" in shown and started) or not worker.is_alive():
                break
            time.sleep(0.01)
        assert "Plans, best first" in shown and "Memory per GPU of the best plan:" in shown
        assert "Memory check:" in shown and "per GPU" not in shown.split("Memory check:")[1]  # no outcome yet
        assert worker.is_alive()  # still waiting on its tracer
    finally:
        cue.touch()
        worker.join(60)
    shown += capsys.readouterr().out
    assert outcome["rc"] == 0
    after = shown.split("Memory check:")[1]
    assert "  best  " in after and "fits (" in after and "note: memory traced for" in after


def test_the_engines_formula_answer_traces_nothing_and_says_how_many_to_trace(tiny, cache, monkeypatch):
    started = stand_in_tracer(monkeypatch)
    result = planworker.plan(load_profile(PROFILE), str(tiny), {"seq_len": 64, "global_batch": 8}, verify=False)
    result = result["result"]
    assert result["best"]["verification"] == "" and all(m["traced"] is None for m in result["best"]["memory"])
    assert result["trace"]["pending"] == min(verify.VERIFY_TOP, 1 + len(result["runners_up"]))
    # A tracer is warmed for what follows (it imports torch meanwhile), and it has been asked nothing.
    assert len(started) == 1 and not list(Path(cache).glob("*.json"))
    # Each plan is then traced on its own request, by that warm tracer; the answer has both figures.
    for plan in [result["best"], *result["runners_up"]][: result["trace"]["pending"]]:
        answer = planworker.plan(load_profile(PROFILE), str(tiny), trace={"plan": plan})["result"]
        assert answer["outcome"]["verified"] and answer["outcome"]["fits"] and not answer["outcome"]["cached"]
        assert answer["plan"]["memory"][0]["traced"] is not None and answer["line"] is None
    assert len(started) == 1
    with pytest.raises(UserError, match="not a Rigpilot plan"):  # one line, as a bad plan file gets
        planworker.plan(load_profile(PROFILE), str(tiny), trace={"plan": {"not": "a plan"}})
    with pytest.raises(protocol.ProtocolError, match=r"plan\.trace"):
        planworker.plan(load_profile(PROFILE), str(tiny), trace={"plan": result["best"], "extra": 1})


def test_the_plan_request_declares_verify_and_trace():
    _, optional = REQUEST_SCHEMAS["plan"]
    request = {"v": 1, "id": 1, "type": "plan", "args": {"model": "llama-2-7b", "verify": False}}
    assert protocol.parse_request(request, REQUEST_SCHEMAS).args["verify"] is False
    request["args"] = {"model": "llama-2-7b", "trace": {"plan": {}}}
    assert protocol.parse_request(request, REQUEST_SCHEMAS).args["trace"] == {"plan": {}}
    assert "verify" in optional and "trace" in optional


def test_the_engine_answers_the_formula_while_a_trace_is_held_and_then_the_trace(engine, monkeypatch, tmp_path, tiny):
    cue = tmp_path / "go"
    monkeypatch.setenv(verify.ENV_SWITCH, "1")
    monkeypatch.setenv(trace_cache.ENV_CACHE, str(tmp_path / "traces"))
    monkeypatch.setenv("RIGPILOT_WORKER_PYTHON", str(stand_in_python(tmp_path, cue)))
    engine.start()
    work = {"seq_len": 64, "global_batch": 8}
    with engine.client() as c:
        formula = c.request("plan", model=str(tiny), workload=work, verify=False)["result"]
    assert formula["trace"]["pending"] >= 1 and all(m["traced"] is None for m in formula["best"]["memory"])
    traced: dict[str, dict] = {}

    def trace() -> None:
        with engine.client() as c:
            traced["reply"] = c.request("plan", model=str(tiny), trace={"plan": formula["best"]})["result"]

    worker = threading.Thread(target=trace)
    worker.start()
    try:
        # While that trace is held, the engine answers another plan's formula on another connection.
        with engine.client() as c:
            again = c.request("plan", model=str(tiny), workload=work, verify=False)["result"]
        assert again["best"]["parallelism"] == formula["best"]["parallelism"]
        assert worker.is_alive() and "reply" not in traced
    finally:
        cue.touch()
        worker.join(60)
    answer = traced["reply"]
    assert answer["outcome"]["verified"] and answer["plan"]["memory"][0]["traced"] is not None
    # An old client's plain request is verified before it is answered, as it always was.
    with engine.client() as c:
        verified = c.request("plan", model=str(tiny), workload=work)["result"]
    assert verified["trace"]["traced"] >= 1 and verified["best"]["memory"][0]["traced"] is not None


@pytest.mark.slow
def test_the_warm_tracer_traces_as_a_one_shot_tracer_does_request_after_request(tiny, monkeypatch):
    monkeypatch.setenv(verify.ENV_SWITCH, "1")
    monkeypatch.setenv(trace_cache.ENV_CACHE, "off")
    started = counting_tracer(monkeypatch)
    plans = plans_of(tiny)
    one_shot = verify.trace_all(plans)
    cold = len(started)
    verify.warm_up()
    first = verify.trace_all(plans[:1], warm=True)
    rest = verify.trace_all(plans[1:], warm=True)  # a second request to the same process
    assert [a["peak"] for a in first + rest] == [a["peak"] for a in one_shot]
    assert len(started) == cold + 1  # the warm tracer, started once
