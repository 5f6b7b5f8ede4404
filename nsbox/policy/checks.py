"""Checks of single values: numbers, sizes, seconds, flags, text and paths.

A bad value is a PolicyError whose ``key`` names the parameter (``timeout``,
``limits.memory``, ``argv``...), never a raw TypeError from deep inside, never a value the kernel
or the helper would take another way (NaN as "no deadline", 2^64 bytes wrapping to 0, -1 as "no
output"). The messages quote at most ``QUOTE_MAX`` characters of the value: a wrong 1 MB
argument must not become a 1 MB message. The policy's classes check their fields with these
(nsbox/policy/policy.py), and so does every door of the API (nsbox/policy/inputs.py).
"""

from __future__ import annotations

import math
import os
from typing import Any

from nsbox.errors import PolicyError

QUOTE_MAX = 200
# The longest timeout: one year. Far below what the timers take (threading.TIMEOUT_MAX is
# 292 years on Linux; the event loops wait in steps below epoll_wait(2)'s 24.8-day maximum)
# and far above any run.
MAX_SECONDS = 365 * 24 * 3600.0
MAX_SIZE = 2**63 - 1  # bytes: what a signed 64-bit kernel value holds (memory.max, tmpfs size=)
MIN_MEMORY = 4096  # bytes: a memory limit under one page is a missing unit, not a limit


def quote(value: Any) -> str:
    """``repr(value)``, cut to QUOTE_MAX characters."""
    try:
        text = repr(value)
    except Exception:  # a caller's object whose repr fails
        text = f"<{type(value).__name__}>"
    if len(text) <= QUOTE_MAX:
        return text
    return f"{text[:QUOTE_MAX]}... ({len(text)} characters)"


def type_name(value: Any) -> str:
    return type(value).__name__


def number(value: Any, key: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"expected {what}, got {type_name(value)} {quote(value)}", key=key)
    if isinstance(value, float) and math.isnan(value):
        raise PolicyError(f"expected {what}, got NaN", key=key)
    return value


def seconds(value: Any, key: str) -> float:
    """A timeout in seconds: a finite number, more than 0, at most MAX_SECONDS."""
    amount = number(value, key, "a number of seconds")
    if not 0 < amount <= MAX_SECONDS:
        raise PolicyError(f"{quote(value)} seconds is out of range (more than 0, at most "
                          f"{MAX_SECONDS:.0f}: one year)", key=key,
                          hint="use None for the policy's default" if amount > 0 else None)
    return float(amount)


def optional_seconds(value: Any, key: str) -> float | None:
    return None if value is None else seconds(value, key)


def whole(value: Any, key: str, low: int, high: int = MAX_SIZE, what: str = "a whole number"
          ) -> int:
    """An int (not a bool, not a float) with ``low <= value <= high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"expected {what}, got {type_name(value)} {quote(value)}", key=key)
    if not low <= value <= high:
        raise PolicyError(f"{quote(value)} is out of range ({low} to {high})", key=key)
    return value


def size(value: Any, key: str, low: int = 1) -> int:
    """A size in bytes: an int from ``low`` to 2^63 - 1."""
    return whole(value, key, low, MAX_SIZE, "a size in bytes (an int)")


def memory(value: Any, key: str) -> int:
    """A memory limit in bytes; a bare number under a page is taken for a missing unit."""
    amount = size(value, key)
    if amount < MIN_MEMORY:
        raise PolicyError(f"{amount} bytes is too little memory to run anything", key=key,
                          hint=f"sizes are in bytes: did you mean {amount}M?")
    return amount


def flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"expected True or False, got {type_name(value)} {quote(value)}", key=key)
    return value


def text(value: Any, key: str, *, empty: bool = True, nul: bool = True) -> str:
    """A str without NUL (the kernel cuts C strings there) that is bytes: no lone surrogate
    but the escapes of os.fsdecode. ``nul=False`` leaves NUL out, for the fields whose content
    the rule book judges (nsbox/policy/rules.py)."""
    if not isinstance(value, str):
        raise PolicyError(f"expected a string, got {type_name(value)} {quote(value)}", key=key)
    if nul and "\0" in value:
        raise PolicyError(f"{quote(value)} contains a NUL character", key=key)
    try:  # as the kernel gets it: UTF-8, a "\udcff" of os.fsdecode as the byte 0xff
        value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise PolicyError(f"{quote(value)} holds a lone surrogate at {exc.start}, which no "
                          "byte stands for", key=key,
                          hint="bytes that are not UTF-8 come as os.fsdecode makes them "
                          "(\\udc80 to \\udcff)") from None
    if not empty and not value:
        raise PolicyError("must not be empty", key=key)
    return value


def path(value: Any, key: str) -> str:
    """A path as str (an os.PathLike is taken too)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes):
        raise PolicyError(f"expected a path as str, got bytes {quote(value)}", key=key,
                          hint="decode it first (os.fsdecode)")
    return text(value, key, empty=False)


def optional_path(value: Any, key: str) -> str | None:
    return None if value is None else path(value, key)
