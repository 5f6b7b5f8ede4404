"""What a person is shown of text a sandbox made: every character visible, none obeyed.

A sandbox makes file names, file contents, host names and messages, and nsbox shows them to a
person: on a terminal (``nsbox session diff``, the ``--ask`` question), in a pipe that ends on
one, in an MCP client's review pane, in a log. A terminal obeys some characters instead of
drawing them: CR and "erase line" redraw a line, cursor moves and "clear screen and
scrollback" (``ESC [3J ESC [2J``) redraw the screen, an OSC sets the title, a hyperlink or the
clipboard, and a C1 control (U+009B) is a CSI by itself on some terminals. Unicode's bidi and
format characters (U+202A-U+202E, U+2066-U+2069, zero-width ones) reorder or hide what is
drawn (CVE-2021-42574, "Trojan Source"). click removes colour sequences only, and only when
the output is no terminal: an OSC passes through a pipe all the same.

So there is one rule, for every door: a character is shown as it is when ``str.isprintable()``
says so (letters, marks, numbers, punctuation, symbols and the ASCII space), any other as an
escape: ``\\r``, ``\\n`` and ``\\t`` by their names, ``\\x1b`` up to U+00FF, ``\\u202e`` up
to U+FFFF, ``\\U000e0041`` above (a byte that is not UTF-8, kept by Python as a surrogate,
shows as ``\\udcNN``). It has two forms:

- ``name`` for one-line values (a path, a host name, a reason): the newline and the tab are
  escaped too, and so is the backslash (``\\\\``), so that an escape shown cannot be mistaken
  for a name that spells one;
- ``quoted``, the same in double quotes, where the ends of a name must show;
- ``text`` for many lines (a diff, a message with a hint): the newline and the tab stay, the
  backslash too (code is full of them); every line is then as safe as a ``name``.

A program's own output of ``nsbox run`` or ``session exec`` is not touched: that is the
program talking to its user, as it would outside nsbox. What nsbox itself says about what the
sandbox made is passed through here. ``json_text`` is the form for programs: JSON, every
character outside printable ASCII as a ``\\u`` escape.
"""

from __future__ import annotations

import json
from typing import Any

_SHORT = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\"}


def _escape(char: str) -> str:
    short = _SHORT.get(char)
    if short is not None:
        return short
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


_TEXT_KEPT = frozenset("\n\t")


def name(value: object) -> str:
    """A one-line value as it may be shown: nothing in it acts on a terminal."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else _escape(c) for c in text)


def quoted(value: object) -> str:
    """``name`` in double quotes (a quote in it as ``\\"``): where the ends of a name must
    show, as in a listing of files (a name may end with spaces)."""
    return '"' + name(value).replace('"', '\\"') + '"'


def text(value: object) -> str:
    """Lines of text as they may be shown: newlines and tabs kept, the rest as ``name``."""
    body = value if isinstance(value, str) else str(value)
    return "\n".join(_line(line) for line in body.split("\n"))


def _line(line: str) -> str:
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() or c in _TEXT_KEPT else _escape(c) for c in line)


def json_text(value: Any, **options: Any) -> str:
    """``value`` as JSON in printable ASCII only (json.dumps leaves DEL as it is)."""
    return json.dumps(value, ensure_ascii=True, **options).replace("\x7f", "\\u007f")
