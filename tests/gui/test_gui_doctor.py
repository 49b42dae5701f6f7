"""The machine check in the window: its view (Settings → Check this machine), the Dashboard's card, and the
Topology page's links, over a FakeLink answering `doctor_report` with reports built by the engine's own code."""

from __future__ import annotations

from PySide6.QtGui import QColor

from rigpilot.app.dashboard.page import DashboardPage
from rigpilot.app.doctor.model import headline, link_marks, progress_line, state_of
from rigpilot.app.doctor.view import MachineCheckView
from rigpilot.app.jobs.page import JobsPage
from rigpilot.app.settings.page import SettingsPage
from rigpilot.app.topology.matrix import BROKEN_TINT
from rigpilot.app.topology.page import TopologyPage
from rigpilot.app.widgets.palette import BAD, tint
from rigpilot.engine.api.client import EngineError
from rigpilot.engine.hardware.doctor import DoctorReport, describe

from support.doctor_gui_reports import broken_report, clean_report, doctor_job, reply
from support.gui_fakes import FakeLink


def open_view(qtbot, link: FakeLink) -> MachineCheckView:
    view = MachineCheckView(link)
    qtbot.addWidget(view)
    view.resize(1100, 700)
    view.show()
    qtbot.waitExposed(view)
    with qtbot.waitSignal(view.sig_shown, timeout=5000):
        link.connect_engine()
    return view


def broken_words() -> list[str]:
    return [describe(f) for f in DoctorReport.from_dict(broken_report()).findings]


# -- the view -------------------------------------------------------------------------------------------
def test_a_report_shows_its_findings_tables_and_simulated_label(qtbot):
    link = FakeLink(replies={"doctor_report": reply(broken_report())})
    view = open_view(qtbot, link)
    assert view.headline.text() == f"Machine check: 2 problems — {broken_words()[0]}"
    assert view.headline.property("status") == "bad"
    assert "2026-11-29 05:00:00 UTC" in view.measured.text() and "stopped early" in view.measured.text()
    assert view.simulated.isVisible() and "CPU" in view.simulated.text()
    shown = [label.text() for label in view.finding_labels]
    assert [t[2:] for t in shown] == broken_words()  # describe's words, worst first
    assert [label.property("status") for label in view.finding_labels] == ["bad", "bad", "info"]
    assert "NCCL_P2P_DISABLE=1" in view.action.text() and "0–1, 2–3" in view.action.text()
    assert view.gpu_table.rowCount() == 4 and view.gpu_table.cell_text(0, 2).startswith("fp32 0.21")
    assert view.gpu_table.cell_text(0, 4) == "skipped"  # no nvidia-smi on a simulated machine
    pairs = {view.pair_table.cell_text(r, 0): r for r in range(view.pair_table.rowCount())}
    corrupt, hung, fine = pairs["0–1"], pairs["2–3"], pairs["0–2"]
    assert view.pair_table.cell_text(corrupt, 3) == "WRONG DATA" and view.pair_table.cell_status(corrupt, 3) == "bad"
    assert view.pair_table.cell_text(hung, 5) == "hung after 10 s" and view.pair_table.cell_status(hung, 5) == "bad"
    assert view.pair_table.cell_text(fine, 3) == "yes" and view.pair_table.cell_text(fine, 5).endswith("GB/s")
    assert view.check_button.isVisible() and not view.cancel_button.isVisible()
    assert not view.message.isVisible() and not view.progress.isVisible()  # no empty lines between the parts


def test_a_clean_report_says_nothing_was_found(qtbot):
    view = open_view(qtbot, FakeLink(replies={"doctor_report": reply(clean_report())}))
    assert view.headline.text() == "Machine check: nothing wrong found"
    assert view.headline.property("status") == "good"
    assert [label.text()[2:] for label in view.finding_labels] == ["Found nothing wrong."]
    assert view.finding_labels[0].property("status") == "good"
    assert not view.action.isVisible()
    assert view.groups.text().startswith("All-reduce over GPUs 0, 1, 2, 3: 2.2 GB/s")


