"""A "serve" job through the submission path, and `rigpilot serve`'s refusals of what comes in later versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rigpilot.engine.cli.entry import main
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs.serve_source import with_job_folders
from rigpilot.engine.jobs.store import JobRecord
from rigpilot.engine.jobs.submission import describe, prepare

from support.paths import TINY_LLAMA_CONFIG

TINY = str(TINY_LLAMA_CONFIG.parent)


def submit(tmp_path: Path, **spec):
    return prepare({"kind": "serve", "model": TINY, **spec}, None, str(tmp_path), job_id="s1",
                   machine=load_profile("4x-rtx4090"), max_cpu_ranks=2)  # fmt: skip


def test_a_served_model_runs_on_one_rank_of_the_first_gpu_with_its_settings(tmp_path):
    sub = submit(tmp_path, serve={"port": 8123, "max_batch": 4})
    assert (sub.ranks, sub.spec.gpus) == (1, [0])
    assert (sub.spec.serve.port, sub.spec.serve.max_batch, sub.spec.serve.max_concurrent) == (8123, 4, 64)
    assert any(line.startswith("serving: ") and "port 8123" in line for line in describe(sub))


@pytest.mark.parametrize(("spec", "tp", "pp"), [({"parallelism": {"tp": 2}}, 2, 1), ({"gpus": [0, 1]}, 2, 1),
                                                 ({"parallelism": {"pp": 2}}, 1, 2)])  # fmt: skip
def test_a_model_served_on_two_gpus_is_split_by_tensor_parallelism_or_into_stages(tmp_path, spec, tp, pp):
    sub = submit(tmp_path, **spec)
    assert (sub.ranks, sub.spec.gpus, sub.spec.parallelism.tp, sub.spec.parallelism.pp) == (2, [0, 1], tp, pp)


@pytest.mark.parametrize(
    ("spec", "words"),
    [({"parallelism": {"dp_replicate": 2}}, "split one way"), ({"parallelism": {"tp": 2}, "gpus": [0]},
      "needs 2 GPUs, and 1 are given"),
     ({"gpus": [0, 1], "serve": {"adapters": {"a": "/nonexistent"}}}, "adapters are served on one GPU"),
     ({"parallelism": {"tp": 2, "pp": 2}}, "give --tp or --pp, not both")],
)  # fmt: skip
def test_a_layout_serving_cannot_run_yet_is_refused_with_its_reason(tmp_path, spec, words):
    with pytest.raises(UserError) as e:
        submit(tmp_path, **spec)
    assert e.value.reason == "serve_layout_unsupported"
    assert e.value.fields["ranks"] in (2, 4)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_port_out_of_range_names_the_setting(tmp_path):
    with pytest.raises(UserError) as e:
        submit(tmp_path, serve={"port": 70000})
    assert e.value.reason == "out_of_range" and e.value.fields["setting"] == "serve.port"


@pytest.mark.parametrize(
    ("flag", "reason"),
    [(["--adapter", "nofolder"], "serve_adapter_invalid"), (["--listen", "0.0.0.0:8000"], "serve_listen_invalid"),
     (["--listen", "example.com"], "serve_listen_invalid")],
)  # fmt: skip
def test_a_bad_adapter_or_address_is_refused_in_one_line_before_anything_starts(flag, reason, capsys):
    from rigpilot.engine.cli.serve import _adapter_pair
    from rigpilot.engine.workers.serve_setup import parse_listen

    assert main(["serve", TINY, *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rigpilot: error: ") and "\n" not in err and flag[1] in err
    with pytest.raises(UserError) as e:
        (_adapter_pair if flag[0] == "--adapter" else parse_listen)(flag[1])
    assert e.value.reason == reason


def test_listen_addresses_and_the_url_they_give():
    from rigpilot.engine.workers.serve_setup import parse_listen, url_host

    assert parse_listen("localhost") == ("127.0.0.1", True)
    assert parse_listen("[::1]") == ("::1", True)
    assert parse_listen("0.0.0.0") == ("0.0.0.0", False)
    assert parse_listen("192.168.1.5") == ("192.168.1.5", False)
    assert url_host("192.168.1.5") == "192.168.1.5" and url_host("fe80::1") == "[fe80::1]"
    assert url_host("0.0.0.0") not in ("0.0.0.0", "")  # this machine's name: where a client reaches it


def test_a_jobs_api_key_is_private_and_kept_over_a_restart(tmp_path):
    from rigpilot.engine.workers.serve_setup import api_key

    key, path = api_key(tmp_path)
    assert key.startswith("rp-") and len(key) > 40 and path.stat().st_mode & 0o777 == 0o600
    assert api_key(tmp_path) == (key, path)


def test_loopback_needs_no_certificate_and_a_submitter_cannot_name_one(tmp_path):
    sub = submit(tmp_path, serve={"listen": "localhost", "tls_cert": "/etc/x.pem", "tls_key": "/etc/x.key"})
    assert (sub.spec.serve.listen, sub.spec.serve.tls_cert, sub.spec.serve.tls_key) == ("127.0.0.1", "", "")


def test_listening_beyond_loopback_serves_with_the_engines_certificate(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    sub = submit(tmp_path, serve={"listen": "0.0.0.0"})
    assert Path(sub.spec.serve.tls_cert).is_file() and Path(sub.spec.serve.tls_key).is_file()
    assert any(line.startswith("access: TLS") for line in describe(sub))


def test_an_adapter_folder_is_resolved_and_checked(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    (good / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (bad / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    sub = submit(tmp_path, name="m", serve={"adapters": {"a": str(good)}})
    assert sub.spec.serve.adapters == {"a": str(good)}
    for adapters in ({"a": str(bad)}, {"a": str(tmp_path)}, {"m": str(good)}):
        with pytest.raises(UserError) as e:
            submit(tmp_path, name="m", serve={"adapters": adapters})
        assert e.value.reason == "serve_adapter_invalid" and "\n" not in str(e.value)


def trained(tmp_path: Path, job_id: str, state: str = "completed", *files: str, kind: str = "train") -> JobRecord:
    out = tmp_path / "jobs" / job_id / "output"
    for f in files:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        (out / f).write_text("{}")
    return JobRecord(id=job_id, seq=1, kind=kind, name=f"run-{job_id}", state=state, gpus=[0], ranks=1,
                     simulated=True, created=0.0)  # fmt: skip


def served(tmp_path: Path, data: dict, *jobs: JobRecord) -> dict:
    """The submission as the engine sees it once the jobs it names are put in (engine.jobs.serve_source)."""
    by_id = {j.id: j for j in jobs}

    def find(ref: str) -> list[JobRecord]:
        return [by_id[ref]] if ref in by_id else [j for j in jobs if j.name == ref]

    work = tmp_path / "work"  # the client's folder
    work.mkdir(exist_ok=True)
    return with_job_folders({"kind": "serve", **data}, work, find, lambda job_id: tmp_path / "jobs" / job_id)


def test_a_training_job_is_served_from_its_model_folder_under_its_name(tmp_path):
    full = trained(tmp_path, "aaaaaa", "completed", "config.json")
    lora = trained(tmp_path, "bbbbbb", "completed", "adapter_config.json", "merged/config.json")
    (tmp_path / "jobs" / "bbbbbb" / "job.json").write_text('{"model": "/models/base"}')
    got = served(tmp_path, {"model": "aaaaaa"}, full, lora)
    assert (got["model"], got["name"], got["serve"]) == (str(tmp_path / "jobs" / "aaaaaa" / "output"), "run-aaaaaa",
                                                          {"source_job": "aaaaaa"})  # fmt: skip
    # A LoRA job: its base, with its adapter unmerged under the job's name (by name here), the base as "base".
    out = str(tmp_path / "jobs" / "bbbbbb" / "output")
    got = served(tmp_path, {"model": "run-bbbbbb"}, full, lora)
    assert (got["model"], got["name"], got["serve"]) == ("/models/base", "run-bbbbbb", {
        "base_name": "base", "adapters": {"run-bbbbbb": out}, "source_job": "bbbbbb"})  # fmt: skip
    got = served(tmp_path, {"model": "bbbbbb", "name": "mine"}, full, lora)
    assert got["serve"]["adapters"] == {"mine": out}
    assert served(tmp_path, {"model": "Qwen/Qwen2.5-0.5B"}, full)["model"] == "Qwen/Qwen2.5-0.5B"  # no job: a model
    (tmp_path / "work" / "aaaaaa").mkdir()
    assert served(tmp_path, {"model": "aaaaaa"}, full)["model"] == "aaaaaa"  # a folder stays a folder


def test_a_finished_lora_job_is_an_adapter_folder_and_a_full_one_is_not(tmp_path):
    full = trained(tmp_path, "aaaaaa", "completed", "config.json")
    lora = trained(tmp_path, "bbbbbb", "completed", "adapter_config.json")
    got = served(tmp_path, {"model": "m", "serve": {"adapters": {"x": "bbbbbb"}}}, full, lora)
    assert got["serve"]["adapters"] == {"x": str(tmp_path / "jobs" / "bbbbbb" / "output")}
    for ref in ("aaaaaa", "nosuchjob"):
        with pytest.raises(UserError) as e:
            served(tmp_path, {"model": "m", "serve": {"adapters": {"x": ref}}}, full, lora)
        assert e.value.reason == "serve_adapter_invalid"


@pytest.mark.parametrize(
    ("state", "files", "kind", "reason"),
    [("running", (), "train", "serve_job_not_finished"), ("completed", ("weights.bin",), "train", "serve_job_not_trained"),
     ("completed", (), "infer", "serve_job_not_trained")],
)  # fmt: skip
def test_a_training_job_without_a_model_to_serve_is_refused_with_its_reason(tmp_path, state, files, kind, reason):
    with pytest.raises(UserError) as e:
        served(tmp_path, {"model": "cccccc"}, trained(tmp_path, "cccccc", state, *files, kind=kind))
    assert e.value.reason == reason and e.value.fields["job"] == "cccccc"


def test_a_name_two_jobs_share_is_refused_as_ambiguous(tmp_path):
    a, b = trained(tmp_path, "aaaaaa", "completed", "config.json"), trained(tmp_path, "bbbbbb", "completed")
    b.name = a.name
    with pytest.raises(UserError) as e:
        served(tmp_path, {"model": a.name}, a, b)
    assert e.value.reason == "job_ambiguous" and e.value.fields["jobs"] == ["aaaaaa", "bbbbbb"]


def test_the_engine_serves_a_finished_lora_job_named_by_its_id_as_its_base_with_the_adapter(tmp_path, monkeypatch):
    """What `rigpilot serve JOB` and the app's "Serve this model" send, through the supervisor's own check."""
    from rigpilot.engine.jobs.store import JobStore
    from rigpilot.engine.jobs.supervisor import Supervisor

    from support.engine import engine_home

    engine_home(tmp_path, monkeypatch)
    store = JobStore(tmp_path / "engine.db")
    sup = Supervisor(store, tmp_path / "jobs", load_profile("4x-rtx4090"))
    job = trained(tmp_path, "abc123", "completed")
    job.name = "my-lora"
    store.insert(job)
    out = tmp_path / "jobs" / "abc123" / "output"
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": TINY}))
    checked = sup.check({"kind": "serve", "model": "abc123"}, None, str(tmp_path))
    assert any(line == "LoRA adapters, unmerged, by name: my-lora" for line in checked["lines"]), checked["lines"]
    with pytest.raises(UserError) as e:
        sup.check({"kind": "serve", "model": "m", "serve": {"adapters": {"x": "nosuchjob"}}}, None, str(tmp_path))
    assert e.value.reason == "serve_adapter_invalid"
