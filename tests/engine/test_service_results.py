"""What a job produced (`results`, the `job` answer's `settings` and `output`) and `rename`, in the engine.

The readers are tested on files written here (good, hostile, missing); the
socket requests on a real service with a real job, as tests/engine/test_service_engine.py does.
"""

import json
import os
from pathlib import Path

import pytest

from rigpilot.engine.api import protocol
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.errors import UserError
from rigpilot.engine.jobs.results import MAX_TEXT, check_name, describe_output, job_settings, read_results

from support.engine import QUICK_SCRIPT
from support.paths import SHAKESPEARE
from support.paths import TINY_LLAMA_CONFIG as TINY_LLAMA


def write_results(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_completions_are_read_as_json_in_pages_without_their_token_ids(tmp_path):
    path = write_results(
        tmp_path / "results.jsonl",
        [{"prompt": f"p{i}", "completion": f"c{i}", "tokens": [1, 2, 3][: i % 3 + 1]} for i in range(5)],
    )
    first = read_results(path, limit=2)
    assert [r["prompt"] for r in first["results"]] == ["p0", "p1"] and first["more"]
    assert [r["new_tokens"] for r in first["results"]] == [1, 2]
    assert all("tokens" not in r for r in first["results"])
    rest = read_results(path, start=2)
    assert [(r["index"], r["completion"]) for r in rest["results"]] == [(2, "c2"), (3, "c3"), (4, "c4")]
    assert not rest["more"]
    # A byte budget stops the page early, but never before one completion.
    assert len(read_results(path, max_bytes=1)["results"]) == 1
    assert {r["stop_reason"] for r in first["results"] + rest["results"]} == {None}  # files from before it
    stopped = write_results(tmp_path / "stopped.jsonl", [
        {"prompt": "a", "completion": "b", "tokens": [5, 1], "stop_reason": "end_of_sequence"},
        {"prompt": "a", "completion": "b", "tokens": [5, 5], "stop_reason": "max_tokens"},
        {"prompt": "a", "completion": "b", "tokens": [5], "stop_reason": "\x1b[2J made up"},
    ])  # fmt: skip
    assert [r["stop_reason"] for r in read_results(stopped)["results"]] == ["end_of_sequence", "max_tokens", None]


def test_long_text_is_cut_and_marked(tmp_path):
    path = write_results(tmp_path / "r.jsonl", [{"prompt": "x", "completion": "y" * (MAX_TEXT + 10)}])
    (r,) = read_results(path)["results"]
    assert len(r["completion"]) == MAX_TEXT and r["cut"] and r["new_tokens"] is None


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        (["{not json"], "line 1 is not valid JSON"),
        ([{"prompt": "a", "completion": "b"}, [1, 2]], "line 2 is not a completion record"),
        ([{"prompt": "a", "completion": 3}], "line 1 is not a completion record"),
        (['"\\ud800"'], "line 1 is not a completion record"),
    ],
)
def test_a_bad_line_is_named_in_one_line(tmp_path, lines, words):
    path = write_results(tmp_path / "r.jsonl", lines)
    with pytest.raises(UserError, match=words) as e:
        read_results(path)
    assert "\n" not in str(e.value)


def test_missing_or_odd_files_are_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="no completions yet"):
        read_results(tmp_path / "absent.jsonl")
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    link = tmp_path / "results.jsonl"
    link.symlink_to(secret)
    with pytest.raises(UserError, match="not a regular file"):
        read_results(link)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UserError, match="not a regular file"):  # would block a reader forever
        read_results(tmp_path / "fifo")


