"""The Planner page's memory check: the formula's plan at once, then each plan's traced figures as the engine
traces them, with progress and a Cancel that stops asking."""

from __future__ import annotations

import pytest

from rigpilot.app.planner.model import plans_of
from rigpilot.engine.planner import verify

from support.gui_fakes import isolated_config
from support.gui_planner import PRESET_7B, open_page
from support.tracer import no_warm_tracer, stand_in_tracer

pytestmark = pytest.mark.usefixtures(no_warm_tracer.__name__)


@pytest.fixture(autouse=True)
def _private_settings(tmp_path, monkeypatch):
    yield from isolated_config(tmp_path, monkeypatch)


@pytest.fixture
def checking(tmp_path, monkeypatch):
    """Verification on, traced by the stand-in tracer (a real process that answers at once), cache of its own."""
    monkeypatch.setenv(verify.ENV_SWITCH, "1")
    monkeypatch.setenv("RIGPILOT_TRACE_CACHE", str(tmp_path / "traces"))
    return stand_in_tracer(monkeypatch)


def plan_requests(link) -> list[dict]:
    return [args for rtype, args in link.calls if rtype == "plan"]


def test_the_formulas_plan_shows_first_then_each_traced_plan(qtbot, checking):
    page, link = open_page(qtbot, "4x-rtx4090")
    page.picker.set_model(PRESET_7B, chosen=False)
    traced: list[int] = []
    page.sig_plan_traced.connect(lambda i, outcome: traced.append(i))
    with qtbot.waitSignal(page.sig_plan_ready, timeout=20000) as ready:
        page.plan_button.click()
    formula = ready.args[0]
    best = plans_of(formula)[0]
    assert all(m["traced"] is None for m in best["memory"])  # the formula's figures, shown at once
    assert plan_requests(link)[0]["verify"] is False
    pending = formula["trace"]["pending"]
    assert pending == min(verify.VERIFY_TOP, len(plans_of(formula)))
    with qtbot.waitSignal(page.sig_plan_verified, timeout=30000) as verified:
        pass
    assert traced == list(range(pending))
    # One trace request per plan, then the search again with verification on (answered from the cache).
    asked = plan_requests(link)
    assert [("trace" in a) for a in asked] == [False, *([True] * pending), False]
    assert "verify" not in asked[-1]
    result = verified.args[0]
    assert result["trace"]["traced"] == pending and result["trace"]["cached"] == pending
    assert all(m["traced"] is not None for m in plans_of(result)[0]["memory"])
    assert page.result == result and "Memory: formula" in page.summary.text() and "traced" in page.summary.text()
    assert "Memory traced for" in page.status.text() and not page.cancel_check.isVisible()
    assert checking  # traced by tracer processes, in the engine's planner


def test_each_trace_fills_in_its_row_while_the_check_goes_on(qtbot, checking):
    page, _ = open_page(qtbot, "4x-rtx4090")
    page.picker.set_model(PRESET_7B, chosen=False)
    seen: list[tuple[str, list]] = []

    def traced(i: int, outcome: dict) -> None:
        # The page has the traced plan in its result while the next one is traced.
        seen.append((page.status.text(), [m["traced"] for m in plans_of(page.result)[i]["memory"]]))

    page.sig_plan_traced.connect(traced)
    with qtbot.waitSignal(page.sig_plan_verified, timeout=30000):
        page.plan_button.click()
    assert seen and all(all(t is not None for t in figures) for _, figures in seen)
    assert "Verifying memory: 1 of" in seen[0][0]


def test_cancel_stops_the_check_and_the_formulas_figures_stand(qtbot, checking):
    page, link = open_page(qtbot, "4x-rtx4090")
    page.picker.set_model(PRESET_7B, chosen=False)
    answer = link.replies["plan"]

    def reply(**args):
        if "trace" in args:
            assert page.cancel_check.isVisible()
            page.cancel_check.click()  # the user cancels while the first trace is under way
        return answer(**args)

    link.replies["plan"] = reply
    with qtbot.waitSignal(page.sig_check_cancelled, timeout=20000):
        page.plan_button.click()
    qtbot.wait(200)  # the trace's reply, and anything it would have sent next, have had their turn
    asked = plan_requests(link)
    assert [("trace" in a) for a in asked] == [False, True]  # no further trace, no final search
    assert all(m["traced"] is None for m in plans_of(page.result)[0]["memory"])
    assert "cancelled" in page.status.text() and not page.cancel_check.isVisible()
    assert page.plan_button.isEnabled()
