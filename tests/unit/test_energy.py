"""Energy per job: the power integral against traces whose integral is known, gaps, runs added up, cost arithmetic,
the price settings' schema."""

import json

import pytest

from rigpilot.engine.jobs import energy
from rigpilot.engine.jobs.energy import EnergyMeter, combine, cost, with_run
from rigpilot.engine.jobs.metrics import MetricsSummary
from rigpilot.engine.settings import Settings, check_currency, check_price, check_rented_machine


def trace(times, power_by_gpu, simulated=True):
    """Telemetry samples (TelemetrySample.to_dict shape): power_by_gpu maps a GPU index to a function of time."""
    return [
        {"time": t, "simulated": simulated, "gpus": [{"index": i, "power_w": f(t)} for i, f in power_by_gpu.items()]}
        for t in times
    ]


def meter_over(samples, gpus, start, end, max_gap=5.0, run=1):
    m = EnergyMeter(gpus, start, max_gap=max_gap)
    for s in samples:
        m.add(s)
    return m.result(end, run)


def test_constant_and_linear_power_over_irregular_samples_integrate_exactly():
    # GPU 0 draws 300 W throughout; GPU 1 ramps linearly 100 W -> 400 W over 0..30 s (P = 100 + 10 t).
    # Exact integrals by hand: 300 × 30 = 9000 J; ∫0^30 (100 + 10 t) dt = 3000 + 5 × 900 = 7500 J.
    # The trapezoid rule is exact for linear power, at any spacing: these samples are deliberately irregular.
    times = [0.0, 0.7, 1.9, 2.0, 4.5, 6.0, 9.3, 12.0, 13.1, 17.0, 19.5, 22.0, 26.4, 28.0, 30.0]
    r = meter_over(trace(times, {0: lambda t: 300.0, 1: lambda t: 100.0 + 10.0 * t}), [0, 1], 0.0, 30.0)
    assert r["gpus"]["0"]["joules"] == pytest.approx(9000.0)
    assert r["gpus"]["1"]["joules"] == pytest.approx(7500.0)
    assert r["joules"] == pytest.approx(16500.0)
    assert r["uncovered_s"] == 0 and r["seconds"] == 30.0 and r["simulated"] is True


def test_only_the_jobs_gpus_count_and_edges_hold_the_nearest_reading():
    # Samples from 1 s to 9 s of a 0..10 s run at 200 W: the 1 s at each edge is held at 200 W -> 2000 J.
    samples = trace([1.0, 3.0, 5.0, 7.0, 9.0], {0: lambda t: 999.0, 2: lambda t: 200.0})
    r = meter_over(samples, [2], 0.0, 10.0)
    assert list(r["gpus"]) == ["2"] and r["joules"] == pytest.approx(2000.0) and r["uncovered_s"] == 0


def test_a_gap_longer_than_a_few_intervals_is_not_bridged_and_is_reported():
    # 1 Hz at 100 W from 0..10 s, nothing until 40 s, then 1 Hz again to 50 s: 30 s uncovered.
    times = [float(t) for t in range(0, 11)] + [float(t) for t in range(40, 51)]
    r = meter_over(trace(times, {0: lambda t: 100.0}), [0], 0.0, 50.0, max_gap=5.0)
    assert r["gpus"]["0"]["uncovered_s"] == pytest.approx(30.0)
    assert r["joules"] == pytest.approx(100.0 * 20)  # only the covered 20 s
    # A sample without a power reading is a hole too, and says why when a GPU never had one.
    samples = trace([0.0, 1.0, 2.0], {0: lambda t: None})
    for s in samples:
        s["gpus"][0]["unavailable"] = {"power_w": "not supported"}
    r = meter_over(samples, [0], 0.0, 2.0)
    assert r["joules"] == 0 and r["uncovered_s"] == 2.0 and r["gpus"]["0"]["unavailable"] == "not supported"


def test_samples_outside_the_run_and_out_of_order_are_ignored():
    m = EnergyMeter([0], 10.0, max_gap=5.0, end=20.0)
    for s in trace([5.0, 10.0, 12.0, 11.0, 14.0, 16.0, 18.0, 20.0, 25.0], {0: lambda t: 50.0}):
        m.add(s)
    r = m.result(20.0)
    assert r["joules"] == pytest.approx(50.0 * 10) and r["samples"] == 7 - 1  # 11.0 came after 12.0


def test_runs_add_up_and_a_rerun_figure_replaces_its_own_run():
    first = meter_over(trace([0.0, 1.0, 2.0], {0: lambda t: 100.0, 1: lambda t: 50.0}), [0, 1], 0.0, 2.0, run=1)
    second = meter_over(trace([10.0, 11.0, 12.0, 13.0], {0: lambda t: 200.0}), [0], 10.0, 13.0, run=2)
    job = with_run(with_run(None, first, simulated=True), second, simulated=True)
    assert job["joules"] == pytest.approx(200 + 100 + 600) and job["seconds"] == pytest.approx(5.0)
    assert job["gpus"]["0"]["joules"] == pytest.approx(800) and job["gpus"]["1"]["joules"] == pytest.approx(100)
    assert job["kwh"] == pytest.approx(900 / 3.6e6) and job["average_w"] == pytest.approx(180.0)
    assert [r["run"] for r in job["runs"]] == [1, 2] and "simulated" in job["source"]
    # The same run measured again (a re-adopted job) replaces its first figure instead of counting twice.
    again = with_run(job, {**second, "joules": 900.0, "gpus": {"0": {"joules": 900.0, "uncovered_s": 0.0}}}, simulated=True)
    assert again["joules"] == pytest.approx(300 + 900)
    assert combine([], simulated=False)["average_w"] is None


