"""A job's end reaches the user's webhook and command (engine.jobs.notify): a real Supervisor runs two tiny
script jobs, one that exits 0 and one that exits 1, and a local HTTP receiver and a command that keeps its stdin
get both events; bad notify settings are one line each."""

from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs.notify import Notifier, event_of, payload_of, shown_url
from rigpilot.engine.jobs.store import TERMINAL_STATES, JobStore
from rigpilot.engine.jobs.supervisor import Supervisor
from rigpilot.engine.settings import Settings

from support.engine import engine_home
from support.waiting import wait_for

KEEP_STDIN = "import os, sys\nopen(sys.argv[1], 'a').write(os.environ['RIGPILOT_NOTIFY_EVENT'] + ' ' + sys.stdin.read() + '\\n')\n"


class _Receiver(BaseHTTPRequestHandler):
    got: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append({"path": self.path, "type": self.headers["Content-Type"], **json.loads(body)})
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver():
    _Receiver.got = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, _Receiver.got
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_a_completed_and_a_failed_job_reach_the_webhook_and_the_command(tmp_path, monkeypatch, receiver, caplog):
    engine_home(tmp_path, monkeypatch)
    for proxy in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    server, got = receiver
    kept, hook = tmp_path / "kept.txt", tmp_path / "hook.py"
    hook.write_text(KEEP_STDIN)
    Settings(
        notify_webhook=f"http://127.0.0.1:{server.server_port}/hook?token=s3cret",
        notify_command=[sys.executable, str(hook), str(kept)],
    ).save()
    ok, bad = tmp_path / "ok.py", tmp_path / "bad.py"
    ok.write_text("print('fine')\n")
    bad.write_text("import sys\nsys.exit(1)\n")
    notifier = Notifier()
    store = JobStore(tmp_path / "engine.db")
    sup = Supervisor(store, tmp_path / "jobs", load_profile("4x-rtx4090"), on_job=notifier.observe)
    sup.start()
    try:
        jobs = [
            sup.submit({"kind": "script", "script": [str(s)], "gpus": [g], "name": n}, None, str(tmp_path))
            for s, g, n in ((ok, 0, "fine-run"), (bad, 1, "broken-run"))
        ]
        for job in jobs:
            wait_for(lambda j=job: store.get(j["id"]).state in TERMINAL_STATES, 240, 0.2, f"job {job['id']} to end")
    finally:
        sup.stop()
    assert notifier.wait_idle(20)
    by_job = {g["job"]: g for g in got}
    done, failed = by_job[jobs[0]["id"]], by_job[jobs[1]["id"]]
    assert len(got) == 2 and {g["path"] for g in got} == {"/hook?token=s3cret"}
    assert done["type"] == "application/json"
    assert (done["event"], done["state"], done["name"], done["kind"]) == (
        "completed",
        "completed",
        "fine-run",
        "script",
    )
    assert done["message"] == f"Job fine-run ({jobs[0]['id']}) completed."
    assert (failed["event"], failed["state"]) == ("failed", "failed") and failed["exit_reason"]
    assert failed["message"].startswith(f"Job broken-run ({jobs[1]['id']}) failed: ")
    lines = sorted(kept.read_text().splitlines())
    assert [ln.split(" ", 1)[0] for ln in lines] == ["completed", "failed"]
    assert json.loads(lines[0].split(" ", 1)[1]) == {k: v for k, v in done.items() if k not in ("path", "type")}

    # A receiver gone: one log line for the target, its URL without path or token, nothing raised.
    server.shutdown()
    server.server_close()
    caplog.set_level(logging.WARNING, "rigpilot.engine.jobs.notify")
    for run in (2, 3):
        notifier.observe({**jobs[0], "run": run, "state": "running"})
        notifier.observe({**jobs[0], "run": run, "state": "completed"})
    assert notifier.wait_idle(20)
    said = [r.getMessage() for r in caplog.records if "webhook" in r.getMessage()]
    assert len(said) == 1 and f"http://127.0.0.1:{server.server_port}/…" in said[0] and "s3cret" not in said[0]


def test_events_are_decided_from_what_the_engine_last_announced():
    job = {"id": "ab12cd", "name": "n", "kind": "train", "run": 1, "state": "running", "restarts": []}
    assert event_of({**job, "state": "completed"}, None) is None  # not seen running since the engine started
    assert event_of({**job, "state": "completed"}, (1, "running")) == "completed"
    assert event_of({**job, "state": "completed"}, (1, "completed")) is None  # a rename of an ended job
    assert event_of({**job, "state": "failed"}, (1, "running")) == "failed"
    assert event_of({**job, "state": "cancelled"}, (1, "running")) is None  # the user cancelled it: knows already
    restarted = {**job, "run": 2, "state": "queued", "restarts": [{"run": 1, "cause": "rank 1 died"}]}
    assert event_of(restarted, (1, "running")) == "restarted"
    assert (
        payload_of("restarted", restarted)["message"]
        == "Job n (ab12cd) failed and restarts by itself as run 2: rank 1 died"
    )
    assert event_of({**restarted, "run": 3}, (2, "failed")) is None  # the user resumed run 2: no restart of it
    assert shown_url("https://user:pw@hooks.example.com:8443/t/SECRET?k=v") == "https://hooks.example.com:8443/…"


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        (
            {"notify_webhook": "ftp://x/y?token=abc"},
            "notify_webhook ignored: it must be an http:// or https:// URL, not ftp:",
        ),
        ({"notify_webhook": "hooks.example.com/abc"}, "notify_webhook ignored: it must be an http:// or https:// URL"),
        ({"notify_webhook": "https:///abc"}, "notify_webhook ignored: the URL names no host"),
        ({"notify_command": "  "}, "notify_command ignored: the command is empty"),
        ({"notify_command": []}, "notify_command ignored: the command is empty"),
        (
            {"notify_command": "say 'hi"},
            "notify_command ignored: the command cannot be split into words (No closing quotation)",
        ),
        ({"notify_command": 3}, "notify_command ignored: it must be a command line or a list of its words"),
    ],
)
def test_bad_notify_settings_are_one_line_each(tmp_path, monkeypatch, raw, line):
    engine_home(tmp_path, monkeypatch)
    Settings.path().parent.mkdir(parents=True)
    Settings.path().write_text(json.dumps(raw))
    settings = Settings.load()
    assert settings.warnings == [line]
    assert settings.notify_webhook is None and settings.notify_command is None
