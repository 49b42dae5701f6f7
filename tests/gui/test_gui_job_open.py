"""Opening a job page keeps the window answering: the history is sifted and folded off the GUI thread,
the page is filled before it is shown, and the charts show exactly what the old in-place fold showed."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyqtgraph as pg
import pytest

from rigpilot.app.jobs import handle as handle_module
from rigpilot.app.jobs.chart_turns import AXES
from rigpilot.app.jobs.charts import JOB_END, TELEMETRY_WINDOW_S, JobCharts
from rigpilot.app.jobs.page import LIST_ROWS, LIST_SPLITTER_KEY
from rigpilot.app.jobs.series import STEP_FIELDS, JobSeries
from rigpilot.app.widgets import icons
from rigpilot.engine.jobs.metrics import read_records

from support.gui_fakes import FakeLink
from support.gui_jobs import GIB, T0, FakeJobs, a_job, open_job, open_page, step_record

STEPS = 500


def write_store(job_dir: Path) -> Path:
    """A two-rank job's metric files as the workers write them: 500 steps, some figures missing, evals."""
    metrics = job_dir / "metrics"
    metrics.mkdir(parents=True)
    for rank in (0, 1):
        with (metrics / f"rank{rank}.jsonl").open("w") as f:
            for step in range(1, STEPS + 1):
                rec = step_record(step, rank, mfu=None if step % 7 == 0 else 0.3 + step / 10_000)
                f.write(json.dumps(rec) + "\n")
                if rank == 0 and step % 50 == 0:
                    f.write(json.dumps({"time": rec["time"] + 0.5, "rank": 0, "step": step, "kind": "eval",
                                        "eval_loss": 3.0 - step / 1000}) + "\n")  # fmt: skip
    return metrics


@pytest.fixture
def store_link(tmp_path) -> tuple[FakeLink, Path]:
    link = FakeLink("4x-rtx4090")
    link.jobs = [a_job("j1", "completed", ended=a_job("x")["started"] + 600)]
    metrics = write_store(tmp_path / "j1")
    link.replies.update(
        job=lambda job: {"job": link.jobs[0]},
        metrics=lambda job, since_cursor=None, max_bytes=0: dict(
            zip(("records", "cursor", "more"), read_records(metrics, since_cursor, max_bytes=max_bytes), strict=True),
            job=job,
        ),
        telemetry_history=lambda **_: {"samples": [], "more": False, "next_since": None},
    )  # fmt: skip
    return link, metrics


def test_opening_a_job_folds_its_history_off_the_gui_thread_and_charts_the_same_points(qtbot, store_link, monkeypatch):
    link, metrics = store_link
    gui = threading.current_thread()
    folded_on: list[threading.Thread] = []
    fold = handle_module.fold

    def spy_fold(records: list[dict[str, Any]]) -> Any:
        folded_on.append(threading.current_thread())
        return fold(records)

    added_on_gui: list[int] = []
    add = JobSeries.add

    def spy_add(self: JobSeries, records: list[dict[str, Any]]) -> None:
        added_on_gui.append(len(records))
        add(self, records)

    monkeypatch.setattr(handle_module, "fold", spy_fold)
    monkeypatch.setattr(JobSeries, "add", spy_add)
    monkeypatch.setattr(handle_module, "METRICS_PAGE_BYTES", 32 * 1024)  # several pages, as a long job has
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    handle = page.current_handle

    assert len(link.requests("metrics")) > 2
    assert folded_on and gui not in folded_on  # every page was folded on a worker
    assert not added_on_gui  # and none in place on the GUI thread

    # The old path: every record read at once and folded in place.
    records, _, more = read_records(metrics, None, max_bytes=1 << 30)
    assert not more
    before = JobSeries()
    add(before, records)
    assert handle.series.records == before.records == 2 * STEPS + STEPS // 50
    for name in STEP_FIELDS:
        np.testing.assert_array_equal(handle.series.series(name)[0], before.series(name)[0])
        np.testing.assert_array_equal(handle.series.series(name)[1], before.series(name)[1])
    assert handle.series.peak_memory == before.peak_memory
    assert handle.series.measured() == before.measured()

    charts = page.detail.charts
    x, y = charts.loss_raw.getData()
    np.testing.assert_array_equal(x, before.series("loss")[0])
    np.testing.assert_array_equal(y, before.series("loss")[1])
    np.testing.assert_array_equal(charts.eval_loss.getData()[1], before.eval_loss()[1])
    x, y = charts.mfu_curve.getData()
    assert len(x) == STEPS and math.isnan(y[6]) and y[0] == pytest.approx(30.01)


