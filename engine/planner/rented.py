"""This job here against rented machines: time and cost to finish a token budget.

Each rented machine is one the user entered in Settings ({name, gpu, gpus, price_per_gpu_hour, currency});
Rigpilot holds no market prices. It is planned like any machine, from the GPU spec table: `gpus` of that
model on one host, NVSwitch between SXM parts with NVLink and PCIe otherwise, and the planner's predicted
tokens/s gives the time. Its cost is GPU-hours × the price (electricity included, as rent is). Here the
cost is electricity only: the plan's GPUs at their power limit for that time, at the user's price per kWh;
the power limit is an upper bound (a job's measured average is in its energy figure).
"""

from __future__ import annotations

import re
from typing import Any

from rigpilot.engine.hardware.machine import Machine
from rigpilot.engine.hardware.simulated import machine_from_profile
from rigpilot.engine.hardware.specs import GpuSpec, match_spec, spec_by_key
from rigpilot.engine.planner.plan import Plan
from rigpilot.engine.schema import terms_of

JOULES_PER_KWH = 3.6e6


def _names(spec: GpuSpec) -> list[str]:
    """Names a driver could report for `spec`, its match patterns read as plain text, most likely first."""
    out = [spec.name, f"NVIDIA {spec.name}"]
    for pattern in spec.match:
        text = re.sub(r"\\b|\^|\$", "", pattern).replace("(NVIDIA )?", "NVIDIA ")
        text = re.sub(r"\[(.)[^\]]*\]", r"\1", text).replace("?", "")
        out += [text, f"NVIDIA {text}"]
    return out


def rented_machine(entry: dict[str, Any]) -> Machine:
    """The machine a rented-machine entry describes, built as a simulated profile is."""
    spec = spec_by_key(entry["gpu"])
    memory = int(spec.memory_gib * 1024 * 0.995)  # drivers report a little less than the nominal size
    name = next((n for n in _names(spec) if (m := match_spec(n, memory << 20)) is not None and m.key == spec.key), spec.name)
    n = int(entry["gpus"])
    nvswitch = bool(spec.nvlink_gen) and "sxm" in spec.form_factor.lower() and n > 1
    profile: dict[str, Any] = {
        "id": f"rented-{entry['name']}", "title": f"{entry['name']} (rented: {n}× {spec.name})",
        "host": {"hostname": entry["name"], "cpu_model": None, "sockets": 1, "cores": 16 * n, "threads": 32 * n,
                 "memory_gib": max(256, int(2 * n * spec.memory_gib)), "numa": {"0": f"0-{32 * n - 1}"}},
        "gpu": {"name": name, "memory_mib": memory, "compute_capability": spec.compute_capability,
                "power_limit_w": spec.tdp_w, "pcie_gen_max": spec.pcie_gen, "pcie_width_max": 16, "ecc": True},
        "gpus": [{"pci_bus_id": f"00000000:{i + 1:02X}:00.0", "numa_node": 0} for i in range(n)],
        "pcie": [" ".join("X" if a == b else "NODE" for b in range(n)) for a in range(n)],
        "p2p": "all",
    }  # fmt: skip
    if nvswitch:
        profile["nvlink"] = {"gen": spec.nvlink_gen, "nvswitch": True, "links_per_gpu": 18 if (spec.nvlink_gen or 0) >= 4 else 12}
    return machine_from_profile(profile)


def _power_w(plan: Plan, machine: Machine) -> float | None:
    """The plan's GPUs at their power limit (W), or None when a GPU does not say its limit nor matches a spec."""
    total = 0.0
    for i in plan.parallelism.gpu_indices:
        gpu = machine.gpu(i)
        limit = gpu.power_limit_w
        if limit is None:
            spec = match_spec(gpu.name, gpu.memory_total)
            limit = spec.tdp_w if spec else None
        if limit is None:
            return None
        total += limit
    return total * max(getattr(plan.parallelism, "nodes", 1) or 1, 1)


