"""The Planner's Rejected tab says which memory a rejected family's figures are of: host RAM where the engine says
host RAM bound it (`rejected[].limit`), per GPU otherwise; the engine's own result, planned in-process."""

from __future__ import annotations

import dataclasses
import json

from rigpilot.app.planner.results_view import PlanResults
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner.plan import Workload
from rigpilot.engine.planner.search import search


def _result(host_gib: float, model: str = "llama-3.1-8b", **workload) -> dict:
    machine = load_profile("1x-rtx4090")
    machine = dataclasses.replace(machine, host=dataclasses.replace(machine.host, memory_total=int(host_gib * 2**30)))
    r = search(describe_model(model), machine, Workload(model=model, **{"global_batch": 2, **workload}))
    return json.loads(json.dumps(r.to_dict()))  # as the engine's socket answer carries it


def test_rejections_for_host_ram_show_host_ram(qtbot):
    view = PlanResults()
    qtbot.addWidget(view)
    view.show_result(_result(40))
    cells = [view.rejected.item(r, 2).text() for r in range(view.rejected.rowCount())]
    assert cells and all(c.endswith(" GiB of 40 GiB of host RAM") for c in cells), cells
    view.show_result(_result(64, model="llama-3.1-70b", task="infer", global_batch=1))
    cells = [view.rejected.item(r, 2).text() for r in range(view.rejected.rowCount())]
    assert cells == ["140 GiB of 24 GiB per GPU"]  # the engine's rounding (memory.gib_pair): whole from 10 GiB
    old = {**_result(40), "rejected": [{"family": "DDP", "reason": "r", "need_bytes": 2**31, "have_bytes": 2**30}]}
    view.show_result(old)  # an older engine's rejection, without `limit`: per GPU, as it meant
    assert view.rejected.item(0, 2).text() == "2.0 GiB of 1.0 GiB per GPU"
    close = {**old, "rejected": [{**old["rejected"][0], "need_bytes": int(63.04 * 2**30), "have_bytes": 63 * 2**30}]}
    view.show_result(close)  # never "63 GiB of 63 GiB": as many decimals as tell the two apart
    assert view.rejected.item(0, 2).text() == "63.04 GiB of 63.00 GiB per GPU"
