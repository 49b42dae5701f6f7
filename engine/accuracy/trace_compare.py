"""The traced column of the accuracy harness: what the fake-tensor trace says one harness step holds.

`trace_case(case)` steps the harness's own model (engine.accuracy.models) the
way `rigpilot.engine.workers.memtrace` traces a plan, on fake tensors, and
reads the same components `measure.measure_step` measures on real ones:
parameters, gradients, optimizer state (after the step), and what the forward
pass leaves alive for backward. The trace steps the model as the engine's
workers do (their loss), with the harness's precision (fp32 master weights
under bf16 autocast with CUDA's cast policy, a bf16 base under LoRA) and its
checkpointing (transformers' reentrant kind, whose saved tensors it can see;
the engine's non-reentrant wrapper keeps them in a closure).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from rigpilot.engine.accuracy.measure import Case
from rigpilot.engine.accuracy.models import TINY_CONFIGS
from rigpilot.engine.layout import Layout


class NotTraceable(Exception):
    """A harness case the tracer does not run (an encoder, an unknown model); the message says why."""


def trace_case(case: Case, *, layers: int | None = None) -> dict[str, int]:
    """Traced bytes of `case` per component (measure.COMPONENTS) and its peak ("peak")."""
    from rigpilot.engine.workers import memtrace

    if case.model not in TINY_CONFIGS:
        raise NotTraceable(f"{case.model}: the tracer runs the harness's decoder configs only")
    config_dict = TINY_CONFIGS[case.model]
    with tempfile.TemporaryDirectory(prefix="rigpilot-trace-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_dict))
        workload = _workload(case, tmp)
        # Under TP this process is rank 0 of a fake group of case.tp ranks, as verify traces a plan.
        par = {"micro_batch": case.micro_batch, "grad_accum": 1, "checkpointing": case.checkpointing}
        layout = Layout(tp=case.tp, sequence_parallel=case.sequence_parallel)
        try:
            config = memtrace._load_config(tmp, False)
            n = layers or memtrace._num_layers(config)
            phases = memtrace._trace_step(config, n, workload, par, layout, False)
        except memtrace.NotTraced as e:
            raise NotTraceable(str(e)) from e
    return components(phases.snapshots) | {"peak": phases.peak}


def components(snapshots: dict[str, dict[str, int]]) -> dict[str, int]:
    """measure_step's components from the tracker's snapshots after forward, backward and the step."""
    forward, backward, step = (snapshots.get(k, {}) for k in ("after_forward", "after_backward", "after_step"))
    return {
        "params": _get(forward, "Parameter", "Sharded Param"),
        "grads": _get(backward, "Gradient", "Sharded Grad"),
        "optimizer": _get(step, "Optstate", "OptState"),
        "activations_saved": _get(forward, "Activation"),
    }


def _get(snap: dict[str, int], *names: str) -> int:
    return sum(int(snap.get(n, 0)) for n in names)


def _workload(case: Case, folder: str) -> dict[str, Any]:
    work: dict[str, Any] = {"model": folder, "task": "train", "method": case.method, "precision": case.precision,
                            "seq_len": case.seq_len, "lora": None}  # fmt: skip
    if case.checkpointing == "full":
        work["harness_checkpointing"] = True  # transformers' reentrant kind, as measure._prepare enables it
    if case.method == "lora":
        targets = list(case.lora_targets) if case.lora_targets else ["all-linear"]
        work["lora"] = {"rank": case.lora_rank, "alpha": 2 * case.lora_rank, "dropout": 0.0, "targets": targets}
        if case.precision == "bf16":
            work["base_dtype"] = "bf16"  # the harness halves the frozen base (measure._prepare)
    return work
