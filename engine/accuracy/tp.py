"""Tensor-parallel steps measured per rank: the cases run on gloo CPU ranks, split as the workers split them.

One group of `tp` processes (torch.multiprocessing, spawned) measures every
case it is given, each on a model built alike on every rank (same seed) and
split by the engine's own `apply_tensor_parallel` with the vocabulary-parallel
head a training job asks for; see `measure.measure_step`. A rank's bytes are
its local shards and the local parts of what autograd saves. The ranks of a
Megatron-style split hold the same amounts; the largest is reported.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from rigpilot.engine.accuracy.measure import Case


def measure_tp_steps(cases: list[Case]) -> list[dict[str, int]]:
    """Bytes per component for each case, on the rank holding the most; all cases must share one tp."""
    if not cases:
        return []
    tp = cases[0].tp
    if any(c.tp != tp for c in cases) or tp < 2:
        raise ValueError("measure_tp_steps takes cases of one tensor-parallel degree above 1")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="rigpilot-tp-") as tmp:
        mp.spawn(_rank, args=(tp, free_port(), [asdict(c) for c in cases], tmp), nprocs=tp, join=True)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(tp)]
    return [{k: max(r[i][k] for r in ranks) for k in ranks[0][i]} for i in range(len(cases))]


def _rank(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rigpilot.engine.accuracy.measure import measure_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a small machine: one thread each keeps them from fighting
    _quiet()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        results = [measure_step(Case(**_tuples(c)), tp_mesh=mesh) for c in cases]
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _tuples(c: dict) -> dict:
    if c.get("lora_targets") is not None:
        c = {**c, "lora_targets": tuple(c["lora_targets"])}
    return c


def _quiet() -> None:
    import warnings

    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
