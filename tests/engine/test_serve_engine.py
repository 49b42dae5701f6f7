"""`rigpilot serve` through a real engine service: the job is submitted, reports its URL, answers the openai
client, and `rigpilot cancel` ends it as cancelled."""

from __future__ import annotations

import re

import openai
import pytest

from rigpilot.engine.cli.entry import main as cli_main

from support.engine import Engine, engine_home, leftover_job_processes, wait_job_state
from support.worker_jobs import save_random_llama

LINE = re.compile(r"^serving (\S+) at (http://127\.0\.0\.1:\d+/v1) \(job (\w+); stop with: rigpilot cancel \3\)$")


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
    model = save_random_llama(tmp_path / "tiny", initializer_range=0.2)
    assert cli_main(["serve", str(model), "--precision", "fp32", "--name", "my-tiny"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    match = LINE.match(line)
    assert match, line
    name, url, job_id = match.groups()
    assert name == "my-tiny"
    client = openai.OpenAI(base_url=url, api_key="loopback", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["my-tiny"]
    r = client.completions.create(model="my-tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1

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
