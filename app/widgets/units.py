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


_SI_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(v: float | None, unit: str = "") -> str:
    """A count or rate to three significant digits: '14.7M tokens/s', '950 tokens/s', '1.23k'."""
    if v is None or v != v:
        return NA
    for scale, prefix in _SI_PREFIXES:
        # Rounding may carry 999.6k up to 1.00M: take the bigger prefix when it would.
        if abs(v) >= scale * 0.9995:
            text = f"{v / scale:.3g}{prefix}"
            break
    else:
        text = f"{v:.3g}" if abs(v) >= 1 or v == 0 else f"{v:.2g}"
    return f"{text} {unit}" if unit else text


def tokens_per_s(v: float | None, what: str = "tokens/s") -> str:
    return si(v, what)