def test_never_checked_says_so_and_offers_the_button(qtbot):
    view = open_view(qtbot, FakeLink(replies={"doctor_report": reply(None, "never")}))
    assert view.headline.text() == "Not checked yet"
    assert view.check_button.isVisible() and view.check_button.isEnabled()
    assert not view.gpu_table.isVisible() and not view.pair_table.isVisible()


def test_a_driver_change_says_so_and_offers_the_button(qtbot):
    view = open_view(qtbot, FakeLink(replies={"doctor_report": reply(None, "driver_changed")}))
    assert view.headline.text() == "The driver changed since the last check: check again"
    assert view.headline.property("status") == "warn"
    assert view.check_button.isVisible() and not view.gpu_table.isVisible()


def test_a_bad_report_is_one_clear_line(qtbot):
    bad = broken_report()
    bad["schema"] = "something/9"
    view = open_view(qtbot, FakeLink(replies={"doctor_report": reply(bad)}))
    assert view.headline.text().startswith("The engine's machine check is not a Rigpilot machine check")
    assert "\n" not in view.headline.text() and view.headline.property("status") == "bad"
    assert not view.gpu_table.isVisible()
    missing = broken_report()
    del missing["measured_at"]
    assert state_of(reply(missing)).error == "The engine's machine check lacks 'measured_at'; check the machine again"
    assert state_of("not an object").error is not None


def test_check_this_machine_runs_shows_progress_cancels_and_shows_the_result(qtbot):
    link = FakeLink(replies={"doctor_report": reply(None, "never")})
    view = open_view(qtbot, link)
    job = doctor_job("doctor-7", state="queued")
    link.replies["doctor_start"] = {"job": job}
    with qtbot.waitSignal(view.sig_started, timeout=5000):
        view.check_button.click()
    assert link.requests("doctor_start") == [{}]
    assert view.cancel_button.isVisible() and not view.check_button.isVisible()
    assert view.progress.text() == "Machine check queued (job doctor-7)"
    assert "doctor-7" in link.watched  # its ranks' status records say which check runs
    link.push_job({**job, "state": "running"})
    link.push_metrics("doctor-7", [{"kind": "status", "phase": "checking", "check": "p2p_copy", "gpus": "0,1"}])
    qtbot.waitUntil(lambda: view.progress.text().endswith("checking peer-to-peer copies between GPUs 0 and 1"))

    link.replies["cancel"] = lambda job, **_: {"job": {**doctor_job(job, state="cancelled")}}
    link.replies["doctor_report"] = reply(None, "never")
    view.cancel_button.click()
    qtbot.waitUntil(lambda: view.check_button.isVisible())
    assert link.requests("cancel") == [{"job": "doctor-7"}]
    assert "doctor-7" not in link.watched and view.headline.text() == "Not checked yet"

    # A second check runs to its end: the job event says so, and the stored report is asked for again.
    link.replies["doctor_start"] = {"job": doctor_job("doctor-8", state="queued")}
    with qtbot.waitSignal(view.sig_started, timeout=5000):
        view.check_button.click()
    link.replies["doctor_report"] = reply(broken_report())
    with qtbot.waitSignal(view.sig_shown, timeout=5000):
        link.push_job(doctor_job("doctor-8", state="completed"))
    assert view.headline.text().startswith("Machine check: 2 problems")
    assert view.check_button.isVisible() and not view.progress.isVisible()


def test_an_ended_check_still_being_stored_is_asked_for_again(qtbot):
    link = FakeLink(replies={"doctor_report": reply(None, "never")})
    view = open_view(qtbot, link)
    answers = [reply(None, "never", running="doctor-9"), reply(clean_report())]
    link.replies["doctor_report"] = lambda **_: answers.pop(0) if len(answers) > 1 else answers[0]
    link.push_job(doctor_job("doctor-9", state="completed"))
    qtbot.waitUntil(lambda: view.headline.text() == "Machine check: nothing wrong found", timeout=5000)
    assert len(link.requests("doctor_report")) >= 3


