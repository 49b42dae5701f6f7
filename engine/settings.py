"""User settings, stored as JSON in the XDG config directory.

A settings file that cannot be read is never overwritten: it is set aside as
`settings.json.bad` (so nothing the user wrote is lost) and defaults are used,
with a warning the caller shows once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from rigpilot.engine import priority

APP = "rigpilot"


def config_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP))


def state_dir() -> Path:
    return Path(platformdirs.user_state_dir(APP))


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP))


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP))


@dataclass
class Settings:
    simulated_profile: str = "4x-rtx4090"  # the machine shown when no NVIDIA GPU is present
    max_cpu_ranks: int = 4  # ranks per job on a simulated machine, each a CPU process (also capped at the CPU count)
    # What a kWh costs the user (None: not set, jobs show energy only) and in which currency (ISO 4217 code).
    electricity_price: float | None = None
    electricity_currency: str | None = None
    # Rented machines the planner compares a job with: {name, gpu (a key of gpu_specs.json), gpus,
    # price_per_gpu_hour, currency}, as the user entered them; Rigpilot knows no market prices.
    rented_machines: list[dict[str, Any]] = field(default_factory=list)
    # Keep a process with torch imported while the engine is idle, so jobs start sooner (engine.launch.warm).
    warm_worker: bool = True
    # How much jobs give way to the desktop when the CPUs are short: a niceness, 0 to 19 (engine.priority).
    job_niceness: int = priority.NICENESS
    # Where the engine tells a headless user that a job ended, failed or restarted (engine.jobs.notify):
    # an http(s) URL that gets a JSON POST, and a command (argv list, or a string split like a shell's words,
    # never run by one) that gets the same JSON on stdin. None: not set.
    notify_webhook: str | None = None
    notify_command: list[str] | str | None = None
    warnings: list[str] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def path(cls) -> Path:
        return config_dir() / "settings.json"

    @classmethod
    def load(cls) -> Settings:
        f = cls.path()
        try:
            raw = json.loads(f.read_text())
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            bad = f.with_suffix(".json.bad")
            try:
                os.replace(f, bad)
                kept = f"kept as {bad}"
            except OSError:
                kept = "left in place"
            return cls(warnings=[f"settings file {f} is unreadable ({e}); using defaults, your file is {kept}"])
        known = {x.name for x in dataclasses.fields(cls)} - {"warnings"}
        settings = cls(**{k: v for k, v in raw.items() if k in known})
        settings._drop_invalid()
        return settings

    def _drop_invalid(self) -> None:
        """A hand-edited value the schema refuses reads as its default, with a warning; the file is left alone."""
        try:
            if self.electricity_price is not None:
                self.electricity_price = check_price(self.electricity_price, "electricity-price")
                self.electricity_currency = check_currency(self.electricity_currency)
        except ValueError as e:
            self.warnings.append(f"electricity price ignored: {e}")
            self.electricity_price = self.electricity_currency = None
        kept = []
        for entry in self.rented_machines if isinstance(self.rented_machines, list) else []:
            try:
                kept.append(check_rented_machine(entry))
            except ValueError as e:
                self.warnings.append(f"rented machine ignored: {e}")
        self.rented_machines = kept
        n = self.job_niceness
        if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= priority.MAX_NICENESS):
            self.warnings.append(f"job_niceness ignored: {n!r} is not a whole number from 0 to {priority.MAX_NICENESS}")
            self.job_niceness = Settings.job_niceness
        if self.notify_webhook is not None:
            try:
                self.notify_webhook = check_webhook(self.notify_webhook)
            except ValueError as e:
                self.warnings.append(f"notify_webhook ignored: {e}")
                self.notify_webhook = None
        if self.notify_command is not None:
            try:
                check_command(self.notify_command)
            except ValueError as e:
                self.warnings.append(f"notify_command ignored: {e}")
                self.notify_command = None

    def price(self) -> dict[str, Any] | None:
        """The electricity price as the energy figures use it: {"per_kwh", "currency"}, or None when not set."""
        if self.electricity_price is None or not self.electricity_currency:
            return None
        return {"per_kwh": self.electricity_price, "currency": self.electricity_currency}

    def save(self) -> None:
        f = self.path()
        f.parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "warnings"}
        tmp = f.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, f)  # atomic: a crash mid-write never leaves half a file


# -- the schema of the price settings: the CLI, the GUI and Settings.load all check through these --------------
MAX_PRICE = 100_000.0  # per kWh or per GPU-hour, in any currency: above it the number is a typo
MAX_RENTED_GPUS = 1024
_CURRENCY = re.compile(r"[A-Z]{3}")
RENTED_EXAMPLE = "rigpilot settings add-rented cloud-h100 --gpu h100-sxm5 --count 8 --price-per-gpu-hour 2.50 --currency USD"


def check_price(value: Any, what: str = "price") -> float:
    """A positive, finite price below MAX_PRICE (ValueError with one line otherwise)."""
    try:
        price = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, like 0.30, not {str(value)[:40]!r}") from None
    if isinstance(value, bool) or not math.isfinite(price) or price <= 0:
        raise ValueError(f"{what} must be a positive number, not {str(value)[:40]!r}")
    if price > MAX_PRICE:
        raise ValueError(f"{what} {price:g} is over {MAX_PRICE:,.0f} per unit: check the number")
    return price


def check_currency(value: Any) -> str:
    """A three-letter currency code (ISO 4217 form: EUR, USD, JPY), upper-cased."""
    text = str(value or "").strip().upper()
    if not _CURRENCY.fullmatch(text):
        raise ValueError(f"currency must be a three-letter code like EUR or USD, not {str(value or '')[:20]!r}")
    return text


def check_webhook(value: Any) -> str:
    """An http:// or https:// URL with a host. The one line never repeats the URL: it may hold a token."""
    from urllib.parse import urlsplit

    text = value.strip() if isinstance(value, str) else ""
    try:
        parts = urlsplit(text)
        _ = parts.port  # raises ValueError on a port that is not a number
    except ValueError:
        raise ValueError("the URL cannot be read as a URL") from None
    if parts.scheme.lower() not in ("http", "https"):
        given = f", not {parts.scheme[:20]}:" if parts.scheme else ""
        raise ValueError(f"it must be an http:// or https:// URL{given}")
    if not parts.hostname:
        raise ValueError("the URL names no host")
    return text


