"""Charts from a user's chair: the wheel scrolls the page, the job's charts fit the window on a 1280x800 screen,
titles are whole, legends stay off the data, and a simulated machine's plan is called a GPU plan."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PySide6.QtCore import QPoint, QPointF, QRect, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication, QScrollArea, QVBoxLayout, QWidget

from rigpilot.app.jobs.charts import StepPlot, compact, round_up
from rigpilot.app.main_window import MainWindow
from rigpilot.app.widgets.time_chart import TimeChart
from rigpilot.app.widgets.window_size import small_screen_size

from support.gui_fakes import FakeLink, make_job
from support.gui_jobs import GIB, FakeJobs, step_record

FIRST = small_screen_size()  # the window as it opens on a 1280×800 screen, title bar included

# A tiny model's plan on a simulated 4xRTX 4090, as `rigpilot plan --json` gives it.
PLAN = {"peak_memory_bytes": 1_002_710_131, "tokens_per_s": 4.662e6, "step_time_s": 0.0002}


def wheel(widget: QWidget, modifiers: Qt.KeyboardModifier = Qt.KeyboardModifier.NoModifier) -> QWheelEvent:
    """One notch towards the user over the middle of `widget`'s viewport; the event, to see who took it."""
    view = widget.viewport()
    centre = QPointF(view.width() / 2, view.height() / 2)
    event = QWheelEvent(
        centre, QPointF(view.mapToGlobal(centre.toPoint())), QPoint(0, 0), QPoint(0, -120),
        Qt.MouseButton.NoButton, modifiers, Qt.ScrollPhase.NoScrollPhase, False,
    )  # fmt: skip
    QApplication.sendEvent(view, event)
    return event


def in_scroll_area(qtbot, chart: QWidget) -> QScrollArea:
    page = QWidget()
    layout = QVBoxLayout(page)
    layout.addWidget(chart)
    layout.addSpacing(2000)
    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setWidget(page)
    area.resize(600, 400)
    qtbot.addWidget(area)
    area.show()
    qtbot.waitExposed(area)
    return area


def test_the_wheel_over_a_chart_is_left_to_the_page_and_ctrl_wheel_zooms(qtbot):
    plot = StepPlot("Loss")
    plot.getPlotItem().plot(np.arange(100.0), np.arange(100.0))
    area = in_scroll_area(qtbot, plot)
    vb = plot.getPlotItem().getViewBox()
    before = vb.viewRange()

    event = wheel(plot)
    # Not accepted: Qt hands a real wheel turn on to the chart's parents, and the scroll area scrolls.
    assert not event.isAccepted()
    assert vb.viewRange() == before

    event = wheel(plot, Qt.KeyboardModifier.ControlModifier)
    assert event.isAccepted()
    assert vb.viewRange() != before
    # The scroll area scrolls with that same turn when it gets it.
    QApplication.sendEvent(area.viewport(), QWheelEvent(
        QPointF(10, 10), QPointF(10, 10), QPoint(0, 0), QPoint(0, -120),
        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False,
    ))  # fmt: skip
    assert area.verticalScrollBar().value() > 0


def test_the_dashboards_live_chart_leaves_the_wheel_to_the_page_too(qtbot):
    chart = TimeChart()
    chart.set_series(["GPU 0"])
    chart.set_data(np.arange(10.0), np.ones((1, 10)))
    area = in_scroll_area(qtbot, chart)  # kept: the area owns the chart
    assert not wheel(chart.plot).isAccepted()
    # Ctrl+wheel is the chart's, even live (it zooms once paused): it must not scroll the page either.
    assert wheel(chart.plot, Qt.KeyboardModifier.ControlModifier).isAccepted()
    assert area.verticalScrollBar().value() == 0


def open_window_on_job(qtbot, job: dict[str, Any], steps: int = 40, width: int = FIRST.width()) -> MainWindow:
    link = FakeLink("4x-rtx4090")
    engine = FakeJobs(link, [job])
    engine.records[job["id"]] = [step_record(s, rank) for s in range(1, steps + 1) for rank in (0, 1)]
    window = MainWindow(link)
    qtbot.addWidget(window)
    window.resize(width, FIRST.height())
    window.show()
    qtbot.waitExposed(window)
    link.connect_engine()
    qtbot.waitUntil(lambda: window.machine_label.text() != "")
    window.show_page("jobs")
    page = window.pages["jobs"]
    qtbot.waitUntil(lambda: page.model.rowCount() == 1)
    page.open_job(job["id"])
    handle = page.current_handle
    qtbot.waitUntil(lambda: handle.history_loaded and handle.record.get("state") is not None)
    page.refresh(force=True)
    QApplication.processEvents()
    return window


def a_job(job_id: str = "j1", *, simulated: bool = True, predicted: dict[str, Any] | None = None) -> dict[str, Any]:
    job = make_job(job_id, gpus=[0, 1], state="completed", name=f"run {job_id}")  # closing asks nothing
    job.update(job_dir=f"/tmp/rigpilot-jobs/{job_id}", run=1, cancel_requested=False, progress=None,
               simulated=simulated, predicted=predicted)  # fmt: skip
    return job


def visible_in(widget: QWidget, area: QScrollArea) -> bool:
    """Whether all of `widget` lies inside what `area` shows, without scrolling."""
    view = area.viewport()
    top_left = widget.mapTo(view, QPoint(0, 0))
    return QRect(QPoint(0, 0), view.size()).contains(QRect(top_left, widget.size()))


