"""Human sizes and durations, as profiles and command-line options write them."""

from __future__ import annotations

import math
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_SIZE_FACTORS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MAX_SIZE = 2**63 - 1
_TIME_FACTORS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_size(text: str | int) -> int:
    """``"256M"``, ``"1.5G"``, ``"64KiB"``, ``4096`` -> bytes (binary multiples).

    Raises ValueError with a message that shows the accepted forms.
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(text)
        if not match and _SIZE.match(text.strip().removeprefix("-")):
            raise ValueError(f"{_cut(text)} is negative: a size is 0 or more")
        if not match:
            raise ValueError(f"{_cut(text)} is not a size (use e.g. 4096, 64K, 256M, 1.5G)")
        number = float(match.group(1)) * _SIZE_FACTORS[match.group(2).lower()]
        if not number < MAX_SIZE:  # also inf, from a number of 400 digits
            raise ValueError(f"{_cut(text)} is too large (at most 2^63 - 1 bytes, about 8388607T)")
        value = int(number)
    if value < 0:
        raise ValueError(f"{text!r} is negative")
    if value > MAX_SIZE:
        # The kernel's limits are signed 64-bit: 2^64 would wrap to 0 (no limit, or no memory).
        raise ValueError(f"{_cut(text)} is too large (at most 2^63 - 1 bytes, about 8388607T)")
    return value


def _cut(text: object) -> str:
    shown = repr(text)
    return shown if len(shown) <= 200 else shown[:200] + "..."


def parse_duration(text: str | float | int) -> float:
    """``"10s"``, ``"500ms"``, ``"2m"``, ``1.5`` -> seconds."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a duration")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _DURATION.match(text)
        if not match and _DURATION.match(text.strip().removeprefix("-")):
            raise ValueError(f"{_cut(text)} is negative: a duration is more than 0")
        if not match:
            raise ValueError(f"{_cut(text)} is not a duration (use e.g. 10, 10s, 500ms, 2m)")
        value = float(match.group(1)) * _TIME_FACTORS[(match.group(2) or "s").lower()]
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{_cut(text)} is not a finite duration")
    if value < 0:
        raise ValueError(f"{text!r} is negative")
    return value
