"""Check this machine, end to end: the view's button, a real engine service, a real doctor job of gloo CPU ranks.

The engine (a subprocess on the simulated 4×RTX 4090, its XDG folders in tmp_path) has a corrupt link planted
between GPUs 0 and 1; the click goes through the real EngineLink, the job's events come back over its
subscription, and the view shows the report the engine stored, the finding in the engine's own words.
"""

import pytest

from rigpilot.app.doctor.view import MachineCheckView
from rigpilot.app.engine_link import CONNECTED, EngineLink
from rigpilot.engine.hardware.doctor import DoctorReport, describe

from support.engine import Engine, engine_home, leftover_job_processes
from support.paths import REPO

pytestmark = pytest.mark.slow


@pytest.fixture
def engine(tmp_path, monkeypatch):
    engine_home(tmp_path, monkeypatch)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    e = Engine(tmp_path)
    e.start()
    yield e
    e.stop()
    for p in leftover_job_processes(tmp_path):
        p.kill()


def test_check_this_machine_runs_a_real_check_and_shows_what_it_found(qtbot, engine):
    with engine.client() as c:
        c.request("simulate_link_fault", gpus=[0, 1], fault="corrupt")
    link = EngineLink()
    view = MachineCheckView(link)
    qtbot.addWidget(view)
    view.show()
    link.start()
    try:
        qtbot.waitUntil(lambda: link.state == CONNECTED and view.headline.text() == "Not checked yet", timeout=20000)
        with qtbot.waitSignal(view.sig_started, timeout=20000) as started:
            view.check_button.click()
        job = started.args[0]
        assert job["kind"] == "doctor" and job["gpus"] == [0, 1, 2, 3]
        assert view.cancel_button.isVisible() and view.progress.text().startswith("Machine check")
        qtbot.waitUntil(lambda: view.check_button.isVisible(), timeout=180_000)  # the job ended, its report kept
        with engine.client() as c:
            stored = DoctorReport.from_dict(c.request("doctor_report")["report"])
        corrupt = next(f for f in stored.findings if f.code == "p2p_corrupt")
        assert corrupt.gpus == [0, 1]
        assert view.headline.text().startswith("Machine check: ") and describe(corrupt) in view.headline.text()
        assert view.simulated.isVisible() and view.gpu_table.rowCount() == 4 and view.pair_table.rowCount() == 6
        pairs = {view.pair_table.cell_text(r, 0): r for r in range(view.pair_table.rowCount())}
        assert view.pair_table.cell_text(pairs["0–1"], 3) == "WRONG DATA"
    finally:
        link.stop()


def test_cancel_stops_the_real_check_and_the_view_offers_it_again(qtbot, engine):
    link = EngineLink()
    view = MachineCheckView(link)
    qtbot.addWidget(view)
    view.show()
    link.start()
    try:
        qtbot.waitUntil(lambda: link.state == CONNECTED and view.check_button.isVisible(), timeout=20000)
        with qtbot.waitSignal(view.sig_started, timeout=20000) as started:
            view.check_button.click()
        view.cancel_button.click()
        qtbot.waitUntil(lambda: view.check_button.isVisible(), timeout=120_000)
        with engine.client() as c:
            assert c.request("job", job=started.args[0]["id"])["job"]["state"] == "cancelled"
        assert view.headline.text() == "Not checked yet" and not view.progress.isVisible()
    finally:
        link.stop()
