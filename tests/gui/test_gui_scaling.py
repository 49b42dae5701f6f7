"""'How does this scale?' on a finished training job: the study starts, shows which point runs, then its table
and chart (measured, linear, predicted), and exports PNG and CSV. The engine is a FakeLink whose studies are
filled in by the engine's own code (scaling.summarize), so the numbers are the ones `rigpilot scaling` prints."""

from __future__ import annotations

import copy
import csv
from typing import Any

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QImage, QWheelEvent
from PySide6.QtWidgets import QApplication

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


def planning_study(counts: list[int]) -> dict[str, Any]:
    study = {**a_study(("queued", "queued"), (None, None)), "points": [], "phase": "planning", "counts": counts,
             "planned": 0}  # fmt: skip
    return scaling.summarize(study)


def test_how_does_this_scale_runs_a_study_and_draws_it(qtbot, tmp_path):
    link = FakeLink()
    jobs = FakeJobs(link, [a_training_job("t")])
    jobs.records["t"] = [step_record(s) for s in range(1, 11)]
    first = a_study(("running", "queued"), (None, None))
    running = a_study(("completed", "running"), (20_000.0, None))
    running["points"][1]["step"] = 4
    done = a_study(("completed", "completed"), (20_000.0, 30_000.0))
    replies = iter([first, running, done])
    last: dict[str, Any] = {}

    def study(study: str) -> dict[str, Any]:
        last["study"] = next(replies, done)
        return {"study": copy.deepcopy(last["study"])}

    link.replies.update(
        scaling_studies=lambda **_: {"studies": []},
        scaling_start=lambda job, gpus, **_: {"study": planning_study(gpus)},
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
    qtbot.waitUntil(lambda: "planning GPU counts 1, 2 (0 of 2 planned)" in panel.progress.text())
    assert ("scaling_start", {"job": "t", "gpus": [1, 2]}) in link.calls and not panel.start_button.isEnabled()
    assert "still planning" in panel.start_button.toolTip() and panel.cancel_button.isVisibleTo(panel)
    qtbot.waitUntil(lambda: "1 GPU (job p1): running" in panel.progress.text(), timeout=5000)
    assert "2 GPUs (job p2): waiting for its GPUs" in panel.progress.text()
    qtbot.waitUntil(lambda: "2 GPUs (job p2): step 4 of 5" in panel.progress.text(), timeout=5000)
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
    assert list(panel.curves["measured"].getData()[0]) == [1, 2]  # GPUs on x
    (x0, x1), (y0, y1) = panel.chart.getPlotItem().viewRange()
    assert x0 == 0 and 2 < x1 < 3 and y0 == 0 and 2 < y1 < 2.5  # from 0, room for linear's 2.0
    assert "CPU ranks" in panel.notes.text()
    assert not panel.words.isVisibleTo(panel)  # a study without words (an older engine's) shows no empty line

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
    # The engine's words for the measured speed-up (engine.jobs.scaling_words), shown as they come.
    done["words"] = ["On CPU ranks (simulated): 2 GPUs give 0.5× (25% of linear)"]
    link.replies["scaling_studies"] = lambda job=None, **_: {"studies": [done] if job == "t" else []}
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    panel = page.detail.scaling
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2)
    assert panel.table_cells()[1][6:8] == ["0.50×", "25%"]
    assert panel.words.text() == done["words"][0] and panel.words.isVisibleTo(panel)


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


def test_noise_rows_are_marked_and_drawn_apart_and_a_second_study_is_followed_not_started(qtbot):
    from rigpilot.engine.api.client import EngineError

    link = FakeLink()
    FakeJobs(link, [a_training_job("t")])
    noisy = a_study(("completed", "completed"), (100.0, 3672.0))  # 2 GPUs at 18× linear: noise
    link.replies["scaling_studies"] = lambda job=None, **_: {"studies": [noisy] if job == "t" else []}

    def refuse(**_: Any) -> Any:
        raise EngineError("invalid", "scaling study sabc123 of job t is still running", {"study": "sabc123", "job": "t"},
                          reason="study_running")  # fmt: skip

    link.replies.update(scaling_start=refuse, scaling_study=lambda study: {"study": copy.deepcopy(noisy)})
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    panel = page.detail.scaling
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2)
    assert panel.table_cells()[1][6:8] == ["noise", "noise"]
    assert panel.table.item(1, 7).toolTip().startswith("Noise, not a result: 18.4× linear")
    assert list(panel.curves["measured"].getData()[0]) == [1] and list(panel.curves["noise"].getData()[0]) == [2]
    (_, _), (y0, y1) = panel.chart.getPlotItem().viewRange()
    assert y0 == 0 and y1 < 3 and max(panel.curves["noise"].getData()[1]) <= y1  # not squashed by 36.7×
    # The wheel over the chart (scrolling the Summary page down) leaves its axes alone.
    before = panel.chart.getPlotItem().viewRange()
    at = QPointF(panel.chart.width() / 2, panel.chart.height() / 2)
    wheel = QWheelEvent(at, panel.chart.mapToGlobal(at), QPoint(0, -120), QPoint(0, -120), Qt.MouseButton.NoButton,
                        Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)  # fmt: skip
    QApplication.sendEvent(panel.chart.viewport(), wheel)
    assert panel.chart.getPlotItem().viewRange() == before
    panel.start()  # refused (study_running): the panel follows the study that runs instead of failing
    qtbot.waitUntil(lambda: ("scaling_study", {"study": "sabc123"}) in link.calls)
    assert "could not start" not in panel.progress.text()
