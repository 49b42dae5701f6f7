"""How the planner words an amount of memory: one rounding rule for the CLI, the engine's sentences and the GUI
(which reads plan data but never imports the memory model), and the one share of a GPU above which a plan reads
as tight to all three."""

from __future__ import annotations

GIB = 1024**3

# Plans that fill more of their fullest GPU than this rank after every plan that leaves the rest free
# (engine.planner.search.rank) and are marked tight in the Planner's table. The memory
# model already counts the CUDA context, NCCL and the caching allocator's modelled reserve, but it is within about
# 5% of measured peaks, fragmentation grows over a long run (PyTorch's CUDA semantics notes offer
# expandable_segments against it) and a long run meets its longest batch or a checkpoint save late. Practitioners
# leave this share: vLLM's gpu_memory_utilization defaults to 0.9 (docs.vllm.ai, engine arguments), and its
# memory guide (docs.vllm.ai/projects/vllm-omni/en/latest/configuration/gpu_memory_utilization/) calls 1.0 "not
# recommended, leaves no buffer". A tight plan is never rejected for it: when nothing roomier fits it is the best
# plan, with a note saying so.
TIGHT_FILL = 0.90


def fmt_gib(n: float) -> str:
    v = n / GIB
    if v >= 100:
        return f"{v:.0f} GiB"
    return f"{v:.1f} GiB" if v >= 1 or v == 0 else f"{v:.2f} GiB"


def gib_pair(need: float, have: float, whole_from: float = 100) -> tuple[str, str]:
    """`need` and `have` in GiB rounded alike: whole from `whole_from` GiB up (fmt_gib's 100; a rejection's
    terse 10), else one decimal, and as many more as it takes not to read "needs 63 GiB; has 63 GiB"."""
    digits = 0 if min(need, have) / GIB >= whole_from else 1
    while digits < 2 and f"{need / GIB:.{digits}f}" == f"{have / GIB:.{digits}f}":
        digits += 1
    return f"{need / GIB:.{digits}f} GiB", f"{have / GIB:.{digits}f} GiB"
