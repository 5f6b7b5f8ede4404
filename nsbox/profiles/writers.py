"""The TOML form of a policy's values: what ``to_toml`` (nsbox/profiles/__init__.py) writes
for each key, so that loading it gives the same policy back. The parsers are in schema.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nsbox.policy import Bind, File, Mount, SeccompRule, Symlink, Tmpfs


def mount_to_toml(item: Mount) -> dict[str, Any]:
    entries: dict[str, Any] = {"type": item.kind}
    if isinstance(item, Bind):
        entries.update(source=item.source, target=item.target)
        if item.writable:
            entries["writable"] = True
        if item.optional:
            entries["optional"] = True
    elif isinstance(item, Tmpfs):
        entries.update(target=item.target, size=format_size(item.size), mode=f"{item.mode:04o}")
    elif isinstance(item, File):
        entries.update(target=item.target, content=item.content, mode=f"{item.mode:04o}")
    elif isinstance(item, Symlink):
        entries.update(target=item.target, points_to=item.points_to)
    else:
        entries.update(target=item.target, mode=f"{item.mode:04o}")
    return entries


_SIZE_FACTORS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def format_size(value: int) -> str | int:
    for unit in ("T", "G", "M", "K"):
        factor = _SIZE_FACTORS[unit]
        if value >= factor and value % factor == 0:
            return f"{value // factor}{unit}"
    return value


def format_duration(value: float) -> str:
    return f"{value:g}s"


def rule_to_toml(item: SeccompRule) -> dict[str, Any]:
    entries: dict[str, Any] = {"syscall": item.syscall, "action": item.action}
    if item.args:
        entries["args"] = [
            {"index": a.index, "op": a.op, "value": a.value, **({"mask": a.mask} if a.mask else {})}
            for a in item.args
        ]
    return entries


def _none_or(fmt: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: "none" if value is None else fmt(value)
