"""Metric history after a resume: every record carries its run; a step a later run repeated is superseded."""

from __future__ import annotations

import json

from rigpilot.engine.jobs.metrics import mark_superseded, read_records


def test_report_numbers_the_run(tmp_path, monkeypatch):
    import rigpilot.engine.report as report_module

    monkeypatch.setenv("RIGPILOT_METRICS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(report_module, "_file", None)
    for run in ("1", "2"):
        monkeypatch.setenv("RIGPILOT_RUN", run)
        report_module.report(step=3, loss=1.5)
    report_module._file.close()
    monkeypatch.setattr(report_module, "_file", None)
    lines = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [(r["run"], r["step"]) for r in lines] == [(1, 3), (2, 3)]
    assert oct((tmp_path / "rank0.jsonl").stat().st_mode & 0o777) == "0o600"


def test_a_repeated_step_keeps_the_latest_runs_record(tmp_path):
    # A run killed at step 4 after a checkpoint at step 2, then resumed: steps 3 and 4 appear twice per rank.
    lines = {0: [], 1: []}
    t = 100.0
    for run, steps in ((1, range(1, 5)), (2, range(3, 7))):
        for step in steps:
            for rank in (0, 1):
                t += 1
                lines[rank].append({"time": t, "rank": rank, "run": run, "step": step, "loss": 10.0 * run + step})
    lines[0].insert(0, {"time": 50.0, "rank": 0, "kind": "status", "phase": "loading model"})  # no step: kept
    lines[0].append({"time": t + 1, "rank": 0, "step": 6, "kind": "eval", "eval_loss": 1.0})  # another kind: kept
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[0]))
    (tmp_path / "rank1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[1]))
    records, _, _ = read_records(tmp_path, {})
    mark_superseded(records)
    shown = [r for r in records if not r.get("superseded")]
    hidden = [r for r in records if r.get("superseded")]
    assert sorted((r["rank"], r["step"]) for r in hidden) == [(0, 3), (0, 4), (1, 3), (1, 4)]
    assert all(r["run"] == 1 for r in hidden)
    steps = [(r["rank"], r["step"]) for r in shown if r.get("kind") is None]
    assert len(steps) == len(set(steps)) == 12  # no step twice
    assert {r["step"]: r["loss"] for r in shown if r.get("kind") is None and r["rank"] == 0}[3] == 23.0


def test_records_without_a_run_number_keep_the_later_one():
    records = [{"rank": 0, "step": 1, "loss": 2.0}, {"rank": 0, "step": 1, "loss": 1.0}, {"rank": 0, "step": None}]
    mark_superseded(records)
    assert [r.get("superseded", False) for r in records] == [True, False, False]
