"""What bound the search, as a code and figures (SearchResult.limit, Rejection.limit): when host RAM, not GPU memory,
is what the leanest plan does not fit, the "nothing fits" line, the CPU-offload note and the JSON name host RAM
with its figures, never the GPUs' memory (which that plan fits)."""

from __future__ import annotations

import dataclasses
import json

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner.plan import Workload
from rigpilot.engine.planner.result import GPU_MEMORY, HOST_MEMORY
from rigpilot.engine.planner.search import search

GIB = 2**30
MODEL = "llama-3.1-8b"  # full fine-tune on one RTX 4090: fits only with the optimizer state in host memory (60 GiB)


def _search(host_gib: float, model: str = MODEL, **workload):
    machine = load_profile("1x-rtx4090")
    machine = dataclasses.replace(machine, host=dataclasses.replace(machine.host, memory_total=int(host_gib * GIB)))
    return search(describe_model(model), machine, Workload(model=model, **{"global_batch": 2, **workload}))


def test_nothing_fits_because_of_host_ram_says_so_with_the_figures():
    r = _search(40)
    assert r.best is None
    assert r.limit is not None and r.limit.code == HOST_MEMORY
    assert r.limit.have_bytes == 40 * GIB and r.limit.need_bytes > r.limit.have_bytes
    line = r.explanation[0]
    assert "fits its GPUs but needs" in line and "of host RAM and the simulated machine has 40.0 GiB" in line
    assert "per GPU" not in line
    d = json.loads(json.dumps(r.to_dict()))
    assert d["limit"] == {"code": "host_memory", "need_bytes": r.limit.need_bytes, "have_bytes": 40 * GIB,
                          "plan": r.limit.plan}  # fmt: skip
    assert d["rejected"] and all(x["limit"] == "host_memory" for x in d["rejected"])
    assert all(x["have_bytes"] == 40 * GIB for x in d["rejected"])


def test_cpu_offload_taken_for_host_ram_names_host_ram_not_the_gpu():
    """62.9 GiB of RAM: the plan with the optimizer state in host memory fits the GPU (20.6 GiB of 24) but pins
    63.3 GiB of host RAM; FSDP2 with CPU offload pins a little less, and is taken."""
    r = _search(62.9)
    best = r.best
    assert best is not None and best.parallelism.offload
    assert r.limit is not None and r.limit.code == HOST_MEMORY and r.limit.need_bytes > r.limit.have_bytes
    assert not best.workload.optimizer_offload and "CPU offload" not in r.limit.plan
    note = best.notes[0]
    assert note.startswith("CPU offload is needed: without it the leanest plan")
    assert "optimizer state in host memory" in note and "fits its GPUs but needs 63.3 GiB of host RAM of 62.9 GiB" in note
    assert "per GPU" not in note
    assert json.loads(json.dumps(r.to_dict()))["limit"]["code"] == "host_memory"


def test_gpu_memory_stays_the_cause_where_it_is():
    r = _search(64, model="llama-3.1-70b", task="infer", global_batch=1)
    assert r.best is None and r.limit is not None and r.limit.code == GPU_MEMORY
    assert r.limit.have_bytes == load_profile("1x-rtx4090").gpus[0].memory_total
    assert "per GPU and you have 24.0 GiB" in r.explanation[0]
    assert [x.limit for x in r.rejected] == [GPU_MEMORY]


def test_a_plan_that_fits_without_offload_has_no_limit():
    r = _search(64)
    assert r.best is not None and not r.best.parallelism.offload and r.limit is None
    assert r.to_dict()["limit"] is None


def test_a_rejection_never_reads_as_needing_what_the_machine_has() -> None:
    """63.3 GiB needed of 62.9 GiB: whole GiB would say "needs 63 GiB of host RAM; this machine has 63 GiB"."""
    from rigpilot.engine.planner.amounts import gib_pair

    gib = 1024**3
    assert gib_pair(63.02 * gib, 62.98 * gib) == ("63.02 GiB", "62.98 GiB")
    assert gib_pair(63.3 * gib, 62.9 * gib) == ("63.3 GiB", "62.9 GiB")
    assert gib_pair(80.3 * gib, 24 * gib) == ("80.3 GiB", "24.0 GiB")
    assert gib_pair(80.3 * gib, 24 * gib, whole_from=10) == ("80 GiB", "24 GiB")
    assert gib_pair(63.3 * gib, 62.9 * gib, whole_from=10) == ("63.3 GiB", "62.9 GiB")
    assert gib_pair(150 * gib, 120 * gib) == ("150 GiB", "120 GiB")
    assert gib_pair(9.44 * gib, 9.41 * gib) == ("9.44 GiB", "9.41 GiB")
    assert gib_pair(5.5 * gib, 4 * gib) == ("5.5 GiB", "4.0 GiB")
