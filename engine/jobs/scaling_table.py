"""A scaling study's table and its input, as text: the Jobs page and `rigpilot scaling` print the same cells,
and read GPU counts the same way. No engine here (the study runner is engine.jobs.scaling)."""

from __future__ import annotations

import csv
import io
from typing import Any

from rigpilot.engine.errors import UserError

MAX_POINTS = 8
ACTIVE = ("planning", "running")  # a study's states before it ends


CSV_COLUMNS = (
    "gpus", "ranks", "job", "state", "layout", "micro_batch", "grad_accum", "measured_steps", "tokens_per_s",
    "steps_per_s", "speedup", "efficiency", "predicted_tokens_per_s", "predicted_speedup", "measured_vs_predicted",
    "noise",
)  # fmt: skip


def parse_counts(text: str) -> list[int]:
    """'1,2,4' → [1, 2, 4]: GPU counts, each at least 1, no repeats, in rising order."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"expected GPU counts like 1,2,4 not {text!r}") from None
    return check_counts(counts)


def check_counts(counts: list[int], gpus_here: int | None = None) -> list[int]:
    if not counts:
        raise UserError("which GPU counts? e.g. --gpus 1,2,4")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in counts):
        raise UserError(f"GPU counts start at 1, not {min(counts)}")
    if len(set(counts)) != len(counts):
        raise UserError(f"GPU counts {counts} name a count twice")
    if len(counts) > MAX_POINTS:
        raise UserError(f"at most {MAX_POINTS} GPU counts in one study")
    if gpus_here is not None and max(counts) > gpus_here:
        raise UserError(f"this machine has {gpus_here} GPU{'s' * (gpus_here != 1)}, not {max(counts)}")
    return sorted(counts)


def cells(row: dict[str, Any]) -> list[str]:
    """A table row as text, the same in the terminal and in the GUI."""
    return [
        str(row["gpus"]),
        str(row["ranks"] if row["ranks"] is not None else "-"),
        row["job"] or "-",
        row["state"] or "-",
        _f(row["tokens_per_s"], "{:,.0f}"),
        _f(row["steps_per_s"], "{:.3g}"),
        _f(row["speedup"], "{:.2f}×") if not row.get("noise") else "noise",
        _f(row["efficiency"], "{:.0%}") if not row.get("noise") else "noise",
        _f(row["predicted_tokens_per_s"], "{:,.0f}"),
        _f(row["predicted_speedup"], "{:.2f}×"),
        _f(row["measured_vs_predicted"], "{:.3g}"),
    ]


def headers(study: dict[str, Any]) -> list[str]:
    ranks = "CPU ranks" if study.get("simulated") else "ranks"
    pred = "predicted tok/s (real GPUs)" if study.get("simulated") else "predicted tok/s"
    return ["GPUs", ranks, "job", "state", "tokens/s", "steps/s", "speed-up", "efficiency", pred,
            "predicted speed-up", "measured/predicted"]  # fmt: skip


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def text_lines(study: dict[str, Any]) -> list[str]:
    rows = [headers(study), *(cells(r) for r in study["table"])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"scaling study {study['id']}: {study['model']} on {study['machine']} ({study['state']})"]
    for r in rows:
        lines.append(
            "  ".join(
                c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    for p in study["points"]:
        if (p.get("plan") or {}).get("layout"):
            lines.append(f"  plan for {p['gpus']} GPU{'s' * (p['gpus'] != 1)}: {p['plan']['layout']}")
        if p.get("error"):
            lines.append(f"  {p['gpus']} GPU{'s' * (p['gpus'] != 1)}: {p['error']}")
    for r in study["table"]:
        if r.get("noise"):
            lines.append(f"  {r['gpus']} GPU{'s' * (r['gpus'] != 1)}: noise, speed-up not meaningful: {r['noise']}")
    if study.get("error"):
        lines.append(f"error: {study['error'].get('message')}")
    lines += study.get("words") or []
    lines += [f"note: {n}" for n in study["notes"]]
    return lines


def to_csv(study: dict[str, Any]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in study["table"]:
        w.writerow(["" if r[c] is None else r[c] for c in CSV_COLUMNS])
    return out.getvalue()
