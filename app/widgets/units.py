"""How values read in the GUI: one place for units, rounding and "n/a"."""

from __future__ import annotations

NA = "n/a"
GIB = 1024**3
MIB = 1024**2


def percent(v: float | None) -> str:
    return NA if v is None else f"{v:.0f} %"


def gib(v: float | None, digits: int = 1) -> str:
    return NA if v is None else f"{v / GIB:.{digits}f} GiB"


def mib(v: float | None) -> str:
    return NA if v is None else f"{v / MIB:.0f} MiB"


def watts(v: float | None) -> str:
    return NA if v is None else f"{v:.0f} W"


def celsius(v: float | None) -> str:
    return NA if v is None else f"{v:.0f} °C"


def mhz(v: float | None) -> str:
    return NA if v is None else f"{v:,.0f} MHz"
