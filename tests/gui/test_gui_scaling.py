"""'How does this scale?' on a finished training job: the study starts, shows which point runs, then its table
and chart (measured, linear, predicted), and exports PNG and CSV. The engine is a FakeLink whose studies are
filled in by the engine's own code (scaling.summarize), so the numbers are the ones `rigpilot scaling` prints."""

from __future__ import annotations

import copy
import csv
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QImage

from rigpilot.app.jobs.detail import SUMMARY_TAB
from rigpilot.engine.jobs import scaling, scaling_table

from support.gui_fakes import FakeLink
from support.gui_jobs import FakeJobs, a_training_job, open_job, open_page, step_record


def a_study(states: tuple[str, str], measured: tuple[float | None, float | None]) -> dict[str, Any]:
    points = []
    for n, state, tps, pred in zip((1, 2), states, measured, (1_500_000.0, 2_700_000.0), strict=True):
        points.append({
            "gpus": n, "gpu_indices": list(range(n)), "job": f"p{n}", "state": state, "ranks": n,
            "plan": {"layout": f"dp {n}, micro-batch {8 // n} × 1 accumulation", "micro_batch": 8 // n, "grad_accum": 1},
            "predicted": {"tokens_per_s": pred, "step_s": 0.1},
            "measured": None if tps is None else {"steps": 3, "tokens_per_s": tps, "steps_per_s": tps / 256},
        })  # fmt: skip
    study = {
        "schema": scaling.SCHEMA, "id": "sabc123", "created": 1.0, "model": "tiny", "from_job": "t",
        "machine": "simulated: 4×RTX 4090", "simulated": True, "cpu_cores": 2, "points": points,
        "settings": {"global_batch": 8, "micro_batch": 2, "seq_len": 32, "precision": "fp32", "method": "scratch", "steps": 5, "warmup": 2},
    }  # fmt: skip
    return scaling.summarize(study)


def test_how_does_this_scale_runs_a_study_and_draws_it(qtbot, tmp_path):
    link = FakeLink()
    jobs = FakeJobs(link, [a_training_job("t")])
    jobs.records["t"] = [step_record(s) for s in range(1, 11)]
    running = a_study(("completed", "running"), (20_000.0, None))
    done = a_study(("completed", "completed"), (20_000.0, 30_000.0))
    replies = iter([running, done])
    last: dict[str, Any] = {}

    def study(study: str) -> dict[str, Any]:
        last["study"] = next(replies, done)
        return {"study": copy.deepcopy(last["study"])}

    link.replies.update(
        scaling_studies=lambda **_: {"studies": []},
        scaling_start=lambda job, gpus, **_: {"study": a_study(("running", "queued"), (None, None))},
        scaling_study=study,
    )
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    detail = page.detail
    detail.tabs.setCurrentIndex(SUMMARY_TAB)
    panel = detail.scaling
    qtbot.waitUntil(lambda: panel.isVisibleTo(detail) and ("scaling_studies", {"job": "t"}) in link.calls)
    assert panel.counts.text() == "1,2,4"  # the machine's 4 GPUs
    panel.counts.setText("1,2")
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "running the 1-GPU point (job p1)" in panel.progress.text())
    assert ("scaling_start", {"job": "t", "gpus": [1, 2]}) in link.calls and not panel.start_button.isEnabled()
    qtbot.waitUntil(lambda: "running the 2-GPU point (job p2)" in panel.progress.text(), timeout=5000)
    qtbot.waitUntil(lambda: "all 2 points measured" in panel.progress.text(), timeout=5000)
    assert panel.start_button.isEnabled()

    # the table is the engine's rows, formatted by the engine's code
    assert panel.table_cells() == [scaling_table.cells(r) for r in done["table"]]
    headers = [panel.table.horizontalHeaderItem(c).text() for c in range(panel.table.columnCount())]
    assert "CPU ranks" in headers and "predicted tok/s (real GPUs)" in headers
    assert panel.table_cells()[1][6:8] == ["1.50×", "75%"]  # 30k / 20k tokens/s; 1.5 / 2 GPUs
    # the chart: measured speed-up, linear, and the plan's speed-up (2.7M / 1.5M)
    assert list(panel.curves["measured"].getData()[1]) == [1.0, 1.5]
    assert list(panel.curves["linear"].getData()[1]) == [1.0, 2.0]
    assert list(panel.curves["predicted"].getData()[1]) == [1.0, 1.8]
    assert "CPU ranks" in panel.notes.text()

    png, table = tmp_path / "s.png", tmp_path / "s.csv"
    panel.export_png(png)
    panel.export_csv(table)
    assert not QImage(str(png)).isNull()
    rows = list(csv.DictReader(table.open()))
    assert [r["gpus"] for r in rows] == ["1", "2"] and float(rows[1]["speedup"]) == 1.5


def test_a_past_study_of_the_job_shows_when_the_job_is_opened(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t")])
    done = a_study(("completed", "completed"), (20_000.0, 10_000.0))
    link.replies["scaling_studies"] = lambda job=None, **_: {"studies": [done] if job == "t" else []}
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    panel = page.detail.scaling
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2)
    assert panel.table_cells()[1][6:8] == ["0.50×", "25%"]


def test_no_scaling_button_on_a_study_point_or_an_unfinished_job(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t", study="sabc123")])
    link.replies["scaling_studies"] = lambda **_: {"studies": []}
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    assert not page.detail.scaling.isVisibleTo(page.detail)


def test_a_running_study_can_be_cancelled_from_the_panel(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_training_job("t")])
    running = a_study(("completed", "running"), (20_000.0, None))
    link.replies.update(
        scaling_studies=lambda job=None, **_: {"studies": [running] if job == "t" else []},
        scaling_study=lambda study: {"study": copy.deepcopy(running)},
        # as the engine answers: the running point's job cancelled, the measured one kept
        scaling_cancel=lambda study: {"study": a_study(("completed", "cancelled"), (20_000.0, None))},
    )
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    page.detail.tabs.setCurrentIndex(SUMMARY_TAB)
    panel = page.detail.scaling
    qtbot.waitUntil(lambda: panel.cancel_button.isVisibleTo(page.detail))
    assert not panel.start_button.isEnabled()
    qtbot.mouseClick(panel.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "was cancelled: 1 of 2 points measured" in panel.progress.text())
    assert ("scaling_cancel", {"study": "sabc123"}) in link.calls
    assert not panel.cancel_button.isVisibleTo(page.detail) and panel.start_button.isEnabled()
    assert panel.table.rowCount() == 2
