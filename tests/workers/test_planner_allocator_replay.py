"""The memory model's allocator reserve against the caching allocator's rules replayed over a traced step.

benchmarks/allocator_replay.py records every storage the engine's fake-tensor trace (memtrace) allocates
and frees for a single-GPU plan and replays them through engine.planner.allocator.CachingAllocator. The
model's tensors plus its reserve must cover the replay's reserved peak, and not by much.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rigpilot.engine.planner import memory

from support.paths import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("allocator_replay", REPO / "benchmarks" / "allocator_replay.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_lora_reserve_covers_the_replayed_allocator(tmp_path: Path):
    bench = _bench()
    folder = tmp_path / "llama-8b-shaped"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**bench.LLAMA_8B, "num_hidden_layers": 2}))
    name, plan = bench.plans(folder, 2048)[0]  # LoRA r16, batch 1, one H100
    alloc, traced = bench.record(plan.to_dict())
    assert traced["ok"] and alloc.peak_allocated == traced["peak"]  # the replay saw every tensor the trace did
    assert alloc.peak_reserved > 1.05 * alloc.peak_allocated  # fragmentation is real: the margin must hold it
    m = plan.peak_memory
    predicted = m.total - memory.CUDA_CONTEXT_BYTES_LARGE
    assert alloc.peak_reserved <= predicted <= 1.05 * alloc.peak_reserved, name
