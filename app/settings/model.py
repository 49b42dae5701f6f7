"""The Settings page's view-model: what can be set, where it is stored, and what a valid value is.

Two stores, by who reads them. The engine's `Settings` file (JSON in the config
folder) holds what the engine service acts on: the simulated profile and the
CPU-rank cap. QSettings holds what only this GUI uses: how to reach the engine
and how often charts redraw. Validation is plain functions returning an error
message or None, so the page can show it beside the field.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QSettings

from rigpilot.app.widgets.theme import Theme, parse_theme
from rigpilot.engine.hardware.simulated import DEFAULT_PROFILE, list_profiles
from rigpilot.engine.settings import Settings

KEY_ADDRESS = "engine/address"
KEY_TOKEN = "engine/token"
KEY_REFRESH_HZ = "telemetry/refresh_hz"
KEY_THEME = "appearance/theme"
DEFAULT_REFRESH_HZ = 10.0
REFRESH_RANGE = (0.5, 10.0)  # charts never redraw faster than 10 Hz: more costs CPU and shows nothing new
DEFAULT_CPU_RANKS = 4
MAX_CPU_RANKS = 1024
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


# -- GUI preferences (QSettings) -------------------------------------------------------------
def read_refresh_hz(settings: QSettings | None = None) -> float:
    """How often charts redraw, clamped to the allowed range whatever the stored value."""
    raw = (settings or QSettings()).value(KEY_REFRESH_HZ, DEFAULT_REFRESH_HZ)
    try:
        hz = float(raw)
    except (TypeError, ValueError):
        return DEFAULT_REFRESH_HZ
    return min(max(hz, REFRESH_RANGE[0]), REFRESH_RANGE[1])


def read_theme(settings: QSettings | None = None) -> Theme:
    """System, light or dark; anything else stored reads as system."""
    return parse_theme((settings or QSettings()).value(KEY_THEME, "system"))


def save_theme(theme: Theme, settings: QSettings | None = None) -> None:
    """Stored at once, apart from Save: the theme is applied as it is picked, so it is kept as it is picked."""
    s = settings or QSettings()
    s.setValue(KEY_THEME, theme)
    s.sync()


def engine_link_options(settings: QSettings | None = None) -> dict[str, str | None]:
    """`tcp` and `token` for `EngineLink(...)`: a remote engine when an address is set, else the local one."""
    s = settings or QSettings()
    address = str(s.value(KEY_ADDRESS, "") or "").strip()
    token = str(s.value(KEY_TOKEN, "") or "")
    return {"tcp": address or None, "token": (token or None) if address else None}


# -- validation --------------------------------------------------------------------------------
def validate_address(text: str) -> str | None:
    """'' (this computer), 'host:port' or '[v6]:port'; the message says what is wrong."""
    text = text.strip()
    if not text:
        return None
    m = re.fullmatch(r"\[(?P<v6>[^\]]+)\]:(?P<port>\w+)|(?P<host>[^:\s]+):(?P<port2>\w+)", text)
    if not m:
        return "Write the engine's address as host:port, e.g. workstation.lan:7860"
    host, port = (m["v6"], m["port"]) if m["v6"] else (m["host"], m["port2"])
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"The port must be a number from 1 to 65535, not {port!r}"
    if m["v6"]:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{host!r} is not an IPv6 address"
    elif not _HOSTNAME.match(host):
        return f"{host!r} is not a host name or IP address"
    return None


def validate_token(token: str, address: str) -> str | None:
    if not address.strip():
        return None  # the local engine trusts its own user through the socket's permissions
    if not token.strip():
        return "A remote engine needs its token: the text of ~/.config/rigpilot/engine-token on the workstation"
    if any(c.isspace() for c in token):
        return "The token has no spaces; paste it again"
    return None


def validate_refresh_hz(hz: float) -> str | None:
    lo, hi = REFRESH_RANGE
    return None if lo <= hz <= hi else f"Choose between {lo:g} and {hi:g} redraws per second"


def validate_cpu_ranks(n: int) -> str | None:
    return None if 1 <= n <= MAX_CPU_RANKS else f"Choose from 1 to {MAX_CPU_RANKS} ranks"


def cpu_ranks_note(n: int, cpus: int | None = None) -> str:
    """Not an error: the engine caps ranks at the CPU count itself; say so when it will."""
    cpus = cpus or os.cpu_count() or 1
    if n > cpus:
        return f"This computer has {cpus} logical CPUs, so a simulated job here runs {cpus} ranks."
    return ""


# -- the values on the page ----------------------------------------------------------------
@dataclass
class SettingsValues:
    simulated_profile: str = DEFAULT_PROFILE
    max_cpu_ranks: int = DEFAULT_CPU_RANKS
    engine_address: str = ""
    engine_token: str = ""
    refresh_hz: float = DEFAULT_REFRESH_HZ

    def errors(self, profile_ids: list[str]) -> dict[str, str]:
        """Field name -> message, for every invalid field."""
        found = {
            "engine_address": validate_address(self.engine_address),
            "engine_token": validate_token(self.engine_token, self.engine_address),
            "refresh_hz": validate_refresh_hz(self.refresh_hz),
            "max_cpu_ranks": validate_cpu_ranks(self.max_cpu_ranks),
            "simulated_profile": None
            if not profile_ids or self.simulated_profile in profile_ids
            else f"Unknown profile {self.simulated_profile!r}",
        }
        return {k: v for k, v in found.items() if v}


def load_engine_side() -> dict[str, Any]:
    """Read the engine settings and the profile list (file I/O: run it off the GUI thread)."""
    settings = Settings.load()
    return {
        "profiles": list_profiles(),
        "simulated_profile": settings.simulated_profile,
        "max_cpu_ranks": settings.max_cpu_ranks,
        "warnings": list(settings.warnings),
        "path": str(Settings.path()),
    }


def save_engine_side(values: SettingsValues) -> str:
    """Write the engine settings, keeping fields this page does not show (file I/O: off the GUI thread)."""
    settings = Settings.load()
    settings.simulated_profile = values.simulated_profile
    settings.max_cpu_ranks = values.max_cpu_ranks
    settings.save()
    return str(Settings.path())


def load_gui_side(settings: QSettings | None = None) -> dict[str, Any]:
    s = settings or QSettings()
    return {
        "engine_address": str(s.value(KEY_ADDRESS, "") or ""),
        "engine_token": str(s.value(KEY_TOKEN, "") or ""),
        "refresh_hz": read_refresh_hz(s),
    }


def save_gui_side(values: SettingsValues, settings: QSettings | None = None) -> None:
    s = settings or QSettings()
    s.setValue(KEY_ADDRESS, values.engine_address.strip())
    s.setValue(KEY_TOKEN, values.engine_token.strip() if values.engine_address.strip() else "")
    s.setValue(KEY_REFRESH_HZ, float(values.refresh_hz))
    s.sync()