def test_the_job_page_is_filled_before_it_is_shown_and_its_charts_paint_in_turns(qtbot, store_link):
    link, _ = store_link
    page = open_page(qtbot, link)
    shown_when_filled: list[bool] = []
    detail = page.detail
    update_record = detail.update_record

    def spy() -> None:
        shown_when_filled.append(detail.stack.currentIndex() == 1)
        update_record()

    detail.update_record = spy  # type: ignore[method-assign]
    page.open_job("j1")
    assert not shown_when_filled  # filled in a turn after the click, which does little else
    assert detail.stack.currentIndex() == 0  # shown in a turn of its own: its first layout is not in the click
    qtbot.waitUntil(lambda: detail.stack.currentIndex() == 1)
    # QProgressBar.setValue repaints a shown bar at once: filled while hidden, nothing paints as it is filled.
    assert shown_when_filled[0] is False
    held = [c for c in detail.charts.charts() if c.isHidden() or not c.updatesEnabled()]
    assert held  # each waits for event-loop turns of its own
    qtbot.waitUntil(lambda: all(c.isVisible() and c.updatesEnabled() for c in detail.charts.charts()))
    assert detail.tabs.isVisible() and detail.body.updatesEnabled() and page.table.updatesEnabled()


def test_steps_a_job_did_not_report_break_the_line_instead_of_a_ramp(qtbot):
    link = FakeLink("4x-rtx4090")
    jobs = FakeJobs(link, [a_job("g1", "completed")], page_records=1000)
    jobs.records["g1"] = [step_record(s) for s in (*range(1, 101), *range(200, 301))]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "g1")
    for curve in (page.detail.charts.loss_raw, page.detail.charts.loss_ema, page.detail.charts.lr_curve):
        x, y = curve.getData()
        hole = np.flatnonzero(np.isnan(y))
        assert len(hole) == 1 and x[hole[0] - 1] == 100 and x[hole[0] + 1] == 200


@pytest.mark.parametrize("simulated", [True, False])
def test_an_empty_mfu_chart_on_cpu_ranks_says_why_in_its_place(qtbot, simulated):
    link = FakeLink("4x-rtx4090")
    FakeJobs(link, [a_job("m1", "completed", simulated=simulated)]).records["m1"] = [
        step_record(s, mfu=None) for s in range(1, 21)
    ]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "m1")
    mfu = page.detail.charts.mfu
    assert mfu.title_text() == "MFU (%) · not reported"
    if simulated:
        assert mfu.reason is not None and mfu.reason.isVisible()
        assert "CPU" in mfu.reason.text() and "peak" in mfu.reason.text()
        assert mfu.reason.text() in mfu.toolTip()
        assert mfu.viewport().rect().contains(mfu.reason.geometry())
    else:
        assert mfu.reason is None or not mfu.reason.isVisible()
    link.push_metrics("m1", [step_record(21, mfu=0.4)])  # a figure at last: the chart draws it, nothing covers it
    page.refresh(force=True)
    assert mfu.reason is None or not mfu.reason.isVisible()


