"""TOML as text: where a key stands in a file, and writing a profile back out.

tomllib returns plain values without positions, so error messages find a key's line here by
reading the text once: table headers (``[a.b]``, ``[[a.b]]``) and ``key = value`` lines, with
dotted and quoted keys. Keys inside inline tables and multi-line arrays are reported at the line
of the key that holds them. Writing TOML needs no library: profiles only use strings, numbers,
booleans, arrays and tables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
# A key (bare, quoted, dotted) followed by "=", at the start of a line.
_PART_RE = r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'"""
_KEY = re.compile(rf"^\s*((?:{_PART_RE})(?:\s*\.\s*(?:{_PART_RE}))*)\s*=")
_PART = re.compile(_PART_RE)


def _split_key(text: str) -> list[str]:
    return [p.strip("\"'") for p in _PART.findall(text)]


class KeyLines:
    """Maps key paths like ``limits.memory`` or ``filesystem.mounts[2].source`` to line numbers."""

    def __init__(self, text: str) -> None:
        self.lines: dict[str, int] = {}
        counts: dict[str, int] = {}
        table = ""
        in_multiline: str | None = None
        for number, line in enumerate(text.splitlines(), start=1):
            if in_multiline:
                if line.count(in_multiline) % 2 == 1:
                    in_multiline = None
                continue
            header = _HEADER.match(line)
            if header and "=" not in header.group(2):
                name = ".".join(_split_key(header.group(2)))
                if header.group(1) == "[[":
                    index = counts.get(name, 0)
                    counts[name] = index + 1
                    self.lines.setdefault(name, number)
                    name = f"{name}[{index}]"
                table = name
                self.lines.setdefault(table, number)
                continue
            key = _KEY.match(line)
            if key:
                path = ".".join([table, *_split_key(key.group(1))] if table else
                                _split_key(key.group(1)))
                self.lines.setdefault(path, number)
                for quote in ('"""', "'''"):
                    if line.count(quote) % 2 == 1:
                        in_multiline = quote

    def line(self, path: str) -> int | None:
        """The line of ``path`` or, failing that, of the nearest enclosing key or table."""
        while path:
            if path in self.lines:
                return self.lines[path]
            cut = max(path.rfind("."), path.rfind("["))
            path = path[:cut] if cut > 0 else ""
        return None


# --- writing -------------------------------------------------------------------------------------


def value(item: Any) -> str:
    """One TOML value: strings, booleans, integers, floats, arrays and inline tables."""
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, (int, float)):
        return repr(item)
    if isinstance(item, str):
        # JSON's escapes are TOML's, except that TOML forbids a raw DEL.
        return json.dumps(item, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(item, Mapping):
        return "{ " + ", ".join(f"{key(k)} = {value(v)}" for k, v in item.items()) + " }"
    if isinstance(item, Iterable):
        return "[" + ", ".join(value(v) for v in item) + "]"
    raise TypeError(f"no TOML form for {item!r}")


def key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else value(name)


def table(header: str, entries: Mapping[str, Any], *, array: bool = False) -> str:
    lines = [f"[[{header}]]" if array else f"[{header}]"]
    lines += [f"{key(k)} = {value(v)}" for k, v in entries.items()]
    return "\n".join(lines)
