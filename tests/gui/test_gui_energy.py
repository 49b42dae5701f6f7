"""The job Summary's "Energy and cost" section shows the engine's figures, and says how to set a price."""

from __future__ import annotations

import pytest

from rigpilot.app.jobs.detail import SUMMARY_TAB
from rigpilot.app.jobs.energy_view import NO_PRICE, energy_rows
from rigpilot.engine.jobs.energy import EnergyMeter, combine, cost

from support.gui_fakes import FakeLink
from support.gui_jobs import FakeJobs, a_training_job, open_job, open_page


def measured_energy() -> dict:
    """Two runs on GPUs 0 and 1 at a constant 250 W each: 2 × 250 W × (600 + 120) s = 360,000 J = 0.1 kWh."""
    runs = []
    for run, (start, end) in enumerate([(0.0, 600.0), (1000.0, 1120.0)], start=1):
        m = EnergyMeter([0, 1], start, max_gap=5.0)
        t = start
        while t <= end:
            m.add({"time": t, "simulated": True, "gpus": [{"index": 0, "power_w": 250.0}, {"index": 1, "power_w": 250.0}]})
            t += 1.0
        runs.append(m.result(end, run))
    return combine(runs, simulated=True)


@pytest.mark.parametrize("price", [{"per_kwh": 0.30, "currency": "EUR"}, None])
def test_a_finished_jobs_summary_shows_its_energy_and_cost(qtbot, price):
    energy = measured_energy()
    job = a_training_job("t")
    job["progress"]["tokens"] = 50_000.0
    job.update(energy=energy, energy_cost=cost(energy, job["progress"], price))
    link = FakeLink()
    FakeJobs(link, [job])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "t")
    assert page.detail.tabs.isTabVisible(SUMMARY_TAB)
    section = page.detail.summary_panel.energy
    assert section.isVisibleTo(page.detail.summary_panel)
    rows = section.rows()
    assert rows["Energy"].startswith("100.00 Wh (simulated")
    assert rows["Average power"] == "500 W over 2 GPUs"
    assert rows["Per GPU"] == "GPU 0: 50.00 Wh, GPU 1: 50.00 Wh" and rows["Runs"] == "83.33 Wh + 16.67 Wh (2 runs)"
    assert rows["Tokens per kWh"] == "500,000"
    if price:
        assert rows["Cost"] == "0.03 EUR at 0.3 EUR/kWh" and rows["Cost per step"] == "0.003000 EUR"
        assert rows["Tokens per EUR"] == "1,666,667"
    else:
        assert rows["Cost"] == NO_PRICE and "Cost per step" not in rows
    assert "never gives a GPU to two jobs" in section.toolTip()


def test_no_energy_figure_hides_the_section_and_a_slurm_job_says_why():
    assert energy_rows({"energy": None}) == []
    assert energy_rows({"energy": {"unavailable": "not measured: SLURM"}}) == [("Energy", "not measured: SLURM")]


def test_settings_prices_are_checked_by_the_settings_schema_and_saved_apart(qtbot):
    from rigpilot.engine.settings import Settings

    from support.gui_settings import open_page as open_settings

    Settings(simulated_profile="8x-a100-pcie", electricity_price=0.25, electricity_currency="CHF").save()
    page = open_settings(qtbot)
    box = page.prices
    qtbot.waitUntil(box.save_button.isEnabled)
    assert (box.price.text(), box.currency.text(), box.table.rowCount()) == ("0.25", "CHF", 0)
    box.price.setText("-3")
    box.add_row({"name": "cloud", "gpu": "h100-sxm", "gpus": 8, "price_per_gpu_hour": 2.5, "currency": "USD"})
    assert not box.save()
    assert "positive" in box.electricity_error.text() and box.electricity_error.isVisibleTo(box)
    assert box.rented_error.text().startswith("Row 1: cloud: no GPU spec with key 'h100-sxm'; did you mean")
    assert Settings.load().electricity_price == 0.25  # nothing written
    box.price.setText("0.31")
    box.currency.setText("eur")
    box.table.item(0, 1).setText("h100-sxm5")
    with qtbot.waitSignal(box.sig_saved, timeout=10000):
        assert box.save()
    saved = Settings.load()
    assert saved.price() == {"per_kwh": 0.31, "currency": "EUR"} and saved.simulated_profile == "8x-a100-pcie"
    assert saved.rented_machines == [
        {"name": "cloud", "gpu": "h100-sxm5", "gpus": 8, "price_per_gpu_hour": 2.5, "currency": "USD"}
    ]


def test_the_planner_compares_the_plan_here_with_the_rented_machines(qtbot):
    from rigpilot.app.planner.rented_view import NO_BUDGET
    from rigpilot.engine.settings import Settings

    from support.gui_planner import open_page as open_planner
    from support.gui_planner import plan_for

    h100 = {"name": "cloud-h100", "gpu": "h100-sxm5", "gpus": 8, "price_per_gpu_hour": 2.5, "currency": "USD"}
    Settings(rented_machines=[h100], electricity_price=0.30, electricity_currency="EUR").save()
    page, _ = open_planner(qtbot, "4x-rtx4090")
    plan_for(qtbot, page, "llama-3.1-8b")
    assert page.rented.note.text() == NO_BUDGET and page.rented.table.rowCount() == 0
    result = plan_for(qtbot, page, "llama-3.1-8b", token_budget=10**9)
    qtbot.waitUntil(lambda: page.rented.comparison is not None, timeout=20000)
    here, cloud = page.rented.comparison["rows"]
    assert here["tokens_per_s"] == result["best"]["timing"]["tokens_per_s"]
    assert cloud["cost"] == pytest.approx(8 * 2.5 * 1e9 / cloud["tokens_per_s"] / 3600)
    table = page.rented.table
    assert [table.item(r, 0).text() for r in range(table.rowCount())] == [here["name"], "cloud-h100"]
    assert table.item(1, 3).text() == f"{cloud['cost']:,.2f} USD" and table.item(0, 3).text().endswith(" EUR")
    assert page.tabs.tabText(page.tabs.indexOf(page.rented)) == "Rented machines"


def test_a_running_jobs_energy_so_far_follows_the_engines_job_events(qtbot):
    from support.gui_jobs import a_job

    link = FakeLink()
    FakeJobs(link, [a_job("r", "running")])
    page = open_page(qtbot, link)
    open_job(qtbot, page, "r")
    line = page.detail.energy_line
    assert not line.isVisibleTo(page.detail)  # no figure yet: nothing shown rather than a zero
    energy = measured_energy()
    link.jobs[0] = {**link.jobs[0], "energy": energy, "energy_cost": cost(energy, {}, {"per_kwh": 0.3, "currency": "EUR"})}
    link.sig_job.emit(link.jobs[0])
    qtbot.waitUntil(lambda: line.isVisibleTo(page.detail))
    assert line.text() == "GPU energy so far: 100.00 Wh, 500 W average, 0.03 EUR (simulated)"
