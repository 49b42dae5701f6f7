"""`rigpilot serve` through a real engine service: the job is submitted, reports its URL, answers the openai
client, and `rigpilot cancel` ends it as cancelled. Served beyond loopback with an adapter, so the engine's own
certificate, the printed API key and the adapter's name all go the whole way (loopback alone is the workers'
test's)."""

from __future__ import annotations

import re
import threading

import openai
import pytest

from rigpilot.app.serving.stream import REFUSED, UNTRUSTED, Access, ChatError, stream_chat
from rigpilot.engine.cli.entry import main as cli_main
from rigpilot.engine.workers.serve_setup import serving_status

from support.engine import Engine, engine_home, leftover_job_processes, wait_job_state
from support.waiting import wait_for
from support.worker_jobs import save_random_llama

LINE = re.compile(r"^serving (\S+) at https://\S+:(\d+)/v1 \(job (\w+); stop with: rigpilot cancel \3\)$")
KEY = re.compile(r"^API key \(send it as Authorization: Bearer KEY; it is also in (\S+)\): (rp-\S+)$")


@pytest.fixture
def engine(tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    e = Engine(tmp_path)
    e.start()
    try:
        yield e
    finally:
        e.stop()
        for p in leftover_job_processes(tmp_path):
            p.kill()


def test_serve_prints_the_url_serves_and_cancel_ends_it(engine, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = save_random_llama(tmp_path / "tiny", initializer_range=0.2)
    base = AutoModelForCausalLM.from_pretrained(model)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "lora")
    argv = ["serve", str(model), "--precision", "fp32", "--name", "my-tiny", "--listen", "0.0.0.0",
            "--adapter", f"tuned={tmp_path / 'lora'}"]  # fmt: skip
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    match = next(m for m in map(LINE.match, lines) if m)
    name, port, job_id = match.groups()
    key_file, key = next(m for m in map(KEY.match, lines) if m).groups()
    assert name == "my-tiny" and "  adapter tuned: give its name as the model" in lines
    assert key_file.startswith(str(tmp_path)) and key_file.endswith("/api-key")
    client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120,
                           http_client=openai.DefaultHttpxClient(verify=False))  # fmt: skip
    assert [m.id for m in client.models.list().data] == ["my-tiny", "tuned"]
    r = client.completions.create(model="tuned", prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    fingerprint = next(line for line in lines if line.startswith("TLS certificate:")).split()[-3]
    assert fingerprint.startswith("SHA256:")

    # The app's chat: the job's key, and the engine's certificate pinned by the fingerprint the job reported.
    with engine.client() as c:
        serving = serving_status(c.request("metrics", job=job_id)["records"])
    assert serving["tls_fingerprint"] == fingerprint and serving["api_key_file"] == key_file
    url, ask = f"https://127.0.0.1:{port}/v1", [{"role": "user", "content": "Hi"}]
    reply = stream_chat(url, "tuned", ask, lambda text: None, max_tokens=3, temperature=0, access=Access(key, fingerprint))
    assert reply.completion_tokens == 3
    for access, reason in ((Access(key, "SHA256:" + "A" * 43), UNTRUSTED), (Access(key, None), UNTRUSTED),
                           (Access(None, fingerprint), REFUSED)):  # fmt: skip
        with pytest.raises(ChatError) as e:
            stream_chat(url, "tuned", ask, lambda text: None, max_tokens=3, access=access)
        assert e.value.reason == reason, e.value.detail

    with engine.client() as c:
        assert c.request("job", job=job_id)["job"]["state"] == "running"
        assert cli_main(["cancel", job_id]) == 0
        job = wait_job_state(c, job_id, "cancelled", "completed", "failed", timeout=90)
    assert job["state"] == "cancelled", job.get("exit_reason")


def test_serving_a_job_that_is_not_training_is_refused_in_one_line(engine, capsys):
    with engine.client() as c:
        script = engine.script("noop.py", "print('hi')\n")
        job = engine.submit(c, script, gpus=[0])
        wait_job_state(c, job["id"], "completed", timeout=90)
    assert cli_main(["serve", job["id"]]) == 2
    err = capsys.readouterr().err.strip()
    assert "only a training job has a model to serve" in err and "\n" not in err


def test_serve_split_by_tensor_parallelism_through_the_engine_ends_cancelled(engine, tmp_path, capsys):
    """Queued first behind a job on GPU 1: `rigpilot serve` says so while it waits, then serves."""
    model = save_random_llama(tmp_path / "tiny", initializer_range=0.2)
    with engine.client() as c:
        holder = engine.submit(c, engine.script("hold.py", "import time\ntime.sleep(600)\n"), gpus=[1])["id"]
        wait_job_state(c, holder, "running")
    served: list[int] = []
    argv = ["serve", str(model), "--precision", "fp32", "--name", "split", "--tp", "2"]
    thread = threading.Thread(target=lambda: served.append(cli_main(argv)))
    thread.start()
    wait_for(lambda: "is queued (waiting for GPU 1 to be free)" in capsys.readouterr().out, 60, 0.2, "the queued line")
    assert cli_main(["cancel", holder]) == 0
    thread.join(240)
    assert served == [0]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.match(r"^serving split at (http://127\.0\.0\.1:\d+/v1) \(job (\w+);", line)
    assert match, line
    url, job_id = match.groups()
    client = openai.OpenAI(base_url=url, api_key="unused-on-loopback", max_retries=0, timeout=120)
    r = client.completions.create(model="split", prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    with engine.client() as c:
        assert c.request("job", job=job_id)["job"]["gpus"] == [0, 1]
        assert cli_main(["cancel", job_id]) == 0
        job = wait_job_state(c, job_id, "cancelled", "completed", "failed", timeout=90)
    assert job["state"] == "cancelled", job.get("exit_reason")
