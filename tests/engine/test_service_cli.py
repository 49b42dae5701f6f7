"""The job commands against a stand-in engine service: what they send, print and refuse."""

from __future__ import annotations

from typing import Any

import pytest

from rigpilot.engine.api.client import EngineError
from rigpilot.engine.cli.entry import main as cli_main


class FakeEngine:
    """Answers `job` and `delete` the way the service does, for a fixed set of jobs."""

    def __init__(self, jobs: dict[str, dict[str, Any]]):
        self.jobs = jobs
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def client(self, *args: Any, **kwargs: Any) -> FakeEngine:
        return self

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def request(self, rtype: str, **args: Any) -> dict[str, Any]:
        self.requests.append((rtype, args))
        job = self.jobs.get(args["job"])
        if job is None:
            raise EngineError("not_found", f"no job {args['job']!r} (see 'rigpilot jobs')")
        if rtype == "job":
            return {"job": job}
        if rtype == "delete":
            if job["state"] in ("starting", "running"):
                raise EngineError("user_error", f"job {job['id']} is {job['state']}; cancel it before deleting it")
            del self.jobs[job["id"]]
            return {"id": job["id"], "deleted": True}
        raise AssertionError(f"unexpected request {rtype}")


def job(job_id: str, state: str) -> dict[str, Any]:
    return {"id": job_id, "state": state, "kind": "train", "name": "demo", "job_dir": f"/state/jobs/{job_id}"}


@pytest.fixture
def engine(monkeypatch):
    fake = FakeEngine({"a1b2c3": job("a1b2c3", "completed"), "d4e5f6": job("d4e5f6", "running")})
    monkeypatch.setattr("rigpilot.engine.api.client.EngineClient", fake.client)
    return fake


def test_delete_removes_an_ended_job(engine, capsys):
    assert cli_main(["delete", "a1b2c3"]) == 0
    assert capsys.readouterr().out == "job a1b2c3 (train 'demo') deleted with its folder /state/jobs/a1b2c3\n"
    assert engine.requests[-1] == ("delete", {"job": "a1b2c3"}) and "a1b2c3" not in engine.jobs


def test_delete_refuses_a_running_job_in_one_line(engine, capsys):
    assert cli_main(["delete", "d4e5f6"]) == 2
    err = capsys.readouterr().err
    assert err == "rigpilot: error: job d4e5f6 is running; stop it first with 'rigpilot cancel d4e5f6'\n"
    assert [r for r, _ in engine.requests] == ["job"] and "d4e5f6" in engine.jobs
    assert cli_main(["delete", "nosuchjob"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