def test_a_check_already_running_elsewhere_is_shown_with_its_cancel(qtbot):
    link = FakeLink(replies={"doctor_report": reply(clean_report(), running="doctor-3")})
    view = open_view(qtbot, link)
    assert view.cancel_button.isVisible() and view.progress.text() == "Machine check running (job doctor-3)"
    assert view.headline.text() == "Machine check: nothing wrong found"  # the last report stays on screen
    link.replies["doctor_start"] = EngineError("user_error", "a machine check is already running (job doctor-3)",
                                               {"job": "doctor-3"}, reason="doctor_running")  # fmt: skip
    link.replies["doctor_report"] = reply(None, "never")
    view.start_check()
    qtbot.waitUntil(lambda: view.message.isVisible())
    assert view.message.text() == "A machine check is already running (job doctor-3)."


def test_progress_lines():
    assert progress_line({"id": "d", "state": "queued", "waiting_for": [1]}) == (
        "Machine check queued (job d): waiting for GPU 1"
    )
    assert progress_line({"id": "d", "state": "running"}, {"check": "matmul", "gpu": 2}) == (
        "Machine check running (job d): checking matrix multiplication on GPU 2"
    )
    assert progress_line({"id": "d", "state": "running"}, {"check": "all_reduce", "gpus": "0,1,2,3"}) == (
        "Machine check running (job d): checking all-reduce over GPUs 0,1,2,3"
    )


# -- Settings and the Dashboard ---------------------------------------------------------------------------
def test_settings_holds_the_view(qtbot):
    link = FakeLink(replies={"doctor_report": reply(broken_report())})
    page = SettingsPage(link)
    qtbot.addWidget(page)
    page.resize(1130, 700)
    page.show()
    link.connect_engine()
    view = page.show_machine_check()
    assert isinstance(view, MachineCheckView) and page.machine_check_box.title() == "Check this machine"
    qtbot.waitUntil(lambda: view.headline.text().startswith("Machine check: 2 problems"))
    assert SettingsPage().machine_check is None  # without an engine there is nothing to check


def test_dashboard_card_summarises_and_opens_the_view(qtbot):
    link = FakeLink(replies={"doctor_report": reply(broken_report())})
    page = DashboardPage(link)
    qtbot.addWidget(page)
    page.resize(1130, 760)
    page.show()
    with qtbot.waitSignal(page.check_card.source.sig_changed, timeout=5000):
        link.connect_engine()
    card = page.check_card
    assert card.headline == f"Machine check: 2 problems — {broken_words()[0]}"
    assert card.title.text() == "Machine check: 2 problems" and card.text.text() == broken_words()[0]
    assert card.height() <= page.host_panel.height()  # beside the host, taking no room from the GPU cards
    assert card.property("banner") == "bad" and card.button.text() == "Details…"
    with qtbot.waitSignal(page.sig_open_machine_check) as opened:
        card.button.click()
    assert opened.args == [False]

    link.replies["doctor_report"] = reply(None, "never")
    with qtbot.waitSignal(card.source.sig_changed, timeout=5000):
        card.source.refresh()
    assert card.headline == "Not checked yet — check this machine's GPUs and links"
    assert card.property("banner") == "info" and card.button.text() == "Check this machine"
    with qtbot.waitSignal(page.sig_open_machine_check) as opened:
        card.button.click()
    assert opened.args == [True]  # opens the view and starts a check there


def test_the_card_opens_settings_and_starts_a_check_in_the_window(qtbot):
    from rigpilot.app.main_window import MainWindow

    link = FakeLink(replies={"doctor_report": reply(None, "never")})
    link.replies["doctor_start"] = {"job": doctor_job("doctor-1", state="queued")}
    window = MainWindow(link)
    qtbot.addWidget(window)
    window.show()
    link.connect_engine()
    dashboard = window.show_page("dashboard")
    qtbot.waitUntil(lambda: dashboard.check_card.button.text() == "Check this machine")
    dashboard.check_card.button.click()
    assert window.current_page_key() == "settings"
    qtbot.waitUntil(lambda: link.requests("doctor_start") == [{}])
    view = window.pages["settings"].machine_check
    qtbot.waitUntil(lambda: view.cancel_button.isVisible())


