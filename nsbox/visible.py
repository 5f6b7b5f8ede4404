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
says so (letters, marks, numbers, punctuation, symbols and the ASCII space) and it is not one
of the few printable ones drawn as a blank (``BLANK_LOOKING``: the Hangul fillers, U+2800,
variation selectors...), any other as an escape: ``\\r``, ``\\n`` and ``\\t`` by their
names, ``\\x1b`` up to U+00FF, ``\\u202e`` up to U+FFFF, ``\\U000e0041`` above (a byte
that is not UTF-8, kept by Python as a surrogate, shows as ``\\udcNN``). It has two forms:

- ``name`` for one-line values (a path, a host name, a reason): the newline and the tab are
  escaped too, and so is the backslash (``\\\\``), so that an escape shown cannot be mistaken
  for a name that spells one;
- ``quoted``, the same in double quotes, where the ends of a name must show;
- ``text`` for many lines (a diff, a message with a hint): the newline and the tab stay, the
  backslash too (code is full of them); every line is then as safe as a ``name``.

A program's own output of ``nsbox run`` or ``session exec`` is not touched: that is the
program talking to its user, as it would outside nsbox. What nsbox itself says about what the
sandbox made is passed through here. ``json_text`` is the form for programs: JSON, every
character outside printable ASCII as a ``\\u`` escape, and a name that is not UTF-8 as text with
U+FFFD and its exact bytes beside it (``json_ready``).
"""

from __future__ import annotations

import base64
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

# Printable to str.isprintable (letters, marks, symbols), yet drawn as nothing or as a blank:
# a name "n\u3164ame" would look like "n ame", a line "const { timeout,\u3164} = req.query;"
# would hide a variable (the "invisible JavaScript backdoor"), variation selectors after an
# emoji can carry any bytes unseen. These are Unicode's Default_Ignorable_Code_Point characters
# that are not already format (Cf) or unassigned ones (the Hangul fillers U+115F, U+1160,
# U+3164, U+FFA0; the combining grapheme joiner U+034F; Khmer U+17B4-U+17B5; the Mongolian
# and the other variation selectors U+180B-U+180D, U+180F, U+FE00-U+FE0F, U+E0100-U+E01EF)
# and U+2800 BRAILLE PATTERN BLANK. The other spaces (U+00A0, U+2000-U+200A, U+205F, U+3000)
# are Zs and U+180E, U+200B, U+FEFF are Cf: not printable, so escaped already.
BLANK_LOOKING = frozenset(chr(code) for low, high in (
    (0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180D), (0x180F, 0x180F),
    (0x2800, 0x2800), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFFA0, 0xFFA0), (0xE0100, 0xE01EF),
) for code in range(low, high + 1))


def drawn(text: str) -> bool:
    """Every character of ``text`` is drawn as itself: printable and not blank-looking (the
    rule of ``name``, but for the backslash; nsbox/host/autorun.py writes no other name)."""
    return text.isprintable() and (text.isascii() or BLANK_LOOKING.isdisjoint(text))


def _kept(char: str) -> bool:
    return char.isprintable() and char not in BLANK_LOOKING


def name(value: object) -> str:
    """A one-line value as it may be shown: nothing in it acts on a terminal or hides."""
    text = value if isinstance(value, str) else str(value)
    if drawn(text) and "\\" not in text:
        return text
    return "".join(c if _kept(c) and c != "\\" else _escape(c) for c in text)


def quoted(value: object) -> str:
    """``name`` in double quotes (a quote in it as ``\\"``): where the ends of a name must
    show, as in a listing of files (a name may end with spaces)."""
    return '"' + name(value).replace('"', '\\"') + '"'


def text(value: object) -> str:
    """Lines of text as they may be shown: newlines and tabs kept, the rest as ``name``."""
    body = value if isinstance(value, str) else str(value)
    return "\n".join(_line(line) for line in body.split("\n"))


def _line(line: str) -> str:
    if drawn(line):
        return line
    return "".join(c if _kept(c) or c in _TEXT_KEPT else _escape(c) for c in line)


def json_text(value: Any, **options: Any) -> str:
    """``value`` as JSON in printable ASCII only (json.dumps leaves DEL as it is), its strings
    made Unicode first (``json_ready``)."""
    return json.dumps(json_ready(value), ensure_ascii=True, **options).replace(
        "\x7f", "\\u007f")


def json_ready(value: Any) -> Any:
    """``value`` with every string made Unicode text. A name that is not UTF-8 (Python keeps
    its bytes as lone surrogates, U+DC80-U+DCFF) would be written as ``\\udcff``, an escape
    that strict JSON parsers refuse (RFC 8259, 8.2: such a string is not interoperable). It is
    written with U+FFFD for each byte that is no UTF-8 instead, and, where it is a member of an
    object, its exact bytes beside it, in base64, under the member's name with ``_bytes``
    (``"path": "bad\\ufffd", "path_bytes": "YmFk/w=="``)."""
    if isinstance(value, str):
        return value if _is_unicode(value) else _replaced(value)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            name = json_ready(key)
            if isinstance(item, str) and not _is_unicode(item):
                out[name] = _replaced(item)
                out[f"{name}_bytes"] = base64.b64encode(_raw(item)).decode()
            else:
                out[name] = json_ready(item)
        return out
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _raw(text: str) -> bytes:
    """The bytes a name with surrogate escapes stood for (os.fsencode's way)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte stands for (U+D800-U+DC7F, U+DD00-)
        return text.encode("utf-8", "surrogatepass")


def _replaced(text: str) -> str:
    return _raw(text).decode("utf-8", "replace")
