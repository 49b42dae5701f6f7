"""Which plans the memory tracer (engine.workers.memtrace) can trace, decided without starting it.

One answer for both sides: the planner asks before it starts a tracer (a plan it cannot trace costs no
process, no torch import: QLoRA plans used to spend seconds starting one only to be refused), and the
tracer asks again for a request it is given directly.
"""

from __future__ import annotations

from typing import Any


def why_not_traced(workload: dict[str, Any], par: dict[str, Any]) -> str | None:
    """Why the plan (Workload and Parallelism as dicts, as Plan.to_dict has them) is not traced; None if it is."""
    task = workload.get("task")
    if task not in ("train", "infer"):
        return f"task {task!r} is not traced"
    if task == "infer" and int(workload.get("weight_bits", 16)) != 16:
        return "quantised inference (8-bit, 4-bit weights) is not traced"
    if int(par.get("nodes", 1) or 1) > 1:
        # The trace runs one machine's ranks; a step spread over several nodes is not traced.
        return "multi-node plans are not traced"
    if int(par.get("pp", 1)) > 1 and task != "train":
        return "pipelined inference is not traced (its stages pass hidden states token by token)"
    if par.get("offload_optimizer") and not par.get("offload_params"):
        return "optimizer-only offload is DeepSpeed's: the engine offloads with FSDP2 (parameters too)"
    if par.get("backend") == "deepspeed":
        return "DeepSpeed plans are not traced: the engine runs FSDP2, DDP and tensor parallel"
    if workload.get("method") == "qlora":
        # bitsandbytes' NF4 kernels need CUDA and real storage; the fake-tensor step has neither.
        return "QLoRA plans are not traced (4-bit NF4 weights do not run on fake tensors): the formula's figure stands"
    return None