def check_command(value: Any) -> list[str]:
    """The argv of the notify command: a non-empty list of strings as given, or a string split into words."""
    if isinstance(value, str):
        try:
            argv = shlex.split(value)
        except ValueError as e:
            raise ValueError(f"the command cannot be split into words ({e})") from None
    elif isinstance(value, list) and all(isinstance(a, str) for a in value):
        argv = list(value)
    else:
        raise ValueError("it must be a command line or a list of its words")
    if not argv or not argv[0].strip():
        raise ValueError("the command is empty")
    return argv


def check_rented_machine(entry: Any) -> dict[str, Any]:
    """A rented machine as stored: {name, gpu, gpus, price_per_gpu_hour, currency}, checked and normalised."""
    from rigpilot.engine.hardware.specs import spec_by_key

    if not isinstance(entry, dict):
        raise ValueError(f"a rented machine is a table row, not {str(entry)[:40]!r}")
    name = str(entry.get("name") or "").strip()
    if not name or len(name) > 60 or any(c in name for c in "\n\t"):
        raise ValueError(f"a rented machine needs a name of 1 to 60 characters, not {name[:40]!r}")
    gpu = str(entry.get("gpu") or "").strip().lower()
    try:
        spec_by_key(gpu)
    except KeyError as e:
        raise ValueError(f"{name}: {e.args[0]}") from None
    count = entry.get("gpus")
    if isinstance(count, bool) or not isinstance(count, int | str) or not str(count).strip().isdigit():
        raise ValueError(f"{name}: the GPU count must be a whole number, not {str(count)[:20]!r}")
    count = int(count)
    if not 1 <= count <= MAX_RENTED_GPUS:
        raise ValueError(f"{name}: the GPU count must be from 1 to {MAX_RENTED_GPUS}, not {count}")
    return {
        "name": name, "gpu": gpu, "gpus": count,
        "price_per_gpu_hour": check_price(entry.get("price_per_gpu_hour"), f"{name}: price per GPU-hour"),
        "currency": check_currency(entry.get("currency")),
    }  # fmt: skip
