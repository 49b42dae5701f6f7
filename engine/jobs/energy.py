"""GPU energy of a job: its GPUs' power telemetry integrated over its run time(s), and what that costs.

Power is integrated per GPU with the trapezoid rule over the samples' own
times, which need not be regular. A gap between two samples longer than
`max_gap` (a few sampler periods: the engine was stopped, the driver did not
answer) is not bridged: its seconds are counted as not covered and reported,
so an energy figure never silently rests on a guess. The stretch between the
run's start and its first sample (and its last sample and its end) is held at
the nearest reading when it is shorter than `max_gap`, and not covered when longer.

Attribution: the scheduler never gives one GPU to two Rigpilot jobs at once
(engine.jobs.launching.due), so a GPU's whole draw while a job holds
it is that job's: its idle baseline included, and anything outside Rigpilot
that uses the GPU meanwhile too. Each run (a resume, an automatic restart) is
integrated on its own and the job's figures add the runs up.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

JOULES_PER_KWH = 3.6e6
ATTRIBUTION = (
    "each GPU's whole draw while the job holds it (idle baseline included): "
    "the scheduler never gives a GPU to two jobs at once"
)
SET_PRICE_HINT = "set your electricity price to see the cost: rigpilot settings set electricity-price 0.30 --currency EUR"


class EnergyMeter:
    """Integrates one run's power on its GPUs, fed samples in time order (TelemetrySample.to_dict shapes)."""

    def __init__(self, gpus: Iterable[int], start: float, *, max_gap: float = 5.0, end: float | None = None):
        self.gpus = sorted(set(gpus))
        self.start = start
        self.end = end  # samples after it are ignored; None while the run goes on
        self.max_gap = max_gap
        self.last_time = start  # the newest sample time seen: where the next read of the store carries on
        self.samples = 0
        self.simulated: bool | None = None
        self._joules = {g: 0.0 for g in self.gpus}
        self._covered = {g: 0.0 for g in self.gpus}
        self._first: dict[int, tuple[float, float]] = {}
        self._last: dict[int, tuple[float, float]] = {}
        self._why_missing: dict[int, str] = {}

    def add(self, sample: dict[str, Any]) -> None:
        t = sample.get("time")
        if not isinstance(t, int | float) or t < self.start or (t <= self.last_time and self.samples):
            return
        if self.end is not None and t > self.end:
            return
        self.last_time = t
        self.samples += 1
        if sample.get("simulated") is not None:
            self.simulated = bool(sample["simulated"])
        for g in sample.get("gpus") or []:
            i = g.get("index")
            if i not in self._joules:
                continue
            p = g.get("power_w")
            if not isinstance(p, int | float) or isinstance(p, bool) or not math.isfinite(p) or p < 0:
                self._why_missing[i] = (g.get("unavailable") or {}).get("power_w", "no power reading")
                continue  # the stretch around it counts as a gap when it is longer than max_gap
            prev = self._last.get(i)
            if prev is None:
                self._first[i] = (t, float(p))
            else:
                dt = t - prev[0]
                if dt <= self.max_gap:
                    self._joules[i] += (prev[1] + p) / 2.0 * dt
                    self._covered[i] += dt
            self._last[i] = (t, float(p))

    def result(self, end: float, run: int = 1) -> dict[str, Any]:
        """This run's energy from `start` to `end`: per GPU and in all, with the seconds not covered."""
        span = max(end - self.start, 0.0)
        per_gpu: dict[str, dict[str, Any]] = {}
        total = 0.0
        worst_uncovered = 0.0
        for i in self.gpus:
            joules, covered = self._joules[i], self._covered[i]
            first, last = self._first.get(i), self._last.get(i)
            if first is not None and last is not None:
                head = first[0] - self.start
                if 0 < head <= self.max_gap:
                    joules += first[1] * head
                    covered += head
                tail = min(end, self.end if self.end is not None else end) - last[0]
                if 0 < tail <= self.max_gap:
                    joules += last[1] * tail
                    covered += tail
            uncovered = max(span - covered, 0.0)
            worst_uncovered = max(worst_uncovered, uncovered)
            entry: dict[str, Any] = {"joules": joules, "uncovered_s": uncovered}
            if first is None and i in self._why_missing:
                entry["unavailable"] = self._why_missing[i]
            per_gpu[str(i)] = entry
            total += joules
        return {
            "run": run, "start": self.start, "end": end, "seconds": span, "joules": total,
            "uncovered_s": worst_uncovered, "samples": self.samples, "simulated": self.simulated, "gpus": per_gpu,
        }  # fmt: skip