def test_output_folder_and_settings_are_described(tmp_path):
    out = tmp_path / "output"
    assert describe_output(tmp_path)["model"] is None  # no folder yet
    (out / "merged").mkdir(parents=True)
    (out / "adapter_config.json").write_text("{}")
    (out / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "r": 8}))
    (out / "merged" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    d = describe_output(tmp_path)
    assert d["model"] == "lora" and d["merged"] == str(out / "merged") and not d["results"]
    assert d["base_model"] == "org/base" and d["architectures"] == ["LlamaForCausalLM"]
    (out / "adapter_config.json").unlink()
    (out / "config.json").write_text("[not a dict]")
    d = describe_output(tmp_path)
    assert d["model"] == "full" and d["architectures"] == [] and d["base_model"] is None
    assert job_settings(tmp_path) is None
    (tmp_path / "job.json").write_text(json.dumps({"kind": "train", "env": {"HF_TOKEN": "***"}, "model": "m"}))
    assert job_settings(tmp_path) == {"kind": "train", "model": "m"}


@pytest.mark.parametrize(
    ("name", "words"), [("  ", "cannot be empty"), ("a\nb", "one line"), ("x" * 101, "at most 100")]
)
def test_bad_names_are_refused(name, words):
    with pytest.raises(UserError, match=words):
        check_name(name)
    assert check_name("  run 1 ") == "run 1"


@pytest.mark.slow
def test_rename_and_results_requests_on_a_real_service(engine, capsys):
    engine.start()
    script = engine.script("quick.py", QUICK_SCRIPT)
    with engine.client() as c:
        first = engine.submit(c, script, gpus=[0], name="one")
        job = engine.submit(c, script, gpus=[1], name="two")
        done = engine.wait_state(c, job["id"], "completed", "failed")
        assert done["state"] == "completed"
        assert done["settings"]["script"][0] == script and "env" not in done["settings"]
        assert done["output"]["folder"] == str(Path(done["job_dir"]) / "output") and done["output"]["model"] is None

        c.request("subscribe", topics=["jobs"])
        renamed = c.request("rename", job=job["id"], name="  baseline lr 2e-4 ")["job"]
        assert renamed["name"] == "baseline lr 2e-4"
        event = None
        while event is None or event["event"] != "job" or event["job"]["id"] != job["id"]:
            event = c.next_event(5.0)
            assert event is not None, "no job event after the rename"
        assert event["job"]["name"] == "baseline lr 2e-4"
        assert c.request("job", job="baseline lr 2e-4")["job"]["id"] == job["id"]  # the new name finds it

        for args, code, words in [
            ({"job": job["id"], "name": ""}, protocol.USER_ERROR, "cannot be empty"),
            ({"job": job["id"], "name": first["id"]}, protocol.USER_ERROR, "the id of another job"),
            ({"job": "zzzzzz", "name": "x"}, protocol.NOT_FOUND, "no job"),
            ({"job": job["id"]}, protocol.INVALID, "name"),
        ]:
            with pytest.raises(EngineError) as e:
                c.request("rename", **args)
            assert e.value.code == code and words in str(e.value), (args, e.value)
        for args, code, words in [
            ({"job": job["id"]}, protocol.USER_ERROR, "only inference jobs write completions"),
            ({"job": "zzzzzz"}, protocol.NOT_FOUND, "no job"),
            ({"job": job["id"], "limit": 0}, protocol.INVALID, "limit"),
            ({"job": job["id"], "start": -1}, protocol.INVALID, "start"),
        ]:
            with pytest.raises(EngineError) as e:
                c.request("results", **args)
            assert e.value.code == code and words in str(e.value), (args, e.value)
        assert c.request("job", job=job["id"])["job"]["name"] == "baseline lr 2e-4"

    # The name persists: a restarted engine and the CLI show it.
    engine.stop()
    engine.start()
    capsys.readouterr()
    assert cli_main(["jobs"]) == 0
    assert "baseline lr 2e-4" in capsys.readouterr().out
    assert cli_main(["rename", job["id"], "final"]) == 0
    assert "now named 'final'" in capsys.readouterr().out
    assert cli_main(["results", job["id"]]) == 2
    assert "only inference jobs" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not TINY_LLAMA.exists(), reason="the tiny example model is not in this checkout")
def test_an_inference_jobs_completions_come_back_through_results(engine, capsys):
    engine.start()
    env = {"HF_HUB_OFFLINE": "1"}
    train = {
        "kind": "train", "model": str(TINY_LLAMA), "gpus": [0], "env": env,
        "train": {"dataset": [str(SHAKESPEARE)], "method": "scratch", "max_steps": 2, "seq_len": 32,
                  "micro_batch": 1, "eval_every": 0, "checkpoint_every": 0, "warmup_steps": 0, "precision": "fp32"},
    }  # fmt: skip
    with engine.client() as c:
        trained = c.request("submit", spec=train)["job"]
        trained = engine.wait_state(c, trained["id"], "completed", "failed", timeout=300)
        assert trained["state"] == "completed", trained["last_log"]
        output = c.request("job", job=trained["id"])["job"]["output"]
        assert output["model"] == "full"
        infer = {
            "kind": "infer",
            "model": output["folder"],
            "gpus": [0],
            "env": env,
            "infer": {"prompts": ["To be", "or not"], "max_new_tokens": 4, "precision": "fp32"},
        }
        job = c.request("submit", spec=infer)["job"]
        done = engine.wait_state(c, job["id"], "completed", "failed", timeout=300)
        assert done["state"] == "completed", done["last_log"]
        reply = c.request("results", job=job["id"])
        assert [r["prompt"] for r in reply["results"]] == ["To be", "or not"] and not reply["more"]
        assert all(isinstance(r["completion"], str) and r["new_tokens"] for r in reply["results"])
    assert cli_main(["results", job["id"], "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["schema"] == "rigpilot.results/1" and len(printed["results"]) == 2