# -- the Topology page -------------------------------------------------------------------------------------
def test_topology_marks_measured_and_broken_links(qtbot):
    link = FakeLink(replies={"doctor_report": reply(broken_report())})
    page = TopologyPage(link)
    qtbot.addWidget(page)
    page.resize(1130, 760)
    page.show()
    with qtbot.waitSignal(page.check.sig_changed, timeout=5000):
        link.connect_engine()
    marks = link_marks(DoctorReport.from_dict(broken_report()))
    assert marks[(0, 1)].broken and marks[(2, 3)].broken and not marks[(0, 2)].broken
    assert marks[(2, 3)].text == "hung after 10 s"
    # the matrix: the code stays the cell's code, the figure under it, broken cells in the fail colour
    assert page.matrix.code(0, 1) == "NODE" and page.matrix.item(0, 1).text() == f"NODE\n{marks[(0, 1)].text}"
    assert page.matrix.item(3, 2).text() == "NODE\nhung after 10 s"
    expected = tint(BAD, page.matrix.palette(), BROKEN_TINT)
    assert page.matrix.item(0, 1).background().color() == expected
    assert page.matrix.item(0, 2).background().color() != expected
    assert broken_words()[0] in page.matrix.item(0, 1).toolTip()
    # the graph: one arc per measured pair, broken ones solid in the fail colour with the finding as tooltip
    items = page.graph_view.mark_items
    assert set(items) == set(marks)
    arc, text = items[(0, 1)]
    assert arc.pen().color() == QColor(BAD) and broken_words()[0] in arc.toolTip()
    assert text.text() == "✗ " + marks[(0, 1)].text
    assert items[(0, 2)][1].text() == marks[(0, 2)].text and items[(0, 2)][0].pen().color() != QColor(BAD)
    assert page.check_note.isVisible() and "Broken links" in page.check_note.text()


def test_topology_without_a_report_draws_no_marks(qtbot):
    link = FakeLink(replies={"doctor_report": reply(None, "never")})
    page = TopologyPage(link)
    qtbot.addWidget(page)
    page.show()
    with qtbot.waitSignal(page.check.sig_changed, timeout=5000):
        link.connect_engine()
    assert page.graph_view.mark_items == {} and page.matrix.item(0, 1).text() == page.matrix.code(0, 1)
    assert not page.check_note.isVisible()


def test_headline_counts_only_problems():
    state = state_of(reply(broken_report()))
    assert headline(state)[0] == "bad"
    assert headline(state_of(reply(None, "unreadable"))) == ("warn", "The stored check cannot be read: check again")


def test_an_imported_machine_shows_no_marks_of_this_ones_check(qtbot, smi_data):
    link = FakeLink(replies={"doctor_report": reply(broken_report())})
    page = TopologyPage(link)
    qtbot.addWidget(page)
    page.show()
    with qtbot.waitSignal(page.check.sig_changed, timeout=5000):
        link.connect_engine()
    assert page.graph_view.mark_items
    with qtbot.waitSignal(page.sig_machine_shown, timeout=10000):
        page.import_files([smi_data / "case08_4xRTX6000Ada_dual_socket_genoa_4nics.txt"])
    assert page.graph_view.mark_items == {} and page.matrix.item(0, 1).text() == page.matrix.code(0, 1)
    assert not page.check_note.isVisible()
    page.back_button.click()  # this machine again: its check's marks come back
    assert set(page.graph_view.mark_items) == set(link_marks(DoctorReport.from_dict(broken_report())))