def gpu_sample(t: float, used_gib: float) -> dict[str, Any]:
    return {"time": t, "gpus": [{"index": g, "memory_used": used_gib * GIB, "memory_total": 24 * GIB, "gpu_util": 50.0}
                                for g in (0, 1)]}  # fmt: skip


def test_a_finished_job_shows_its_own_recorded_telemetry_not_what_the_gpus_do_now(qtbot):
    link = FakeLink("4x-rtx4090")
    started, ended = T0, T0 + 3600
    FakeJobs(link, [a_job("f1", "completed", started=started, ended=ended)]).records["f1"] = [step_record(1)]
    asked: list[float] = []

    def history(since: float, limit: int = 0, **_: Any) -> dict[str, Any]:
        asked.append(since)
        # The job's last minutes at 1 Hz in two replies, then the machine idle long after the job ended.
        times = [t for t in range(int(ended) - 700, int(ended) + 100) if t > since][:400]
        return {"samples": [gpu_sample(t, 20.0 if t <= ended else 1.0) for t in times], "more": len(times) == 400,
                "next_since": times[-1] if times else since}  # fmt: skip

    link.replies["telemetry_history"] = history
    page = open_page(qtbot, link)
    open_job(qtbot, page, "f1")
    qtbot.waitUntil(lambda: len(asked) >= 2 and page.detail.charts.usage.last_time == ended)
    assert asked[0] == ended - TELEMETRY_WINDOW_S  # its last ten minutes, not the last ten minutes of now
    link.sig_telemetry.emit(gpu_sample(ended + 5000, 2.0))  # what the GPUs do now
    times, memory = page.detail.charts.usage.memory()
    assert times[-1] == ended and times[0] >= ended - TELEMETRY_WINDOW_S
    assert np.all(memory == 20.0)
    page.refresh(force=True)
    gpu_memory = page.detail.charts.gpu_memory
    assert gpu_memory.readout.text().startswith(f"{JOB_END} — GPU 0: 20")  # not "now"
    assert JOB_END in gpu_memory._axis.tickStrings([0.0], 1.0, gpu_memory._axis._major)


def test_a_running_job_still_follows_the_live_telemetry(qtbot):
    link = FakeLink("4x-rtx4090")
    FakeJobs(link, [a_job("r1", "running")]).records["r1"] = [step_record(1)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "r1")
    now = time.time()
    link.sig_telemetry.emit(gpu_sample(now, 3.0))
    assert page.detail.charts.usage.last_time == now
    axis = page.detail.charts.gpu_memory._axis
    assert axis.tickStrings([0.0], 1.0, axis._major) == ["now"]


def test_the_job_list_shows_several_rows_and_keeps_the_height_a_user_drags_it_to(qtbot, settings):
    link = FakeLink("4x-rtx4090")
    FakeJobs(link, [a_job(f"l{n}", "completed") for n in range(8)])
    page = open_page(qtbot, link)
    page.resize(1280, 720)  # the Jobs page of a first window on a 1280x800 screen
    qtbot.waitUntil(lambda: page.table.viewport().height() >= LIST_ROWS * page.table.rowHeight(0))
    assert not page.splitter.isCollapsible(0)
    page.save_state(settings, "jobs")
    assert settings.value(f"jobs/{LIST_SPLITTER_KEY}") is None  # nothing chosen, nothing saved

    total = sum(page.splitter.sizes())
    page.splitter.setSizes([300, total - 300])
    page.splitter.splitterMoved.emit(300, 1)  # what a drag of the handle sends
    page.resize(1280, 700)  # the user's height stays through a resize
    assert page.splitter.sizes()[0] == 300
    page.save_state(settings, "jobs")

    again = open_page(qtbot, link)
    again.restore_state(settings, "jobs")
    again.resize(1280, 720)
    qtbot.waitUntil(lambda: again.splitter.sizes()[0] == 300)