def test_cost_arithmetic_and_the_hint_without_a_price():
    job_energy = combine([meter_over(trace([0.0, 3600.0], {0: lambda t: 500.0}), [0], 0.0, 3600.0, max_gap=4000)],
                         simulated=False)  # fmt: skip
    assert job_energy["kwh"] == pytest.approx(0.5)
    progress = {"step": 100, "tokens": 2_000_000.0}
    money = cost(job_energy, progress, {"per_kwh": 0.30, "currency": "EUR"})
    assert money["amount"] == pytest.approx(0.15) and money["per_step"] == pytest.approx(0.0015)
    assert money["tokens_per_kwh"] == pytest.approx(4_000_000) and money["tokens_per_currency"] == pytest.approx(2e6 / 0.15)
    line = energy.energy_line(job_energy, money)
    assert line.startswith("energy: 500.00 Wh, 500 W average, 0.15 EUR at 0.3 EUR/kWh")
    assert "4,000,000 tokens/kWh" in line
    bare = cost(job_energy, {"step": 3}, None)
    assert bare["price"] is None and "rigpilot settings set electricity-price" in bare["hint"]
    assert bare["tokens_per_kwh"] is None and "EUR" not in energy.energy_line(job_energy, bare)
    assert cost(None, progress, None) == {}


def test_tokens_add_up_from_each_ranks_rate_times_its_step_time():
    s = MetricsSummary()
    for rank in (0, 1):
        for step in (1, 2, 3):
            s.add({"rank": rank, "step": step, "tokens_per_s": 1000.0, "step_time": 0.5, "time": step})
    s.add({"rank": 0, "step": 4, "tokens_per_s": 1000.0})  # no step time: not counted, rather than guessed
    assert s.to_dict()["tokens"] == pytest.approx(2 * 3 * 500.0)


def test_an_inference_jobs_tokens_are_those_it_generated_once_per_run_whatever_the_ranks():
    s = MetricsSummary()
    for rank in (0, 1):  # per-batch records carry a rate but no step time: they add nothing
        s.add({"rank": rank, "kind": "infer", "step": 1, "tokens_per_s": 300.0, "run": 1})
        s.add({"rank": rank, "kind": "infer_summary", "job_new_tokens": 640, "job_tokens_per_s": 600.0, "run": 1})
    assert s.to_dict()["tokens"] == 640  # both ranks state the job's count: counted once
    s.add({"rank": 0, "kind": "infer_summary", "job_new_tokens": 640, "run": 2})  # resumed: generated again
    assert s.to_dict()["tokens"] == 1280
    money = cost({"kwh": 0.002}, s.to_dict(), {"per_kwh": 0.3, "currency": "EUR"})
    assert money["tokens_per_kwh"] == pytest.approx(1280 / 0.002)
    assert "640,000 tokens/kWh" in energy.energy_line({"kwh": 0.002}, money)


@pytest.mark.parametrize(
    ("value", "message"),
    [(-0.3, "positive"), (0, "positive"), ("nan", "positive"), ("inf", "positive"), ("abc", "a number"),
     (1e9, "check the number"), (True, "positive")],
)  # fmt: skip
def test_prices_that_make_no_sense_are_refused_in_one_line(value, message):
    with pytest.raises(ValueError, match=message) as e:
        check_price(value, "electricity-price")
    assert "\n" not in str(e.value)


def test_currency_and_rented_machine_schema():
    assert check_currency(" eur ") == "EUR"
    for bad in ("euro", "€", "", "US1"):
        with pytest.raises(ValueError, match="three-letter code"):
            check_currency(bad)
    row = check_rented_machine({"name": "cloud", "gpu": "H100-SXM5", "gpus": "8", "price_per_gpu_hour": "2.5", "currency": "usd"})
    assert row == {"name": "cloud", "gpu": "h100-sxm5", "gpus": 8, "price_per_gpu_hour": 2.5, "currency": "USD"}
    with pytest.raises(ValueError, match="did you mean"):
        check_rented_machine({**row, "gpu": "h100-sxm"})
    with pytest.raises(ValueError, match="GPU count"):
        check_rented_machine({**row, "gpus": 0})
    with pytest.raises(ValueError, match="price per GPU-hour"):
        check_rented_machine({**row, "price_per_gpu_hour": -1})


def test_a_hand_edited_bad_price_is_ignored_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    Settings.path().parent.mkdir(parents=True)
    good = {"name": "ok", "gpu": "a100-sxm4-80gb", "gpus": 4, "price_per_gpu_hour": 1.5, "currency": "EUR"}
    Settings.path().write_text(json.dumps({
        "electricity_price": -2, "electricity_currency": "EUR", "rented_machines": [good, {"name": "x", "gpu": "nope"}],
    }))  # fmt: skip
    s = Settings.load()
    assert s.price() is None and s.rented_machines == [good]
    assert any("electricity price ignored" in w for w in s.warnings) and any("rented machine" in w for w in s.warnings)
    s.electricity_price, s.electricity_currency = 0.25, "CHF"
    s.save()
    assert Settings.load().price() == {"per_kwh": 0.25, "currency": "CHF"}
    assert energy.electricity_price() == {"per_kwh": 0.25, "currency": "CHF"}


def test_a_telemetry_store_that_fails_leaves_a_hole_not_a_stuck_job():
    class Broken:
        min_interval = 1.0

        def each_since(self, *a, **k):
            raise OSError("disk I/O error")

    class Rec:
        gpus, started, slurm, run, simulated, energy = [0], 100.0, None, 1, True, None

    meter = energy.new_meter(Rec, Broken())
    assert meter.max_gap == 5.0
    spent = energy.finish(Rec, meter, Broken(), 110.0)
    assert spent["joules"] == 0 and spent["uncovered_s"] == 10.0 and spent["runs"][0]["samples"] == 0