def test_an_8_gpu_drawing_shows_only_the_broken_links_and_the_matrix_every_figure(qtbot):
    link = FakeLink("8x-a100-pcie", replies={"doctor_report": reply(broken_report(gpus=8))})
    page = TopologyPage(link)
    qtbot.addWidget(page)
    page.show()
    with qtbot.waitSignal(page.check.sig_changed, timeout=5000):
        link.connect_engine()
    assert set(page.graph_view.mark_items) == {(0, 1), (2, 3)}  # 28 arcs would hide the machine
    marks = link_marks(DoctorReport.from_dict(broken_report(gpus=8)))
    assert len(marks) == 28 and page.matrix.item(4, 7).text() == f"{page.matrix.code(4, 7)}\n{marks[(4, 7)].text}"
    assert "the drawing shows the broken links only" in page.check_note.text()


def test_another_machine_is_asked_about_once_and_the_same_one_not_again(qtbot):
    link = FakeLink(replies={"doctor_report": reply(broken_report())})
    view = open_view(qtbot, link)
    assert len(link.requests("doctor_report")) == 1  # connecting brought the machine: one question, not two
    link.sig_machine.emit(dict(link.machine))
    qtbot.wait(20)
    assert len(link.requests("doctor_report")) == 1
    link.replies["doctor_report"] = reply(None, "never")
    with qtbot.waitSignal(view.sig_shown, timeout=5000):
        link.sig_machine.emit({**link.machine, "label": "simulated: 8×H100 80GB HBM3"})
    assert view.headline.text() == "Not checked yet" and not view.gpu_table.isVisible()


def test_the_card_says_a_check_runs_and_then_what_it_found(qtbot):
    link = FakeLink(replies={"doctor_report": reply(None, "never")})
    page = DashboardPage(link)
    qtbot.addWidget(page)
    page.show()
    with qtbot.waitSignal(page.check_card.source.sig_changed, timeout=5000):
        link.connect_engine()
    card = page.check_card
    with qtbot.waitSignal(card.source.sig_changed, timeout=5000):
        link.push_job(doctor_job("doctor-5", state="running"))
    assert card.headline == "Machine check running…" and card.button.text() == "Details…"
    link.replies["doctor_report"] = reply(clean_report())
    with qtbot.waitSignal(card.source.sig_changed, timeout=5000):
        link.push_job(doctor_job("doctor-5", state="completed"))
    assert card.headline == "Machine check: nothing wrong found" and card.property("banner") == "good"


def test_a_failed_cancel_says_so_in_one_line(qtbot):
    link = FakeLink(replies={"doctor_report": reply(None, "never", running="doctor-4")})
    view = open_view(qtbot, link)
    link.replies["cancel"] = EngineError("not_found", "no job doctor-4")
    view.cancel_button.click()
    qtbot.waitUntil(lambda: view.message.isVisible())
    assert view.message.text() == "Could not cancel the machine check: no job doctor-4"
    assert view.cancel_button.isEnabled()


def test_a_machine_check_job_shows_what_it_found_not_training_charts(qtbot):
    """A doctor job's page: the Machine check tab (the view Settings holds), no loss charts, nothing to resume."""
    from rigpilot.app.jobs.detail import CHARTS_TAB, CHECK_TAB, PLAN_TAB

    job = doctor_job("d0c7", state="failed")
    link = FakeLink("4x-rtx4090", jobs=[job])
    link.replies["doctor_report"] = reply(broken_report())
    page = JobsPage(link)
    qtbot.addWidget(page)
    link.connect_engine()
    page.open_job("d0c7")
    detail = page.detail
    qtbot.waitUntil(lambda: detail.tabs.isTabVisible(CHECK_TAB))
    assert not detail.tabs.isTabVisible(CHARTS_TAB) and not detail.tabs.isTabVisible(PLAN_TAB)
    assert detail.tabs.currentIndex() == CHECK_TAB
    assert not detail.resume_button.isEnabled() and not detail.clone_button.isEnabled()
    qtbot.waitUntil(lambda: "2 problems" in detail.check_view.headline.text())