def test_each_charts_axes_are_drawn_in_turns_of_their_own_before_it_paints(qtbot, store_link, monkeypatch):
    """Drawing an axis's labels was most of a chart's paint: one slice the window could not answer in."""
    link, _ = store_link
    painting: list[object] = []
    painted: list[object] = []
    drawn_in_paint: list[object] = []
    paint, specs = pg.GraphicsView.paintEvent, pg.AxisItem.generateDrawSpecs

    def spy_paint(self: Any, event: Any) -> Any:
        painting.append(self)
        painted.append(self)
        try:
            return paint(self, event)
        finally:
            painting.pop()

    def spy_specs(self: Any, painter: Any) -> Any:
        if painting:
            drawn_in_paint.append(self)
        return specs(self, painter)

    monkeypatch.setattr(pg.GraphicsView, "paintEvent", spy_paint)
    monkeypatch.setattr(pg.AxisItem, "generateDrawSpecs", spy_specs)
    page = open_page(qtbot, link)
    page.open_job("j1")
    charts = page.detail.charts
    handle = page.current_handle
    qtbot.waitUntil(
        lambda: handle.history_loaded and not charts.drawing and all(c.isVisible() for c in charts.charts())
    )
    views = [c.plot if hasattr(c, "set_data") else c for c in charts.charts()]
    for view in views:
        for name in AXES:
            view.getPlotItem().getAxis(name).picture = None  # every axis has to be drawn again
    painted.clear()
    drawn_in_paint.clear()
    charts.set_smoothing(0.5)
    assert page.detail.charts.refresh()
    qtbot.waitUntil(lambda: not charts.drawing and all(c.updatesEnabled() for c in charts.charts()))
    qtbot.waitUntil(lambda: set(views) <= set(painted))
    # The paints only replayed the pictures the turns had drawn. (A telemetry chart's "ago" axis is redrawn as
    # time passes, by design.)
    from rigpilot.app.widgets.time_chart import AgoAxis

    assert not [axis for axis in drawn_in_paint if not isinstance(axis, AgoAxis)]


def test_charts_are_drawn_once_the_history_is_in_and_hide_the_last_jobs_while_it_loads(qtbot, monkeypatch):
    """Drawn empty while the history loads and again once it is in, a page paid twice for its charts."""
    link = FakeLink("4x-rtx4090")
    jobs = FakeJobs(link, [a_job("h1", "completed"), a_job("h2", "completed")], page_records=10)
    for job_id in ("h1", "h2"):
        jobs.records[job_id] = [step_record(s, rank) for s in range(1, 41) for rank in (0, 1)]
    drawn_with: list[tuple[str, bool]] = []
    draw_loss = JobCharts._draw_loss

    def spy(charts: JobCharts) -> None:
        handle = page.current_handle
        drawn_with.append((handle.id, handle.history_loaded))
        draw_loss(charts)

    monkeypatch.setattr(JobCharts, "_draw_loss", spy)  # before the page binds its charts' draws
    page = open_page(qtbot, link)
    open_job(qtbot, page, "h1")
    page.open_job("h2")
    charts = page.detail.charts
    assert all(c.isHidden() for c in charts.charts())  # not h1's lines under h2's title
    qtbot.waitUntil(lambda: not charts.drawing and all(c.isVisible() for c in charts.charts()))
    assert ("h2", True) in drawn_with
    assert all(loaded for _, loaded in drawn_with)  # never drawn from a history still paging in
    assert [int(s) for s in charts.loss_raw.getData()[0]] == list(range(1, 41))


def test_the_panes_button_icons_are_rendered_at_idle_before_a_job_is_opened(qtbot):
    icons._pixmaps.clear()
    page = open_page(qtbot, FakeLink("4x-rtx4090"))
    wanted = {"cancel", "resume", "clone", "open-folder", "rename", "delete"}
    qtbot.waitUntil(lambda: wanted <= {key[0] for key in icons._pixmaps})
    assert page.current_handle is None  # no job was opened: the first one finds them ready
