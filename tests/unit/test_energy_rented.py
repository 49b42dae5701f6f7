"""`rigpilot plan --tokens N --compare-rented`: this machine against the rented machines in the settings."""

import json

import pytest

from rigpilot.engine.cli.entry import main
from rigpilot.engine.hardware.specs import load_specs, match_spec
from rigpilot.engine.planner.rented import rented_machine
from rigpilot.engine.settings import Settings

H100 = {"name": "cloud-h100", "gpu": "h100-sxm5", "gpus": 8, "price_per_gpu_hour": 2.5, "currency": "USD"}
V100 = {"name": "old-v100", "gpu": "v100-sxm2-16gb", "gpus": 1, "price_per_gpu_hour": 0.3, "currency": "USD"}


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    return Settings


def plan(capsys, *extra):
    rc = main(["plan", "--simulate", "4x-rtx4090", "--model", "llama-3.1-8b", "--method", "lora", "--no-verify", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_gpu_of_the_spec_table_builds_a_rented_machine_the_planner_recognises():
    for spec in load_specs():
        m = rented_machine({"name": "x", "gpu": spec.key, "gpus": 2})
        assert len(m.gpus) == 2 and m.gpus[0].power_limit_w == spec.tdp_w
        assert match_spec(m.gpus[0].name, m.gpus[0].memory_total).key == spec.key, spec.key
    h100 = rented_machine(H100)
    assert all(p.nvswitch for p in h100.pairs) and not any(p.nvlink_count for p in rented_machine({**V100, "gpu": "l40s", "gpus": 2}).pairs)


def test_the_comparison_arithmetic_with_and_without_an_electricity_price(settings, capsys):
    settings(rented_machines=[H100, V100], electricity_price=0.30, electricity_currency="EUR").save()
    rc, out, _ = plan(capsys, "--tokens", "1e9", "--compare-rented", "--json")
    assert rc == 0
    doc = json.loads(out)
    c = doc["rented_comparison"]
    here, h100, v100 = c["rows"]
    assert c["token_budget"] == 10**9 and here["tokens_per_s"] == pytest.approx(doc["best"]["timing"]["tokens_per_s"])
    assert here["time_s"] == pytest.approx(1e9 / here["tokens_per_s"])
    # Here: four RTX 4090s at their 450 W limit for that time, at 0.30 EUR per kWh.
    assert here["kwh"] == pytest.approx(4 * 450 * here["time_s"] / 3.6e6)
    assert here["cost"] == pytest.approx(here["kwh"] * 0.30) and here["currency"] == "EUR"
    # Rented: 8 GPUs × 2.5 USD per GPU-hour for as long as its own plan takes.
    assert h100["fits"] and h100["tokens_per_s"] > here["tokens_per_s"]
    assert h100["cost"] == pytest.approx(8 * 2.5 * 1e9 / h100["tokens_per_s"] / 3600) and h100["currency"] == "USD"
    assert not v100["fits"] and v100["why"].endswith("has no bf16 support; use --dtype fp16")
    # The app names the control: the refusal's terms came along (docs/cli-json.md).
    assert v100["why_terms"]["refs"] == {"fp16": {"setting": "precision", "value": "fp16"}}

    settings(rented_machines=[H100]).save()
    rc, out, _ = plan(capsys, "--tokens", "1e9", "--compare-rented")
    lines = out[out.index("To process 1,000,000,000 tokens:"):].splitlines()
    assert lines[1].split() == ["MACHINE", "TOKENS/S", "TIME", "COST"]
    assert lines[2].startswith("  here: simulated: 4×RTX 4090") and "set electricity-price" in lines[2]
    assert lines[3].startswith("  cloud-h100") and "USD" in lines[3]


def test_compare_rented_needs_a_token_budget_and_says_how_to_add_a_machine(settings, capsys):
    rc, _, err = plan(capsys, "--compare-rented")
    assert rc == 2 and err.strip().endswith("--compare-rented needs a token budget: --tokens N (e.g. --tokens 1e9)")
    rc, out, _ = plan(capsys, "--tokens", "1e8", "--compare-rented")
    assert rc == 0 and "No rented machines to compare with; add one: rigpilot settings add-rented" in out
