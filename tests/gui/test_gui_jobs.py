"""The Jobs page, driven by a fake engine link: the list, a job's history and stream, failures, controls."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from rigpilot.app.jobs.handle import LAUNCHER_RANK, RecordDeduper
from rigpilot.app.jobs.model import STATE, STATES, duration
from rigpilot.app.jobs.page import JobsPage
from rigpilot.app.jobs.series import JobSeries, ema, final_timeline
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.jobs import machine_check
from rigpilot.engine.jobspec.spec import JobSpec

from support.doctor_reports import four_gpu_report
from support.gui_fakes import FakeLink, focusable_widgets, tab_through
from support.gui_jobs import GIB, T0, FakeJobs, a_job, a_training_job, open_job, open_page, step_record


def loss_steps(page: JobsPage) -> list[int]:
    x, _ = page.detail.charts.loss_raw.getData()
    return [] if x is None else [int(s) for s in x]


# -- the list --------------------------------------------------------------------------------------------------


def test_the_list_shows_jobs_of_every_state_and_filters_and_sorts_them(qtbot):
    link = FakeLink()
    jobs = []
    for i, state in enumerate(STATES):
        job = a_job(f"j{i}", state)
        job["seq"] = i
        job["created"] = T0 + i
        if state == "running":
            job["progress"] = {"fraction": 0.25, "step": 25, "max_steps": 100, "eta_s": 750.0}
        jobs.append(job)
    FakeJobs(link, jobs)
    page = open_page(qtbot, link)
    shown = {page.proxy.index(r, STATE).data() for r in range(page.proxy.rowCount())}
    assert shown == set(STATES)
    assert page.count_label.text() == f"{len(STATES)} jobs"
    running = page.model.row_of("j2")
    assert page.model.index(running, 2).data() == "25 % (25/100)"
    assert page.model.index(running, 3).data() == "12 min"
    assert page.model.index(running, 4).data() == "0, 1"

    page.set_state_filter({"failed"})
    assert page.proxy.rowCount() == 1 and page.proxy.index(0, 0).data(Qt.ItemDataRole.UserRole + 1) == "j4"
    page.set_state_filter({"queued", "starting", "running"})
    assert page.proxy.rowCount() == 3
    assert page.count_label.text() == f"3 of {len(STATES)} jobs"
    page.set_state_filter(None)

    page.table.sortByColumn(STATE, Qt.SortOrder.AscendingOrder)
    order = [page.proxy.index(r, STATE).data() for r in range(page.proxy.rowCount())]
    assert order == list(STATES)

    # A job event updates its row; a deleted job leaves the list.
    link.push_job({**jobs[2], "state": "completed", "progress": {"fraction": 1.0, "step": 100, "max_steps": 100}})
    assert page.model.index(running, STATE).data() == "completed"
    link.push_job({"id": "j0", "state": "deleted"})
    assert page.model.row_of("j0") is None


def test_open_job_selects_a_job_the_list_has_not_heard_of_yet(qtbot):
    link = FakeLink()
    engine = FakeJobs(link, [a_job("old", "completed")])
    page = open_page(qtbot, link)
    page.set_state_filter({"completed"})
    link.jobs.append(a_job("new", "queued"))  # just submitted by the wizard; no event has come yet
    engine.records["new"] = []
    with qtbot.waitSignal(page.sig_job_opened) as opened:
        page.open_job("new")
    assert opened.args == ["new"]
    qtbot.waitUntil(lambda: page.current_handle.record.get("state") == "queued")
    assert page.current_job_id == "new"
    assert page.table.currentIndex().data(Qt.ItemDataRole.UserRole + 1) == "new"
    assert page.proxy.states is None  # the filter gave way so the job can be seen
    assert page.detail.title.text() == "run new  (new)"


def test_a_job_the_engine_does_not_know_leaves_the_list(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_job("a"), a_job("b")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "a")
    with qtbot.waitSignal(page.sig_message):
        page.open_job("ghost")
    qtbot.waitUntil(lambda: page.model.row_of("ghost") is None)
    assert page.current_job_id is None and page.handle("ghost") is None
    assert not page.table.currentIndex().isValid()
    assert "no job 'ghost'" in page.status.text()
    assert page.detail.stack.currentWidget() is page.detail.empty


# -- history and stream -------------------------------------------------------------------------------------


def test_opening_a_job_loads_paged_history_then_appends_streamed_records_without_duplicates(qtbot):
    link = FakeLink()
    engine = FakeJobs(link, [a_job("j1")], page_records=10)
    engine.records["j1"] = [step_record(s, rank) for s in range(1, 31) for rank in (0, 1)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    handle = page.current_handle

    pages = link.requests("metrics")
    assert len(pages) == 3
    assert [p["since_cursor"] for p in pages] == [{}, {"0": 10, "1": 10}, {"0": 20, "1": 20}]
    assert handle.metrics_cursor == {"0": 30, "1": 30}
    assert "j1" in link.watched
    assert loss_steps(page) == list(range(1, 31))

    # The stream replays what the history already had, then goes on.
    link.push_metrics("j1", [step_record(s, rank) for s in range(25, 36) for rank in (0, 1)])
    link.push_metrics("j1", [step_record(36), step_record(36)])
    link.push_metrics("other-job", [step_record(99)])
    page.refresh()
    assert loss_steps(page) == list(range(1, 37))
    assert handle.series.records == 36 * 2 - 1  # rank 1 has no step 36
    _, loss = page.detail.charts.loss_raw.getData()
    assert loss[-1] == pytest.approx(4.0 / 4.6)
    x, smoothed = page.detail.charts.loss_ema.getData()
    assert len(x) == 36 and smoothed[-1] > loss[-1]  # the smoothed loss lags behind a falling loss
    assert handle.series.peak_memory == {0: 10 * GIB, 1: 11 * GIB}


def test_after_a_reconnect_the_history_resumes_from_the_cursor(qtbot):
    link = FakeLink()
    engine = FakeJobs(link, [a_job("j1")], page_records=50)
    engine.records["j1"] = [step_record(s) for s in range(1, 11)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    handle = page.current_handle
    link.push_metrics("j1", [step_record(11)])
    engine.records["j1"].append(step_record(11))

    # Written while the link was down: no stream event ever carries these.
    link.lose_engine()
    engine.records["j1"] += [step_record(s) for s in range(12, 16)]
    link.connect_engine()
    qtbot.waitUntil(lambda: len(link.requests("metrics")) == 2 and not handle._metrics_busy)
    assert link.requests("metrics")[-1]["since_cursor"] == {"0": 10}
    # The resubscribed stream resumes where it was; its overlap with the refetch is dropped.
    link.push_metrics("j1", [step_record(s) for s in range(12, 17)])
    page.refresh()
    assert loss_steps(page) == list(range(1, 17))
    assert handle.series.records == 16


def test_the_cursor_catches_up_with_the_stream(qtbot, monkeypatch):
    monkeypatch.setattr("rigpilot.app.jobs.handle.CATCH_UP_MS", 20)
    link = FakeLink()
    engine = FakeJobs(link, [a_job("j1")])
    engine.records["j1"] = [step_record(s) for s in range(1, 4)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    engine.records["j1"] += [step_record(s) for s in range(4, 7)]
    link.push_metrics("j1", engine.records["j1"][3:])
    qtbot.waitUntil(lambda: page.current_handle.metrics_cursor == {"0": 6})
    assert page.current_handle.series.records == 6


def test_a_resumed_run_replaces_the_steps_it_repeats():
    series = JobSeries()
    series.add([step_record(s, loss=1.0) for s in range(1, 61)])
    rerun = [{**step_record(s, loss=2.0), "time": T0 + 1000 + s} for s in range(51, 71)]
    series.add(rerun)
    steps, loss = series.series("loss")
    assert steps.tolist() == list(range(1, 71))
    assert loss[49] == 1.0 and loss[50] == 2.0 and loss[-1] == 2.0
    assert series.smoothed_loss(0.5)[1].tolist() == ema(loss, 0.5).tolist()


def test_the_smoothed_loss_carries_on_as_records_arrive():
    series = JobSeries()
    rng = np.random.default_rng(1)
    for start in range(1, 200, 20):
        series.add([step_record(s, loss=float(rng.random())) for s in range(start, start + 20)])
        _, smoothed = series.smoothed_loss(0.9)
        assert np.allclose(smoothed, ema(series.series("loss")[1], 0.9))
    # An older record arriving late changes the prefix: the average is computed again.
    series.add([{**step_record(0, loss=100.0), "time": T0 - 1}])
    _, smoothed = series.smoothed_loss(0.9)
    assert smoothed[0] == 100.0 and np.allclose(smoothed, ema(series.series("loss")[1], 0.9))


def test_deduplication_and_smoothing_helpers():
    dedupe = RecordDeduper()
    status = {"time": T0, "rank": 0, "kind": "status", "phase": "training", "step": None}
    later = {**status, "time": T0 + 5, "phase": "saving"}
    assert dedupe.fresh([status, step_record(1), step_record(1, rank=1)]) == [
        status,
        step_record(1),
        step_record(1, rank=1),
    ]
    assert dedupe.fresh([status, later, step_record(1), {**step_record(1), "step": [1]}]) == [
        later,
        {**step_record(1), "step": [1]},
    ]
    assert len(dedupe) == 5
    # Debiased: the two values weigh 1/3 and 2/3, not 1/2 and 1/2 as an average started from the first.
    smoothed = ema(np.array([1.0, math.nan, 3.0]), 0.5)
    assert np.allclose(smoothed, [1.0, 1.0, 1 / 3 + 2 * 3 / 3])
    assert ema(np.array([2.0, 4.0]), 0.0).tolist() == [2.0, 4.0]  # no smoothing
    # A falling loss: each point is the mean of the values so far weighted 0.9**age (about 2.9 here; an
    # average started from the first value would still say 7.6).
    falling = ema(np.array([10.0, 1.0, 1.0, 1.0]), 0.9)
    weights = 0.9 ** np.arange(3, -1, -1)
    assert falling[0] == 10.0 and np.isclose(falling[-1], np.dot(weights, [10, 1, 1, 1]) / weights.sum())
    assert final_timeline(np.array([1.0, 2.0, 3.0, 2.0, 3.0, 4.0])).tolist() == [True, False, False, True, True, True]
    assert [duration(s) for s in (None, 5, 125, 3 * 3600 + 300, 2 * 86400 + 4 * 3600)] == [
        "n/a", "5 s", "2 min", "3 h 05 min", "2 d 4 h"
    ]  # fmt: skip


# -- failures --------------------------------------------------------------------------------------------------


def test_a_failed_job_shows_the_rank_the_cause_and_the_last_log_lines(qtbot):
    link = FakeLink()
    last = ["step 7 loss 2.1", "Traceback (most recent call last):", "RuntimeError: NCCL timeout"]
    failed = a_job("bad", "failed", failed_rank=2, exit_reason="rank 2 exited with code 1", last_log=last, ranks=4)
    engine = FakeJobs(link, [a_job("ok", "completed"), failed])
    engine.logs[("bad", 2)] = "\n".join(last) + "\n"
    page = open_page(qtbot, link)
    open_job(qtbot, page, "bad")
    panel = page.detail.failure
    assert panel.isVisible()
    assert panel.title.text() == "Failed on rank 2"
    assert panel.reason.text() == "rank 2 exited with code 1"
    assert panel.last_log.toPlainText().splitlines() == last
    assert not panel.fix.isVisible()
    assert (
        page.model.index(page.model.row_of("bad"), STATE).data(Qt.ItemDataRole.ToolTipRole)
        == "rank 2 exited with code 1"
    )

    # The log tab opens on the failed rank.
    assert page.detail.log.rank == 2
    panel.show_log.click()
    assert page.detail.tabs.currentWidget() is page.detail.log
    qtbot.waitUntil(lambda: page.detail.log.lines() == last)

    open_job(qtbot, page, "ok")
    assert not panel.isVisible()


def test_a_job_that_found_the_disk_full_says_how_much_room_to_free_and_where(qtbot):
    link = FakeLink()
    folder = "/home/u/.local/state/rigpilot/jobs/full/checkpoints"
    line = f"disk full: {folder} needs about 1.2 GiB for step-40, 80 MiB free"
    error = {"error": "disk_full", "message": line, "folder": folder, "needed_bytes": int(1.2 * GIB),
             "free_bytes": 80 * 1024**2, "failed_at": T0}  # fmt: skip
    FakeJobs(link, [a_job("full", "failed", failed_rank=0, exit_reason=line, error=error)])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "full")
    panel = page.detail.failure
    assert panel.title.text() == "Disk full on rank 0"
    assert panel.reason.text() == line
    fix = panel.fix.text()
    assert panel.fix.isVisible() and "at least 1.2 GiB" in fix and folder in fix and "80.0 MiB were free" in fix
    assert "last complete checkpoint" in fix


def test_an_out_of_memory_record_shows_the_planners_suggested_fix(qtbot):
    link = FakeLink()
    predicted = {"peak_memory_bytes": 20 * GIB, "tokens_per_s": 8000.0, "step_time_s": 0.5,
                 "suggestion": "halve the micro-batch (--micro-batch 2) and double gradient accumulation"}  # fmt: skip
    engine = FakeJobs(link, [a_job("oom", predicted=predicted), a_job("noplan")])
    engine.records["oom"] = [step_record(1), step_record(1, rank=1)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "oom")
    assert not page.detail.failure.isVisible()

    oom = {"time": T0 + 2, "rank": 1, "step": None, "kind": "error", "error": "out_of_memory",
           "message": "CUDA out of memory. Tried to allocate 2.00 GiB", "allocated": 23 * GIB, "total": 24 * GIB}  # fmt: skip
    link.push_metrics("oom", [oom])
    page.refresh()
    panel = page.detail.failure
    assert panel.isVisible()
    assert panel.title.text() == "Out of GPU memory on rank 1"
    assert "--micro-batch 2" in panel.fix.text()
    assert "allocated 23.00 GiB" in panel.reason.text() and "predicted 20.00 GiB" in panel.reason.text()

    # Without a plan the panel still says what to try.
    engine.records["noplan"] = [oom]
    open_job(qtbot, page, "noplan")
    assert page.detail.failure.isVisible() and "Planner" in page.detail.failure.fix.text()


def test_predictions_sit_beside_the_measured_memory_and_speed(qtbot):
    link = FakeLink()
    predicted = {"peak_memory_bytes": 10 * GIB, "tokens_per_s": 4000.0, "step_time_s": 0.25}
    engine = FakeJobs(link, [a_job("j1", predicted=predicted, simulated=False)])
    engine.records["j1"] = [step_record(s, rank) for s in range(1, 21) for rank in (0, 1)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    table = page.detail.prediction
    assert table.text("peak_memory_bytes", 0) == "10.00 GiB"
    assert table.text("peak_memory_bytes", 1) == "11.00 GiB"
    assert table.text("peak_memory_bytes", 2) == "1.10 ×"
    assert table.text("tokens_per_s", 1) == f"{2 * 1015.5:,.0f}"  # both ranks' median of the last ten steps
    assert table.text("step_time_s", 0) == "250 ms" and table.text("step_time_s", 1) == "500 ms"
    charts = page.detail.charts
    assert charts.memory_per_rank.bar_heights() == [10.0, 11.0]
    assert charts.memory_per_rank.prediction.isVisible() and charts.memory_per_rank.prediction.value() == 10.0
    assert charts.speed.prediction.value() == 2000.0  # the plan's job rate, per GPU (two ranks)
    assert charts.speed.prediction.isVisible() and not charts.speed.off_scale


def test_the_summary_and_plan_vs_measured_show_one_speed_the_engines_steady_one(qtbot):
    from rigpilot.app.jobs.detail import SUMMARY_TAB

    link = FakeLink()
    job = a_training_job("t")
    job["predicted"] = {"tokens_per_s": 4000.0, "step_time_s": 0.25}
    job["progress"].update(tokens_per_s=2222.0, steady_tokens_per_s=2031.0, steady_step_time_s=0.5)
    engine = FakeJobs(link, [job])
    engine.records["t"] = [step_record(s, rank) for s in range(1, 21) for rank in (0, 1)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    page.detail.tabs.setCurrentIndex(SUMMARY_TAB)
    qtbot.waitUntil(lambda: "Speed" in page.detail.summary_panel.rows())
    assert page.detail.summary_panel.rows()["Speed"] == "2.03k tokens/s"
    assert page.detail.prediction.text("tokens_per_s", 1) == "2,031"  # the same figure, not the latest rate
    assert page.detail.prediction.text("step_time_s", 1) == "500 ms"


def test_a_plan_far_off_the_measured_scale_is_named_not_drawn(qtbot):
    # A real machine whose job runs about 100x slower than planned (simulated machines: test_gui_charts.py).
    link = FakeLink()
    predicted = {"peak_memory_bytes": 10 * GIB, "tokens_per_s": 200_000.0, "step_time_s": 0.004}
    engine = FakeJobs(link, [a_job("sim", predicted=predicted, simulated=False)])
    engine.records["sim"] = [step_record(s, rank) for s in range(1, 21) for rank in (0, 1)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "sim")
    speed, step_time = page.detail.charts.speed, page.detail.charts.step_time
    for plot in (speed, step_time):
        assert plot.off_scale and not plot.prediction.isVisible()
        assert "plan" in plot.title_text() and "too far from the measured values" in plot.toolTip()
    # The y-axis follows the measured ~1000 tokens/s, not the plan's 100,000 per GPU.
    assert speed.getPlotItem().viewRange()[1][1] < 10_000


# -- controls ----------------------------------------------------------------------------------------------------


def test_cancel_and_resume_send_the_right_requests(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_job("run"), a_job("dead", "failed", exit_reason="rank 0 was killed by SIGKILL", failed_rank=0)])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "run")
    d = page.detail
    assert d.cancel_button.isEnabled() and not d.resume_button.isEnabled()
    d.cancel_button.click()
    qtbot.waitUntil(lambda: page.current_handle.record.get("cancel_requested") is True)
    assert link.requests("cancel") == [{"job": "run"}]
    assert not d.cancel_button.isEnabled()
    assert "cancelling" in d.summary.text()

    open_job(qtbot, page, "dead")
    assert d.resume_button.isEnabled() and not d.cancel_button.isEnabled()
    d.resume_button.click()
    qtbot.waitUntil(lambda: page.current_handle.state == "queued")
    assert link.requests("resume") == [{"job": "dead"}]
    assert not d.resume_button.isEnabled() and d.cancel_button.isEnabled()
    assert not d.failure.isVisible()


def test_a_refused_request_is_told_to_the_user(qtbot):
    link = FakeLink()
    FakeJobs(link, [a_job("run")])
    link.replies["cancel"] = EngineError("user_error", "job run has already ended (completed)")
    page = open_page(qtbot, link)
    open_job(qtbot, page, "run")
    with qtbot.waitSignal(page.sig_message) as message:
        page.cancel_job()
    assert "already ended" in message.args[0]
    assert "already ended" in page.status.text()


def test_clone_and_open_folder(qtbot, monkeypatch):
    link = FakeLink()
    FakeJobs(link, [a_job("j1")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    page.opens_wizard = False
    with qtbot.waitSignal(page.sig_clone_requested) as cloned:
        page.detail.clone_button.click()
    assert cloned.args[0]["id"] == "j1" and cloned.args[0]["gpus"] == [0, 1]

    opened = []
    monkeypatch.setattr("rigpilot.app.jobs.page.QDesktopServices.openUrl", lambda url: opened.append(url.toLocalFile()) or True)
    page.detail.folder_button.click()
    assert opened == ["/tmp/rigpilot-jobs/j1"]


def test_clone_opens_the_wizard_filled_from_the_job(qtbot):
    from rigpilot.app.wizard.wizard import JobWizard

    link = FakeLink()
    FakeJobs(link, [a_job("j1")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    page.clone_job()
    wizard = page._wizard
    assert isinstance(wizard, JobWizard) and wizard.isVisible() and wizard.link is link
    assert wizard.state.name == "run j1" and wizard.state.gpus == [0, 1]
    wizard.close()


def test_the_job_folder_of_a_remote_engine_is_not_offered(qtbot):
    link = FakeLink()
    link.remote = "gpu-box:7777"
    FakeJobs(link, [a_job("j1")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    assert not page.detail.folder_button.isEnabled()
    assert "remote" in page.detail.folder_button.toolTip()


def test_compare_overlays_a_second_runs_loss(qtbot):
    link = FakeLink()
    engine = FakeJobs(link, [a_job("a", "completed"), a_job("b"), a_job("q", "queued")])
    engine.records["a"] = [step_record(s, loss=3.0 - s * 0.1) for s in range(1, 21)]
    engine.records["b"] = [step_record(s, loss=2.0) for s in range(1, 11)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "a")
    picker = page.detail.compare
    offered = [picker.box.itemData(i) for i in range(picker.box.count())]
    assert offered == ["", "b"]  # not the shown job, not one that never ran

    picker.box.setCurrentIndex(1)
    handle_b = page.handle("b")
    qtbot.waitUntil(lambda: handle_b.history_loaded)
    page.refresh(force=True)
    charts = page.detail.charts
    x_a, y_a = charts.loss_raw.getData()
    x_b, y_b = charts.compare_raw.getData()
    assert len(x_a) == 20 and len(x_b) == 10
    assert y_a[0] == pytest.approx(2.9) and set(y_b.tolist()) == {2.0}
    assert len(charts.compare_ema.getData()[0]) == 10
    assert page.compared_job_id == "b" and "b" in link.watched

    # The overlay follows the compared job's stream too.
    link.push_metrics("b", [step_record(11, loss=1.5)])
    page.refresh()
    assert len(charts.compare_raw.getData()[0]) == 11

    assert page.compare_with(None)
    page.refresh(force=True)
    assert charts.compare_raw.getData()[0] is None or len(charts.compare_raw.getData()[0]) == 0
    assert page.handle("b") is None and "b" not in link.watched
    assert not page.compare_with("q")


def test_charts_are_drawn_only_while_visible(qtbot):
    link = FakeLink()
    engine = FakeJobs(link, [a_job("j1")])
    engine.records["j1"] = [step_record(s) for s in range(1, 6)]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    assert page.detail.charts.refresh() is False  # nothing new since the last draw
    link.push_metrics("j1", [step_record(6)])
    page.hide()
    page.refresh()
    assert len(loss_steps(page)) == 5 and not page.timer.isActive()
    page.show()
    qtbot.waitExposed(page)
    assert page.timer.isActive()
    assert len(loss_steps(page)) == 6


def test_gpu_memory_and_utilisation_come_from_telemetry_of_the_jobs_gpus(qtbot):
    link = FakeLink("4x-rtx4090")
    FakeJobs(link, [a_job("j1")])
    link.feed.set_load(0, utilization=80.0, memory_gib=12.0)
    link.feed.set_load(1, utilization=60.0, memory_gib=6.0)
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    link.push_telemetry(3)
    page.refresh(force=True)
    charts = page.detail.charts
    t, memory = charts.gpu_memory.data()
    _, util = charts.gpu_util.data()
    assert len(t) == 3 and memory.shape == (2, 3) and util.shape == (2, 3)
    assert memory[0, -1] > memory[1, -1] > 0
    assert [c.text() for c in charts.gpu_memory.checkboxes] == ["GPU 0", "GPU 1"]


# -- the log -----------------------------------------------------------------------------------------------------


def test_log_follow_appends_new_lines_and_switches_rank(qtbot):
    link = FakeLink()
    engine = FakeJobs(link, [a_job("j1", ranks=2)])
    engine.logs[("j1", 0)] = "".join(f"step {i}\n" for i in range(3))
    engine.logs[("j1", 1)] = "rank one says hi\n"
    engine.logs[("j1", LAUNCHER_RANK)] = "--- run 1: torchrun ...\n"
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    log = page.detail.log
    page.detail.tabs.setCurrentWidget(log)
    qtbot.waitUntil(lambda: log.lines() == ["step 0", "step 1", "step 2"])
    assert log.follow.isChecked() and log.timer.isActive()
    assert [log.rank_box.itemText(i) for i in range(log.rank_box.count())] == [
        "Rank 0",
        "Rank 1",
        "torchrun (launcher)",
    ]

    engine.logs[("j1", 0)] += "step 3\nstep 4 is half"  # a line still being written waits for its end
    log.poll()
    qtbot.waitUntil(lambda: log.lines()[-1] == "step 3")
    engine.logs[("j1", 0)] += " done\n"
    log.poll()
    qtbot.waitUntil(lambda: log.lines()[-1] == "step 4 is half done")
    assert log.lines() == [f"step {i}" for i in range(4)] + ["step 4 is half done"]
    assert log.text.verticalScrollBar().value() == log.text.verticalScrollBar().maximum()
    assert all(r["since_offset"] >= 0 for r in link.requests("logs")[1:])

    log.select_rank(1)
    qtbot.waitUntil(lambda: log.lines() == ["rank one says hi"])
    log.select_rank(LAUNCHER_RANK)
    qtbot.waitUntil(lambda: log.lines() == ["--- run 1: torchrun ..."])

    log.follow.setChecked(False)
    assert not log.timer.isActive()


def test_the_log_keeps_a_bounded_number_of_lines(qtbot):
    from rigpilot.app.jobs.log_view import MAX_LINES

    link = FakeLink()
    engine = FakeJobs(link, [a_job("j1", "completed")])
    engine.logs[("j1", 0)] = "".join(f"line {i}\n" for i in range(MAX_LINES + 500))
    page = open_page(qtbot, link)
    open_job(qtbot, page, "j1")
    log = page.detail.log
    page.detail.tabs.setCurrentWidget(log)
    qtbot.waitUntil(lambda: log.lines() and log.lines()[-1] == f"line {MAX_LINES + 499}")
    assert log.text.blockCount() <= MAX_LINES
    assert not log.timer.isActive()  # a finished job writes no more


# -- keyboard ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tab", [0, 1, 2])
def test_tab_reaches_every_control(qtbot, tab):
    link = FakeLink()
    engine = FakeJobs(link, [a_job("a"), a_job("b", "failed", failed_rank=0, exit_reason="rank 0 exited with code 1",
                                              last_log=["boom"])])  # fmt: skip
    engine.logs[("b", 0)] = "boom\n"
    page = open_page(qtbot, link)
    open_job(qtbot, page, "b")
    page.detail.tabs.setCurrentIndex(tab)
    QApplication.processEvents()
    expected = set(focusable_widgets(page))
    names = {w.objectName() for w in expected}
    # A failed job: cancel is disabled, so Tab rightly skips it.
    assert {"jobTable", "stateFilter", "resumeJob", "cloneJob", "openJobFolder", "failureShowLog"} <= names
    assert {"compareWith", "smoothing"} <= names if tab == 0 else True
    assert {"logRank", "logFollow", "logText"} <= names if tab == 2 else True
    visited = set(tab_through(page, qtbot))
    missing = {w.objectName() or type(w).__name__ for w in expected - visited}
    assert not missing


def test_state_survives_a_restart(qtbot):
    from PySide6.QtCore import QSettings

    link = FakeLink()
    FakeJobs(link, [a_job("a")])
    page = open_page(qtbot, link)
    page.set_state_filter({"failed"})
    page.detail.tabs.setCurrentIndex(2)
    page.detail.smoothing.setValue(0.5)
    settings = QSettings()
    page.save_state(settings, "pages/jobs")
    again = open_page(qtbot, link)
    again.restore_state(settings, "pages/jobs")
    assert again.proxy.states == frozenset({"failed"})
    assert again.detail.tabs.currentIndex() == 2
    assert again.detail.smoothing.value() == 0.5


def test_the_engines_and_the_workers_notes_are_shown_once_each(qtbot):
    link = FakeLink()
    engine_note = "simulated: 4 GPUs run as 2 CPU ranks (at most 2 per job)"
    checked = machine_check.for_job(four_gpu_report().to_dict(), JobSpec(id="n1", kind="script", gpus=[0, 1]))
    engine = FakeJobs(link, [a_job("n1", predicted={"plan_notes": [engine_note]}, machine_check=checked)])
    worker_note = {"time": T0, "rank": 0, "kind": "note", "step": None, "message": "sequence parallel: split 2 ways"}
    engine.records["n1"] = [worker_note, {**worker_note, "rank": 1}, *(step_record(s) for s in range(1, 5))]
    page = open_page(qtbot, link)
    open_job(qtbot, page, "n1")
    detail = page.detail
    qtbot.waitUntil(lambda: "sequence parallel" in detail.notes.text(), timeout=5000)
    assert detail.notes.isVisible()
    assert detail.notes.text().splitlines() == [
        f"• {engine_note}",
        "• Machine check of 2026-11-29 (simulated): Peer-to-peer copies between GPUs 0 and 1 over NODE returned "
        "wrong data: jobs on both run with NCCL_P2P_DISABLE=1 (traffic through host memory)",
        "• sequence parallel: split 2 ways",
    ]
    # Notes alone are not a plan: nothing to compare with.
    assert "No plan was attached" in detail.plan_note.text()


# -- starting a job from the empty page ---------------------------------------------------------------------------


def example_link(jobs: list[dict[str, Any]]) -> tuple[FakeLink, list[dict[str, Any]]]:
    """A link whose `plan` is the real planner's and whose `submit` adds the job to the engine's list."""
    from support.gui_fakes import accept_submissions, real_plan_reply

    link = FakeLink()
    FakeJobs(link, jobs)
    link.replies["plan"] = real_plan_reply(link.machine_obj)
    submitted = accept_submissions(link)
    submit = link.replies["submit"]

    def submit_and_list(**args: Any) -> dict[str, Any]:
        reply = submit(**args)
        link.jobs.append(reply["job"])
        return reply

    link.replies["submit"] = submit_and_list
    return link, submitted


@pytest.mark.skipif(not __import__("rigpilot.app.wizard.state").app.wizard.state.examples_present(),
                    reason="the shipped examples are missing")  # fmt: skip
def test_the_empty_page_runs_the_example_job_in_one_click_as_the_wizard_would(qtbot):
    from rigpilot.app.jobs.empty_state import NO_JOB_OPEN, NO_JOBS
    from rigpilot.app.wizard.state import default_state

    link, submitted = example_link([])
    page = open_page(qtbot, link)
    empty = page.empty_state
    assert page.detail.stack.currentWidget() is empty and empty.isVisible()
    assert empty.text.text() == NO_JOBS
    empty.example_button.click()
    assert not empty.example_button.isEnabled()  # one click, one job
    qtbot.waitUntil(lambda: page.current_job_id == "job-new", timeout=20000)
    assert empty.example_button.isEnabled() and empty.text.text() == NO_JOB_OPEN
    (sent,) = submitted
    # The wizard's first-run job under the plan the planner recommends: the same spec, written once.
    expected = default_state(link.machine)
    expected.name = sent["spec"]["name"]
    expected.take_plan(sent["plan"])
    assert sent["spec"] == expected.to_spec()
    assert sent["plan"]["parallelism"]["gpu_indices"] == sent["spec"]["gpus"] == [0, 1]
    assert sent["spec"]["train"]["seq_len"] <= 256 and "example" in sent["spec"]["name"]
    qtbot.waitUntil(lambda: page.detail.stack.currentWidget() is not empty)  # filled, then shown a turn later


@pytest.mark.skipif(not __import__("rigpilot.app.wizard.state").app.wizard.state.examples_present(),
                    reason="the shipped examples are missing")  # fmt: skip
def test_the_example_job_takes_free_gpus_and_says_why_it_did_not_start(qtbot):
    link, submitted = example_link([a_job("j1")])  # running on GPUs 0 and 1
    page = open_page(qtbot, link)
    page.empty_state.example_button.click()
    qtbot.waitUntil(lambda: page.current_job_id == "job-new", timeout=20000)  # submitted, and the reply in
    assert submitted[0]["spec"]["gpus"] == [2, 3]

    link.replies["plan"] = EngineError("unavailable", "the planner is busy")
    page.empty_state.example_button.click()
    qtbot.waitUntil(lambda: "did not start" in page.empty_state.status.text())
    assert "the planner is busy" in page.empty_state.status.text()
    assert page.empty_state.example_button.isEnabled() and len(submitted) == 1


def test_new_job_on_the_empty_page_opens_the_wizard(qtbot):
    from rigpilot.app.wizard.wizard import JobWizard

    link = FakeLink()
    FakeJobs(link, [])
    page = open_page(qtbot, link)
    assert page.empty_state.new_button.text() == "New job…"
    page.empty_state.new_button.click()
    wizards = page.findChildren(JobWizard)
    assert len(wizards) == 1 and wizards[0].isVisible() and wizards[0].link is link
    wizards[0].close()


def test_without_the_shipped_example_its_button_says_why(qtbot, monkeypatch):
    monkeypatch.setattr("rigpilot.app.jobs.empty_state.examples_present", lambda: False)
    link = FakeLink()
    FakeJobs(link, [])
    page = open_page(qtbot, link)
    button = page.empty_state.example_button
    assert not button.isEnabled() and "not installed" in button.toolTip()
    page.empty_state.run_example()
    assert "not installed" in page.empty_state.status.text() and not link.requests("plan")
