"""The TOML form of a policy's values: what ``to_toml`` (nsbox/profiles/__init__.py) writes
for each key, so that loading it gives the same policy back. The parsers are in schema.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nsbox.policy.policy import Mount, SeccompRule


def mount_to_toml(item: Mount) -> dict[str, Any]:
    """A mount's table: its "type", then its fields in their order, each in the TOML form of
    its name (MOUNT_FORMATS) or as it is; a flag (writable, optional) only when it is not its
    default. Any kind of policy.MOUNT_KINDS, with no edit here."""
    entries: dict[str, Any] = {"type": item.kind}
    for spec in dataclasses.fields(item):
        value = getattr(item, spec.name)
        if spec.name == "kind" or (isinstance(value, bool) and value == spec.default):
            continue
        entries[spec.name] = MOUNT_FORMATS.get(spec.name, _as_is)(value)
    return entries


def _as_is(value: Any) -> Any:
    return value


def format_mode(value: int) -> str:
    return f"{value:04o}"


_SIZE_FACTORS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def format_size(value: int) -> str | int:
    for unit in ("T", "G", "M", "K"):
        factor = _SIZE_FACTORS[unit]
        if value >= factor and value % factor == 0:
            return f"{value // factor}{unit}"
    return value


# The TOML form of a mount's field, by its name (the parsers are schema.MOUNT_FIELDS).
MOUNT_FORMATS: dict[str, Callable[[Any], Any]] = {"size": format_size, "mode": format_mode}


def format_duration(value: float) -> str:
    """Seconds as the parser reads them back, the same float: digits and a point, never an
    exponent (``1e-07s`` is not a duration); repr's shortest digits round-trip exactly."""
    text = repr(float(value))
    if "e" in text:
        from decimal import Decimal  # only for a very small or very large value

        text = format(Decimal(text), "f")
    return f"{text.removesuffix('.0')}s"


def rule_to_toml(item: SeccompRule) -> dict[str, Any]:
    entries: dict[str, Any] = {"syscall": item.syscall, "action": item.action}
    if item.args:
        entries["args"] = [
            {"index": a.index, "op": a.op, "value": a.value, **({"mask": a.mask} if a.mask else {})}
            for a in item.args
        ]
    return entries


def none_or(fmt: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: "none" if value is None else fmt(value)