def combine(runs: list[dict[str, Any]], *, simulated: bool) -> dict[str, Any]:
    """A job's energy from its runs' (EnergyMeter.result), oldest first: totals per GPU and in all."""
    per_gpu: dict[str, dict[str, float]] = {}
    for r in runs:
        for g, e in r["gpus"].items():
            acc = per_gpu.setdefault(g, {"joules": 0.0, "uncovered_s": 0.0})
            acc["joules"] += e["joules"]
            acc["uncovered_s"] += e["uncovered_s"]
    joules = sum(r["joules"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    return {
        "joules": joules,
        "kwh": joules / JOULES_PER_KWH,
        "seconds": seconds,
        "average_w": joules / seconds if seconds > 0 else None,
        "uncovered_s": sum(r["uncovered_s"] for r in runs),
        "simulated": simulated,
        "source": "simulated GPU power (a model, not a meter)" if simulated else "the GPUs' own power readings (NVML)",
        "attribution": ATTRIBUTION,
        "gpus": per_gpu,
        "runs": runs,
    }


def with_run(energy: dict[str, Any] | None, run: dict[str, Any], *, simulated: bool) -> dict[str, Any]:
    """`energy` with `run` added, or replacing an earlier figure for the same run (a re-adopted job's)."""
    runs = [r for r in (energy or {}).get("runs", []) if r.get("run") != run["run"]]
    return combine(sorted([*runs, run], key=lambda r: r["run"]), simulated=simulated)


def job_tokens(progress: dict[str, Any] | None) -> float | None:
    t = (progress or {}).get("tokens")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) and t > 0 else None


def cost(energy: dict[str, Any] | None, progress: dict[str, Any] | None, price: dict[str, Any] | None) -> dict[str, Any]:
    """Energy in kWh and what it cost at `price` ({"per_kwh", "currency"} from Settings, or None):
    with tokens per kWh and per currency unit, and the cost per step."""
    if not energy or "kwh" not in energy:
        return {}
    kwh = energy["kwh"]
    tokens = job_tokens(progress)
    step = (progress or {}).get("step")
    out: dict[str, Any] = {"kwh": kwh, "tokens": tokens, "tokens_per_kwh": tokens / kwh if tokens and kwh > 0 else None}
    if price is None:
        out["price"] = None
        out["hint"] = SET_PRICE_HINT
        return out
    amount = kwh * price["per_kwh"]
    out.update({
        "price": price, "currency": price["currency"], "amount": amount,
        "tokens_per_currency": tokens / amount if tokens and amount > 0 else None,
        "per_step": amount / step if isinstance(step, int) and step > 0 else None,
    })  # fmt: skip
    return out


def energy_line(energy: dict[str, Any] | None, money: dict[str, Any] | None) -> str:
    """One line for `rigpilot job`: energy, cost, tokens per kWh and per currency unit, what is not covered."""
    if not energy:
        return "energy: not measured"
    if "kwh" not in energy:
        return f"energy: {energy.get('unavailable', 'not measured')}"
    parts = [f"{format_kwh(energy['kwh'])}"]
    if energy.get("average_w") is not None:
        parts.append(f"{energy['average_w']:.0f} W average")
    money = money or {}
    if money.get("amount") is not None:
        parts.append(f"{format_money(money['amount'], money['currency'])} at {money['price']['per_kwh']:g} {money['currency']}/kWh")
        if money.get("per_step") is not None:
            parts.append(f"{format_money(money['per_step'], money['currency'])} per step")
    if money.get("tokens_per_kwh") is not None:
        parts.append(f"{money['tokens_per_kwh']:,.0f} tokens/kWh")
    if money.get("tokens_per_currency") is not None:
        parts.append(f"{money['tokens_per_currency']:,.0f} tokens/{money['currency']}")
    if energy.get("uncovered_s", 0) >= 1:
        parts.append(f"{energy['uncovered_s']:.0f} s without power readings")
    label = "energy (simulated)" if energy.get("simulated") else "energy"
    return f"{label}: " + ", ".join(parts)


def format_kwh(kwh: float) -> str:
    return f"{kwh * 1000:.2f} Wh" if kwh < 1 else f"{kwh:.3f} kWh"


def format_money(amount: float, currency: str) -> str:
    if amount == 0:
        return f"0 {currency}"
    if abs(amount) < 0.01:
        return f"{amount:.6f} {currency}"
    return f"{amount:,.2f} {currency}"


# -- the supervisor's side: one meter per run, fed from the telemetry store --------------------------------------
_READ_EVERY_S = 2.0  # the store gains a sample a second; reading it on every supervisor tick would buy nothing
SLURM_NOTE = "not measured: the job runs on SLURM nodes, whose power this engine does not sample"


def new_meter(rec: Any, telemetry: Any) -> EnergyMeter | None:
    """A meter for the run `rec` starts now (or started, for a re-adopted job); None where nothing can be measured."""
    if telemetry is None or rec.slurm is not None or rec.started is None:
        return None
    # A few of the store's sample intervals: a longer silence is a gap, not a slow tick.
    return EnergyMeter(rec.gpus, rec.started, max_gap=5.0 * max(getattr(telemetry, "min_interval", 1.0), 1.0))


def catch_up(meter: EnergyMeter, telemetry: Any, *, now: float, force: bool = False) -> None:
    """Feed `meter` the samples the store gained since its last read (at most every few seconds unless `force`)."""
    if not force and now < getattr(meter, "_next_read", 0.0):
        return
    meter._next_read = now + _READ_EVERY_S  # type: ignore[attr-defined]
    try:
        for s in telemetry.each_since(meter.last_time):
            meter.add(s)
    except Exception:  # the figure must never stop a job from being watched or ended: a hole is reported instead
        log.exception("cannot read telemetry for a job's energy")


def job_energy(rec: Any, meter: EnergyMeter | None, now: float) -> dict[str, Any] | None:
    """The job's energy as clients see it: the stored runs plus the live one, if it runs."""
    if rec.slurm is not None:
        return {"unavailable": SLURM_NOTE}
    if meter is None:
        return rec.energy
    return with_run(rec.energy, meter.result(now, rec.run), simulated=rec.simulated)


def finish(rec: Any, meter: EnergyMeter | None, telemetry: Any, end: float) -> dict[str, Any] | None:
    """The job's energy with this run's final figure, to store on the record when the run ends."""
    if meter is None:
        return rec.energy
    meter.end = end
    catch_up(meter, telemetry, now=end, force=True)
    return with_run(rec.energy, meter.result(end, rec.run), simulated=rec.simulated)


_price_cache: tuple[float, Any] | None = None


def electricity_price() -> dict[str, Any] | None:
    """{"per_kwh", "currency"} from the user's Settings, or None; re-read only when the file changes."""
    global _price_cache
    from rigpilot.engine.settings import Settings

    try:
        mtime = Settings.path().stat().st_mtime
    except OSError:
        return None
    if _price_cache is None or _price_cache[0] != mtime:
        _price_cache = (mtime, Settings.load().price())
    return _price_cache[1]
