"""Link rates: tc-style text to bit/s (``parse_rate``) and back (``format_rate``)."""

from __future__ import annotations

import re

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?\s*$", re.IGNORECASE)
_RATE_MUL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(text: str | int | float | None) -> int | None:
    """A link rate in bit/s from tc-style text: '1gbit', '200mbit', '500k', '4g', 1e9.

    'bit' and a bare suffix mean bits; 'bps' means bytes per second (tc's meaning).
    None, '', 'none', 'off' and 0 mean unshaped (None).
    """
    if text is None:
        return None
    if isinstance(text, (int, float)):
        value = int(text)
    else:
        s = text.strip().lower()
        if s in ("", "none", "off", "0", "unlimited"):
            return None
        m = _RATE_RE.match(s)
        if not m:
            raise ValueError(f"bad rate {text!r}: use tc units like 1gbit, 200mbit, 500kbit")
        num, prefix, unit = m.groups()
        value = int(float(num) * _RATE_MUL[prefix.lower()] * (8 if (unit or "").lower() == "bps" else 1))
    if value <= 0:
        return None
    if value < 8000:
        raise ValueError(f"rate {text!r} is below 8 kbit/s")
    return value


def format_rate(bps: float | None) -> str:
    if bps is None:
        return "unshaped"
    for unit, mul in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= mul:
            v = bps / mul
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{bps:.0f} bit/s"
