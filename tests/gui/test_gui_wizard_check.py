"""The wizard's plan step takes the Planner page's path: the formula's plan at once, then the plan ranked with the
engine's traced figures."""

from __future__ import annotations

import pytest

from rigpilot.app.wizard.page_base import PLAN
from rigpilot.app.wizard.state import default_state
from rigpilot.engine.planner import verify

from support.gui_wizard import go_to, make_link, open_wizard
from support.tracer import no_warm_tracer, stand_in_tracer

pytestmark = pytest.mark.usefixtures(no_warm_tracer.__name__)


def test_the_plan_step_shows_the_formulas_plan_then_the_traced_one(qtbot, settings, tmp_path, monkeypatch):
    monkeypatch.setenv(verify.ENV_SWITCH, "1")
    monkeypatch.setenv("RIGPILOT_TRACE_CACHE", str(tmp_path / "traces"))
    started = stand_in_tracer(monkeypatch)
    link, _ = make_link("4x-rtx4090")
    state = default_state(link.machine)
    state.kind, state.model, state.method = "finetune", "llama-2-7b", "lora"
    state.set_precision("bf16")
    state.train.seq_len, state.global_batch, state.gpus = 2048, 16, [0, 1, 2, 3]
    wizard = open_wizard(qtbot, link, settings, state=state)
    go_to(qtbot, wizard, PLAN)
    qtbot.waitUntil(lambda: any(m["traced"] is not None for m in (wizard.state.plan or {}).get("memory", [])),
                    timeout=30000)  # fmt: skip
    asked = [r for r in link.requests("plan") if "recheck" not in r]
    assert asked[0].get("verify") is False  # the formula's answer first
    traces = [r for r in asked if "trace" in r]
    assert traces and asked[-1].get("verify", True) and "trace" not in asked[-1]
    assert started
    result = wizard.plan_page.result
    assert result["trace"]["traced"] == len(traces) and result["trace"]["cached"] == len(traces)
