"""A "serve" job through the submission path, and `rigpilot serve`'s refusals of what comes in later versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigpilot.engine.cli.entry import main
from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
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


class Jobs:
    """Answers the `job` request as the engine does, for a fixed set of jobs."""

    def __init__(self, *jobs: dict) -> None:
        self.jobs = {j["id"]: j for j in jobs}

    def request(self, rtype: str, **args):
        from rigpilot.engine.api.client import EngineError

        assert rtype == "job"
        if args["job"] not in self.jobs:
            raise EngineError("not_found", f"no job {args['job']!r}")
        return {"job": self.jobs[args["job"]]}


def trained(tmp_path: Path, job_id: str, state: str = "completed", *files: str) -> dict:
    out = tmp_path / job_id / "output"
    for f in files:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        (out / f).write_text("{}")
    return {"id": job_id, "kind": "train", "state": state, "name": f"run-{job_id}", "job_dir": str(tmp_path / job_id)}


def test_a_training_job_is_served_from_its_model_folder_under_its_name(tmp_path):
    from rigpilot.engine.cli.serve import _what_to_serve

    full = trained(tmp_path, "aaaaaa", "completed", "config.json")
    lora = trained(tmp_path, "bbbbbb", "completed", "adapter_config.json", "merged/config.json")
    (tmp_path / "bbbbbb" / "job.json").write_text('{"model": "/models/base"}')
    client = Jobs(full, lora)
    assert _what_to_serve(client, "aaaaaa") == (str(tmp_path / "aaaaaa" / "output"), "run-aaaaaa", {})
    # A LoRA job: its base, with its adapter unmerged under the job's name.
    out = str(tmp_path / "bbbbbb" / "output")
    assert _what_to_serve(client, "bbbbbb") == ("/models/base", "run-bbbbbb", {"run-bbbbbb": out})
    assert _what_to_serve(client, "Qwen/Qwen2.5-0.5B") == ("Qwen/Qwen2.5-0.5B", "", {})  # no such job: a model


def test_a_finished_lora_job_is_an_adapter_folder_and_a_full_one_is_not(tmp_path):
    from rigpilot.engine.cli.serve import _adapter_folder

    client = Jobs(trained(tmp_path, "aaaaaa", "completed", "config.json"),
                  trained(tmp_path, "bbbbbb", "completed", "adapter_config.json"))  # fmt: skip
    assert _adapter_folder(client, "x", "bbbbbb") == str(tmp_path / "bbbbbb" / "output")
    for ref in ("aaaaaa", "nosuchjob"):
        with pytest.raises(UserError) as e:
            _adapter_folder(client, "x", ref)
        assert e.value.reason == "serve_adapter_invalid"


@pytest.mark.parametrize(
    ("state", "files", "reason"),
    [("running", (), "serve_job_not_finished"), ("completed", ("weights.bin",), "serve_job_not_trained")],
)
def test_a_training_job_without_a_model_to_serve_is_refused_with_its_reason(tmp_path, state, files, reason):
    from rigpilot.engine.cli.serve import _what_to_serve

    with pytest.raises(UserError) as e:
        _what_to_serve(Jobs(trained(tmp_path, "cccccc", state, *files)), "cccccc")
    assert e.value.reason == reason and e.value.fields["job"] == "cccccc"