def test_every_job_chart_is_on_screen_in_the_first_window_on_a_1280x800_screen(qtbot):
    window = open_window_on_job(qtbot, a_job(predicted=PLAN))
    charts = window.pages["jobs"].detail.charts
    area = charts.parentWidget()
    while area is not None and not isinstance(area, QScrollArea):
        area = area.parentWidget()
    assert area is not None
    named = {"lossChart", "lrChart", "speedChart", "stepTimeChart", "mfuChart", "peakMemoryChart", "gpuMemoryChart"}
    shown = {c.objectName() for c in charts.charts() if visible_in(c, area)}
    assert named <= shown, f"below the fold: {named - shown}"
    assert area.verticalScrollBar().maximum() == 0  # nothing to scroll to
    for chart in charts.charts():
        assert chart.height() >= 110, chart.objectName()  # small, but a chart, not a strip
    heights = [c.height() for c in charts.charts()]
    assert max(heights) - min(heights) <= 2, heights  # the two rows share the height: loss is not the short one


@pytest.mark.parametrize(("simulated", "width"), [(True, FIRST.width()), (False, FIRST.width()), (True, 1000)])
def test_chart_titles_are_whole_and_the_legend_is_off_the_data(qtbot, simulated, width):
    # A plan far off what the ranks measure: the longest titles the charts write.
    window = open_window_on_job(qtbot, a_job(simulated=simulated, predicted=PLAN), width=width)
    charts = window.pages["jobs"].detail.charts
    assert charts.columns == (4 if width == FIRST.width() else 2)  # a narrow page: two columns, not cramped charts
    for plot in (charts.loss, charts.lr, charts.speed, charts.step_time, charts.mfu, charts.memory_per_rank):
        label = plot.getPlotItem().titleLabel
        text_width = label.item.boundingRect().width()
        assert 0 < text_width <= plot.viewport().width(), f"{plot.title_text()!r} is cut"
        assert "e+" not in plot.title_text()  # numbers read with units, not 4.662e+06
    legend = charts.loss.legend
    assert legend is not None and len(legend.items) == 3
    data_area = charts.loss.getPlotItem().getViewBox().sceneBoundingRect()
    assert not legend.sceneBoundingRect().intersects(data_area)


def test_a_simulated_machines_plan_is_called_a_gpu_plan_and_not_drawn(qtbot):
    window = open_window_on_job(qtbot, a_job(simulated=True, predicted=PLAN))
    detail = window.pages["jobs"].detail
    charts = detail.charts
    for plot in (charts.speed, charts.step_time):
        assert not plot.prediction.isVisible()
        assert "GPU plan" in plot.title_text()
        assert "CPU ranks" in plot.toolTip()
    assert charts.speed.title_text() == "Tokens/s per GPU · GPU plan 2.33M"  # the job's 4.66M over two GPUs
    assert charts.step_time.title_text() == "Step time · GPU plan 200 µs"
    assert charts.memory_per_rank.title_text() == "Peak memory · GPU plan 0.93 GiB"
    assert charts.mfu.title_text() == "MFU (%)"  # the steps carry an MFU

    table = detail.prediction
    headers = [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())]
    assert headers[0] == "Plan (for real GPUs)" and "CPU" in headers[1]
    assert table.text("step_time_s", 0) == "0.2 ms"  # not "0 ms"
    assert table.text("step_time_s", 2) == "2,500 × (CPU vs GPU)"  # 0.5 s measured against 0.2 ms
    assert table.text("tokens_per_s", 2).startswith("0.00044 ×")  # not "0.00 ×"
    assert "CPU ranks" in table.toolTip()


def test_a_real_machines_plan_is_drawn_and_its_table_says_plan(qtbot):
    plan = {"peak_memory_bytes": 10 * GIB, "tokens_per_s": 4000.0, "step_time_s": 0.25}
    window = open_window_on_job(qtbot, a_job(simulated=False, predicted=plan))
    detail = window.pages["jobs"].detail
    assert detail.charts.speed.prediction.isVisible()
    assert detail.charts.speed.title_text() == "Tokens/s per GPU · plan 2k"
    assert detail.prediction.horizontalHeaderItem(0).text() == "Plan"
    assert "CPU" not in detail.prediction.text("step_time_s", 2)


def test_a_figure_the_job_does_not_report_is_named_not_left_blank(qtbot):
    page_job = a_job(simulated=True, predicted=PLAN)
    window = open_window_on_job(qtbot, page_job, steps=0)
    page = window.pages["jobs"]
    page.current_handle.link.push_metrics(page_job["id"], [step_record(s, 0, mfu=None) for s in range(1, 11)])
    page.refresh(force=True)
    mfu = page.detail.charts.mfu
    assert mfu.title_text() == "MFU (%) · not reported"
    assert "do not report" in mfu.toolTip()


def test_a_chart_too_narrow_for_its_title_shows_the_short_one(qtbot):
    plot = StepPlot("Tokens/s per GPU", name="speedChart")
    qtbot.addWidget(plot)
    plot.show_prediction(2.5e6, np.full(10, 5000.0), simulated=True)
    plot.resize(600, 200)
    plot.show()
    qtbot.waitExposed(plot)
    assert plot.title_text() == "Tokens/s per GPU · GPU plan 2.5M"
    plot.resize(150, 200)
    assert plot.title_text() == "Tokens/s per GPU"
    assert "GPU plan: 2.5M" in plot.toolTip()  # what the title leaves out


def test_numbers_read_with_units():
    assert compact(4.662e6) == "4.66M"
    assert compact(0.0002, "s") == "200 µs"
    assert compact(0.0125, "s") == "12.5 ms"
    assert compact(2.5, "s") == "2.5 s"
    assert compact(950.0) == "950"
    assert [round_up(v) for v in (0.7, 1, 1.2, 1999, 2001, 37_000)] == [0.8, 1, 1.5, 2000, 3000, 40_000]