def row(name: str, plan: Plan | None, budget: int, *, hourly: float | None = None, currency: str | None = None,
        power_w: float | None = None, price: dict[str, Any] | None = None, why: str = "") -> dict[str, Any]:  # fmt: skip
    """One line of the comparison: predicted tokens/s, time for `budget` tokens, and what that time costs."""
    out: dict[str, Any] = {"name": name, "fits": plan is not None, "why": str(why), "why_terms": terms_of(why),
                           "tokens_per_s": None, "time_s": None, "cost": None, "currency": currency,
                           "cost_basis": None, "gpus": None}  # fmt: skip
    if plan is None:
        return out
    tps = plan.timing.tokens_per_s
    out["tokens_per_s"] = tps
    out["gpus"] = len(plan.gpu_names)
    out["layout"] = plan.parallelism.family
    if not tps or tps <= 0:
        return out
    seconds = budget / tps
    out["time_s"] = seconds
    if hourly is not None:
        out["cost"] = hourly * seconds / 3600.0
        out["cost_basis"] = "rent: GPU-hours × your price per GPU-hour"
    elif power_w is not None and price is not None:
        kwh = power_w * seconds / JOULES_PER_KWH
        out.update(cost=kwh * price["per_kwh"], currency=price["currency"], kwh=kwh,
                   cost_basis=f"electricity: {power_w:.0f} W (the GPUs' power limit, an upper bound) at your price")  # fmt: skip
    elif power_w is not None:
        out["kwh"] = power_w * seconds / JOULES_PER_KWH
        out["cost_basis"] = "no electricity price set: rigpilot settings set electricity-price 0.30 --currency EUR"
    return out


def compare(
    here: tuple[str, Plan | None, Machine], rented: list[dict[str, Any]], budget: int, price: dict[str, Any] | None,
    plan_for: Any,
) -> dict[str, Any]:
    """The comparison for `budget` tokens: this machine (its best plan) first, then each rented machine.

    `plan_for(machine)` returns (the best plan or None, why not) on that machine: the caller's own search,
    so every row is planned exactly as `rigpilot plan` plans.
    """
    label, plan, machine = here
    rows = [row(f"here: {label}", plan, budget, power_w=_power_w(plan, machine) if plan else None, price=price,
                why="" if plan else "nothing fits here")]  # fmt: skip
    for entry in rented:
        m = rented_machine(entry)
        best, why = plan_for(m)
        hourly = entry["price_per_gpu_hour"] * entry["gpus"]
        r = row(entry["name"], best, budget, hourly=hourly, currency=entry["currency"], why=why)
        r["machine"] = f"{entry['gpus']}× {entry['gpu']} at {entry['price_per_gpu_hour']:g} {entry['currency']}/GPU-hour"
        rows.append(r)
    return {"token_budget": budget, "electricity_price": price, "rows": rows}


def render(comparison: dict[str, Any]) -> list[str]:
    from rigpilot.engine.planner.durations import duration_text

    lines = [f"To process {comparison['token_budget']:,} tokens:"]
    table = [("MACHINE", "TOKENS/S", "TIME", "COST", "")]
    for r in comparison["rows"]:
        if not r["fits"]:
            table.append((r["name"], "-", "-", "-", r["why"] or "nothing fits"))
            continue
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        time = duration_text(r["time_s"]) if r["time_s"] else "-"
        cost = f"{r['cost']:,.2f} {r['currency']}" if r["cost"] is not None else "-"
        note = r.get("machine") or ""
        if r["name"].startswith("here") and r.get("cost_basis"):
            note = r["cost_basis"]
        table.append((r["name"], tps, time, cost, note))
    widths = [max(len(t[i]) for t in table) for i in range(5)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip() for t in table]
    if len(comparison["rows"]) == 1:
        from rigpilot.engine.settings import RENTED_EXAMPLE

        lines.append(f"No rented machines to compare with; add one: {RENTED_EXAMPLE}")
    return lines
