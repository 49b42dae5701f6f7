"""The Dashboard page, driven by a fake engine link (no service, no GPU)."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from PySide6.QtCore import QSettings
from PySide6.QtGui import QColor, QImage, QPalette
from PySide6.QtWidgets import QLabel

from rigpilot.app.dashboard.model import HISTORY_ROWS, METRICS, DashboardModel
from rigpilot.app.dashboard.page import DashboardPage
from rigpilot.app.widgets.ring_buffer import RingBuffer
from rigpilot.engine.hardware.simulated import list_profiles

from support.gui_fakes import FakeLink, focusable_widgets, make_job, tab_through

PROFILES = [p["id"] for p in list_profiles()]




def open_page(qtbot, link: FakeLink) -> DashboardPage:
    page = DashboardPage(link)
    qtbot.addWidget(page)
    page.resize(1280, 900)
    page.show()
    qtbot.waitExposed(page)
    with qtbot.waitSignal(page.sig_history_loaded, timeout=5000):
        link.connect_engine()
    return page


@pytest.mark.parametrize("profile", PROFILES)
def test_renders_every_simulated_profile(qtbot, profile):
    link = FakeLink(profile, history_seconds=30)
    link.feed.set_load(0)
    page = open_page(qtbot, link)
    link.push_telemetry(3)
    page.refresh(force=True)
    n = len(link.machine_obj.gpus)
    assert sorted(page.cards) == [g.index for g in link.machine_obj.gpus]
    assert len(page.chart.checkboxes) == n
    t, values = page.chart.data()
    assert values.shape == (n, len(t)) and len(t) >= 30
    assert page.cards[0].util.text().endswith("%")
    assert page.host_panel.cpu.text().endswith("threads")


def test_cards_show_na_with_the_reason_for_unsupported_fields(qtbot):
    link = FakeLink("8x-a100-pcie")  # passively cooled: no fan reading
    page = open_page(qtbot, link)
    link.push_telemetry(2)
    page.refresh(force=True)
    card = page.cards[0]
    assert card.fan.text() == "n/a"
    assert "passively cooled" in card.fan.toolTip()
    assert card.value_reason("fan_pct") == "not supported (passively cooled)"
    assert card.temp.text() != "n/a" and card.value_reason("temperature_c") is None

    # A field the engine marks unavailable reads n/a, never 0.
    sample = link.feed.sample()
    for g in sample["gpus"]:
        g["memory_used"] = None
        g["power_w"] = None
        g["unavailable"].update(memory_used="no permission", power_w="not supported")
    link.sig_telemetry.emit(sample)
    page.refresh(force=True)
    assert card.memory.text() == "n/a" and "no permission" in card.memory.toolTip()
    assert card.power.text() == "n/a" and "not supported" in card.power.toolTip()


def test_chart_marks_series_a_gpu_cannot_report(qtbot):
    link = FakeLink("4x-rtx4090")  # no NVLink
    page = open_page(qtbot, link)
    link.push_telemetry(2)
    page.set_metric("nvlink_rx_bps")
    box = page.chart.checkboxes[0]
    assert "n/a" in box.text() and "no NVLink" in box.toolTip()
    _, values = page.chart.data()
    assert np.isnan(values).all()  # drawn as a gap, not as zero
    assert "n/a" in page.chart.readout.text()


def test_history_fills_the_chart_on_connect_and_after_a_reconnect(qtbot):
    link = FakeLink("2x-rtx3090-nvlink", history_seconds=600)
    page = open_page(qtbot, link)
    assert len(page.model.history) == 600
    first = link.requests("telemetry_history")[0]
    assert first["since"] < link.history[0]["time"]

    # While disconnected, the engine keeps recording; the page learns of it only from the history.
    link.lose_engine()
    missed = link.feed.history(0) or [link.feed.sample() for _ in range(30)]
    link.history.extend(missed)
    with qtbot.waitSignal(page.sig_history_loaded, timeout=5000) as loaded:
        link.connect_engine()
    assert loaded.args == [30]
    assert link.requests("telemetry_history")[-1]["since"] == pytest.approx(missed[0]["time"] - 1.0)
    assert len(page.model.history) == 630


def test_history_is_read_page_by_page(qtbot, monkeypatch):
    monkeypatch.setattr("rigpilot.app.dashboard.page.HISTORY_PAGE", 100)
    link = FakeLink("1x-rtx4090", history_seconds=350)
    page = open_page(qtbot, link)
    assert len(page.model.history) == 350
    assert len(link.requests("telemetry_history")) == 4


def test_live_samples_arriving_before_history_stay_in_order(qtbot):
    link = FakeLink("1x-rtx4090", history_seconds=60)
    page = DashboardPage(link)
    qtbot.addWidget(page)
    link.connect_engine()
    link.push_telemetry(5)  # live samples arrive before the history reply
    qtbot.waitSignal(page.sig_history_loaded, timeout=5000).wait()
    t, _ = page.model.history.window()
    assert len(t) == 65 and np.all(np.diff(t) > 0)


@pytest.mark.parametrize("metric", [m.key for m in METRICS])
def test_chart_switches_metric(qtbot, metric):
    link = FakeLink("8x-a100-pcie", history_seconds=20)
    link.feed.set_load(0)
    page = open_page(qtbot, link)
    with qtbot.waitSignal(page.sig_metric_changed, raising=False):
        page.set_metric(metric)
    title = next(m.title for m in METRICS if m.key == metric)
    assert page.metric_box.currentText() == title
    assert title in page.chart.plot.getPlotItem().getAxis("left").labelText
    t, values = page.chart.data()
    assert values.shape == (8, len(t))


def test_chart_switches_time_window(qtbot):
    link = FakeLink("4x-rtx4090", history_seconds=900)
    page = open_page(qtbot, link)
    sizes = {}
    for label, seconds in (("1 min", 60.0), ("10 min", 600.0), ("1 h", 3600.0)):
        page.set_window(seconds)
        t, _ = page.chart.data()
        sizes[label] = len(t)
        x0, x1 = page.chart.plot.getPlotItem().getViewBox().viewRange()[0]
        assert x1 - x0 == pytest.approx(seconds, rel=0.01)
        assert next(b for b in page.window_buttons if b.text() == label).isChecked()
    assert sizes == {"1 min": 61, "10 min": 601, "1 h": 900}


def test_export_png_and_csv(qtbot, tmp_path):
    link = FakeLink("4x-rtx4090", history_seconds=120)
    link.feed.set_load(1, utilization=80)
    page = open_page(qtbot, link)
    page.set_metric("power_w")
    page.chart.set_series_visible(2, False)

    png = tmp_path / "chart.png"
    with qtbot.waitSignal(page.sig_exported) as done:
        page.export_png(png)
    assert done.args == [str(png)]
    image = QImage(str(png))
    assert not image.isNull() and image.width() > 100

    out = tmp_path / "chart.csv"
    with qtbot.waitSignal(page.sig_exported, timeout=5000):
        page.export_csv(out)
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["time", "unix_time", "Power GPU 0 (W)", "Power GPU 1 (W)", "Power GPU 3 (W)"]
    assert len(rows) - 1 == 61  # the one-minute window
    assert all(float(r[2]) > 0 for r in rows[1:])
    assert "Saved" in page.status.text()


def test_export_to_a_bad_path_says_why(qtbot, tmp_path):
    link = FakeLink("1x-rtx4090", history_seconds=5)
    page = open_page(qtbot, link)
    with qtbot.waitSignal(page.sig_message, timeout=5000) as message:
        page.export_csv(tmp_path / "missing-folder" / "x.csv")
    assert "could not save" in message.args[0]


def test_pause_freezes_the_chart_and_resume_catches_up(qtbot):
    link = FakeLink("1x-rtx4090", history_seconds=10)
    page = open_page(qtbot, link)
    page.set_paused(True)
    before, _ = page.chart.data()
    link.push_telemetry(5)
    page.refresh(force=True)
    assert len(page.chart.data()[0]) == len(before)
    assert page.pause_button.text() == "Resume"
    page.pause_button.click()
    assert len(page.chart.data()[0]) == len(before) + 5


def test_hover_readout_and_series_toggles(qtbot):
    link = FakeLink("2x-rtx3090-nvlink", history_seconds=30)
    page = open_page(qtbot, link)
    link.feed.set_load(0, utilization=90)
    link.push_telemetry(10)
    page.refresh(force=True)
    t, _ = page.chart.data()
    text = page.chart.hover_at(float(t[-1]))
    assert page.chart.crosshair.isVisible()
    assert "GPU 0: 90 %" in text and "GPU 1:" in text
    page.chart.checkboxes[1].click()
    assert not page.chart._curves[1].isVisible()
    assert "GPU 1" not in page.chart.hover_at(float(t[-1]))
    page.chart.leave_hover()
    assert page.chart.readout.text().startswith("now")


def test_cards_show_the_job_on_each_gpu(qtbot):
    link = FakeLink("4x-rtxa6000-bridged", jobs=[make_job("j1", [0, 1], name="llama-ft")])
    page = open_page(qtbot, link)
    qtbot.waitUntil(lambda: bool(page.model.jobs))
    link.push_telemetry(1)
    page.refresh(force=True)
    assert "llama-ft" in page.cards[0].job.full_text and "llama-ft" in page.cards[1].job.full_text
    assert page.cards[2].job.full_text == "No job"
    link.push_job(make_job("j1", [0, 1], state="completed", name="llama-ft"))
    page.refresh(force=True)
    assert page.cards[0].job.full_text == "No job"


def test_process_table_lists_gpu_processes_per_gpu(qtbot):
    link = FakeLink("4x-rtx4090")
    link.feed.set_load(2, memory_gib=10, pid=4242, command="python train.py")
    page = open_page(qtbot, link)
    link.push_telemetry(2)
    page.refresh(force=True)
    table = page.processes
    assert table.rowCount() == 1
    cells = [table.item(0, c).text() for c in range(table.columnCount())]
    assert cells == ["2", "4242", "n/a", "10240 MiB", "python train.py"]
    assert table.item(0, 2).toolTip()  # why the user is n/a
    page.process_filter.setCurrentIndex(page.process_filter.findData(1))
    assert table.item(0, 0).text() == "No processes on the GPUs"


def test_redraws_only_while_visible(qtbot):
    link = FakeLink("1x-rtx4090", history_seconds=5)
    page = open_page(qtbot, link)
    page.refresh()
    assert page.timer.isActive()
    page.hide()
    assert not page.timer.isActive()
    drawn = page._drawn_revision
    link.push_telemetry(3)
    page.refresh()
    assert page._drawn_revision == drawn
    page.show()
    assert page._drawn_revision == page.model.revision


def test_history_memory_is_bounded():
    model = DashboardModel()
    from rigpilot.app.dashboard.model import GIB  # noqa: F401 -- the module's unit, used by the figures below

    link_machine = FakeLink("8x-h100-sxm").machine_obj
    model.set_machine(link_machine)
    assert model.history.capacity == HISTORY_ROWS == 36000
    # 8 GPUs × 10 metrics + 2 host columns, float32, plus float64 times: about 12 MB whatever runs how long.
    assert model.history.nbytes <= 36000 * (82 * 4 + 8)


def test_ring_buffer_wraps_and_merges_late_rows():
    ring = RingBuffer(5, 2)
    for i in range(8):
        ring.append(float(i), [i, 10 * i])
    t, v = ring.window()
    assert t.tolist() == [3, 4, 5, 6, 7] and v[1].tolist() == [30, 40, 50, 60, 70]
    t, v = ring.window(since=5.5, columns=[0])
    assert t.tolist() == [6, 7] and v.shape == (1, 2)
    ring.merge(np.array([4.5, 5.0, 8.0]), np.array([[45, 450], [99, 990], [80, 800]]))
    t, v = ring.window()
    assert t.tolist() == [4, 4.5, 5, 6, 7, 8][-5:]
    assert v[0].tolist() == [45, 5, 6, 7, 80]  # the stored row at t=5 won over the replayed one


def test_state_is_saved_and_restored(qtbot):
    link = FakeLink("1x-rtx4090", history_seconds=5)
    page = open_page(qtbot, link)
    page.set_metric("temperature_c")
    page.set_window(600.0)
    settings = QSettings()
    page.save_state(settings, "pages/dashboard")
    other = DashboardPage(FakeLink("1x-rtx4090"))
    qtbot.addWidget(other)
    other.restore_state(settings, "pages/dashboard")
    assert other.metric == "temperature_c" and other.window == 600.0


def test_plot_background_follows_the_palette(qtbot):
    link = FakeLink("1x-rtx4090", history_seconds=5)
    page = open_page(qtbot, link)
    dark = QPalette(page.palette())
    dark.setColor(QPalette.ColorRole.Window, QColor("#202124"))
    dark.setColor(QPalette.ColorRole.Base, QColor("#17181a"))
    dark.setColor(QPalette.ColorRole.Text, QColor("#e8eaed"))
    page.setPalette(dark)
    assert page.chart.plot.backgroundBrush().color() == QColor("#17181a")


def test_tab_reaches_every_control(qtbot):
    link = FakeLink("4x-rtx4090", history_seconds=5)
    page = open_page(qtbot, link)
    expected = focusable_widgets(page)
    visited = tab_through(page, qtbot)
    missing = [w.objectName() or type(w).__name__ for w in expected if w not in visited]
    assert not missing
    names = {w.objectName() for w in visited}
    assert {"metric", "pause", "exportPng", "exportCsv", "processGpu", "processTable", "chartPlot"} <= names


@pytest.mark.parametrize("profile", ["1x-rtx4090", "4x-rtx4090", "8x-a100-pcie"])
def test_the_cards_pane_fits_its_cards_until_the_user_sizes_it(qtbot, profile):
    page = open_page(qtbot, FakeLink(profile))
    content = page.cards_area.widget().sizeHint().height() + 2 * page.cards_area.frameWidth()
    total = sum(page.splitter.sizes())
    qtbot.waitUntil(lambda: page.splitter.sizes()[0] == min(content, int(total * 0.6)), timeout=3000)
    top, chart, _ = page.splitter.sizes()
    assert chart > top / 2  # the chart gets the room the cards do not need
    # Once the user drags the splitter, their sizes stay, and only theirs are saved.
    settings = QSettings()
    page.save_state(settings, "fit")
    assert settings.value("fit/splitter") is None
    page.splitter.splitterMoved.emit(100, 1)
    page.splitter.setSizes([100, total - 200, 100])
    page.resize(1280, 700)
    qtbot.wait(50)
    assert page.splitter.sizes()[0] == 100
    page.save_state(settings, "fit")
    assert settings.value("fit/splitter") is not None


def test_a_long_job_name_is_elided_on_the_card_and_whole_in_its_tooltip(qtbot):
    from rigpilot.app.dashboard.gpu_card import GpuCard
    from rigpilot.engine.hardware.simulated import load_profile

    card = GpuCard(load_profile("8x-h100-sxm").gpus[0])
    qtbot.addWidget(card)
    name = "a-rather-long-job-name-for-the-card-that-never-fits"
    card.show_sample({"index": 0, "sm_clock_mhz": 1940, "fan_pct": 40.0}, [{"id": "j1", "name": name, "state": "running"}])
    card.resize(card.minimumSizeHint().width(), card.sizeHint().height())
    card.show()
    qtbot.waitExposed(card)
    shown = card.job.text()
    assert shown.endswith("…") and shown[:-1] in f"Job: {name} (running)"  # one line, cut at the end
    assert card.job.fontMetrics().horizontalAdvance(shown) <= card.job.width()
    assert card.job.toolTip() == f"j1: {name} (running)"
    card.resize(2000, card.height())
    qtbot.waitUntil(lambda: card.job.text() == f"Job: {name} (running)")
    # Each number has its own label: "Fan · SM" over two numbers read as one.
    labels = {w.text() for w in card.findChildren(QLabel)}
    assert {"Fan", "SM clock"} <= labels and "Fan · SM" not in labels
    assert card.clock.text() == "1,940 MHz" and card.fan.text() == "40 %"


@pytest.mark.parametrize("profile, compact", [("8x-h100-sxm", True), ("4x-rtx4090", False)])
def test_every_card_of_an_8_gpu_box_shows_whole_at_1280_by_800(qtbot, profile, compact):
    """All GPUs at a glance, as nvitop shows an 8-GPU box: with a second row the cards read on fewer lines, so
    every card lies inside the pane with nothing to scroll, and no title or reading ends in "…"."""
    link = FakeLink(profile, history_seconds=30)
    page = DashboardPage(link)
    qtbot.addWidget(page)
    page.resize(1118, 734)  # what the main window leaves a page on a 1280×800 screen
    page.show()
    qtbot.waitExposed(page)
    with qtbot.waitSignal(page.sig_history_loaded, timeout=5000):
        link.connect_engine()
    link.push_telemetry(3)
    page.refresh(force=True)
    qtbot.wait(50)  # the pane is fitted to its cards in the event loop
    area = page.cards_area
    assert not area.horizontalScrollBar().isVisible() and not area.verticalScrollBar().isVisible()
    view = area.viewport().rect()
    assert len(page.cards) == len(link.machine_obj.gpus)
    for card in page.cards.values():
        assert card.compact is compact
        corner = card.mapTo(area.viewport(), card.rect().topLeft())
        assert view.contains(corner) and view.contains(corner + card.rect().bottomRight()), card.index
        assert card.title.text() == card.title.full_text, card.title.text()
        assert card.job.isVisible() and card.job.text() == card.job.full_text
        if compact:
            assert card.readings.isVisible() and card.readings.text() == card.readings.full_text
            assert "°C" in card.readings.text() and not card.sparks["gpu_util"].isVisible()


def test_cards_of_a_machine_switched_to_while_the_dashboard_was_hidden_show_whole(qtbot):
    """Settings switched the machine to 8 GPUs while another page was shown: back on the dashboard, its pane
    is fitted to the eight cards (it had kept the four cards' height, cutting the second row)."""
    from support.gui_fakes import make_machine

    link = FakeLink("4x-rtx4090", history_seconds=30)
    page = DashboardPage(link)
    qtbot.addWidget(page)
    page.resize(1118, 700)
    page.show()
    qtbot.waitExposed(page)
    link.connect_engine()
    qtbot.wait(50)
    page.hide()
    link.machine_obj = make_machine("8x-h100-sxm")
    link.machine = link.machine_obj.to_dict()
    link.sig_machine.emit(link.machine)
    qtbot.wait(50)
    page.show()
    qtbot.wait(50)
    area = page.cards_area
    assert len(page.cards) == 8 and not area.verticalScrollBar().isVisible()
    view = area.viewport().rect()
    for card in page.cards.values():
        corner = card.mapTo(area.viewport(), card.rect().topLeft())
        assert view.contains(corner + card.rect().bottomRight()), card.index
