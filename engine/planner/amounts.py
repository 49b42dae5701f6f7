"""How the planner words an amount of memory: one rounding rule for the CLI, the engine's sentences and the GUI
(which reads plan data but never imports the memory model)."""

from __future__ import annotations

GIB = 1024**3


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
