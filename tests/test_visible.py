"""The one escaping rule for sandbox-made text shown to a person (nsbox/visible.py): every
character a terminal could obey is shown as an escape, and the escapes tell the text back."""

from __future__ import annotations

import base64
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from nsbox import visible

PAYLOADS = {  # what a hostile name or line holds -> how a person sees it (name)
    "a\rb": "a\\rb",
    "x\x1b[2Ky": "x\\x1b[2Ky",
    "up\x1b[1A\x1b[10D": "up\\x1b[1A\\x1b[10D",
    "\x1b[3J\x1b[2J": "\\x1b[3J\\x1b[2J",
    "\x1b]0;title\x07": "\\x1b]0;title\\x07",
    "\x1b]8;;http://x\x1b\\": "\\x1b]8;;http://x\\x1b\\\\",
    "\u009b2J": "\\x9b2J",
    "del\x7f": "del\\x7f",
    "evil\u202etxt.exe": "evil\\u202etxt.exe",
    "\u2066iso\u2069": "\\u2066iso\\u2069",
    "zero\u200bwidth\u200d\ufeff": "zero\\u200bwidth\\u200d\\ufeff",
    "tag\U000e0041": "tag\\U000e0041",
    "line\u2028sep": "line\\u2028sep",
    "nl\n+++ b/x": "nl\\n+++ b/x",
    "tab\there": "tab\\there",
    "back\\x1b": "back\\\\x1b",
    "bad\udcff": "bad\\udcff",
    "café 中文 ñ": "café 中文 ñ",
}


def test_every_payload_is_shown_as_an_escape() -> None:
    for raw, shown in PAYLOADS.items():
        assert visible.name(raw) == shown, raw
        assert shown.isprintable()


def test_text_keeps_lines_and_tabs_and_escapes_the_rest() -> None:
    assert visible.text("a\tb\nc\rd\x1b[2J\n") == "a\tb\nc\\rd\\x1b[2J\n"
    assert visible.text("C:\\path \\n") == "C:\\path \\n"  # code keeps its backslashes
    assert visible.quoted('a"b \x1b') == '"a\\"b \\x1b"'
    assert visible.json_text({"k": "\x7f\u202e\x1b"}) == '{"k": "\\u007f\\u202e\\u001b"}'
    assert json.loads(visible.json_text({"k": "\x7f"})) == {"k": "\x7f"}


def test_json_of_a_name_that_is_not_utf8_is_unicode_with_its_bytes_beside_it() -> None:
    shown = visible.json_text({"changes": [{"path": "bad\udcff.sh", "kind": "added"}],
                               "names": ["x\udc80"]})
    assert "\\udc" not in shown  # no lone surrogate escape: strict parsers refuse them
    data = json.loads(shown)
    assert data["changes"] == [{"path": "bad\ufffd.sh", "path_bytes": "YmFk/y5zaA==",
                                "kind": "added"}]
    assert base64.b64decode(data["changes"][0]["path_bytes"]) == b"bad\xff.sh"
    assert data["names"] == ["x\ufffd"]
    assert visible.json_text({"path": "café"}) == '{"path": "caf\\u00e9"}'  # UTF-8: as it was


@settings(max_examples=500, derandomize=True)
@given(st.binary())
def test_json_keeps_the_exact_bytes_of_any_name(raw: bytes) -> None:
    name = raw.decode("utf-8", "surrogateescape")  # as os.listdir gives it
    data = json.loads(visible.json_text({"path": name}))
    data["path"].encode("utf-8")  # Unicode text: no lone surrogate
    exact = base64.b64decode(data["path_bytes"]) if "path_bytes" in data else data[
        "path"].encode()
    assert exact == raw


@settings(max_examples=500, derandomize=True)
@given(st.text())
def test_a_name_is_printable_and_tells_its_text_back(raw: str) -> None:
    shown = visible.name(raw)
    assert shown.isprintable()
    # The escapes are Python's: unicode_escape reads them back, exactly.
    assert shown.encode("ascii", "backslashreplace").decode("unicode_escape") == raw


@settings(max_examples=500, derandomize=True)
@given(st.text())
def test_text_lines_are_printable_but_for_tabs(raw: str) -> None:
    for line in visible.text(raw).split("\n"):
        assert line.replace("\t", "").isprintable()


BLANK = ["\u3164", "\u115f", "\u1160", "\uffa0", "\u2800", "\u034f", "\u17b4", "\u17b5",
         "\u180b", "\u180f", "\ufe00", "\ufe0f", "\U000e0100", "\U000e01ef"]


def test_printable_characters_drawn_as_a_blank_are_escaped() -> None:
    """str.isprintable() is True for them, yet a terminal draws nothing or a blank: a file
    "n\\u3164ame" would look like "n ame", and the "invisible JavaScript backdoor" hides a
    variable in a line of a diff."""
    for char in BLANK:
        assert char.isprintable(), hex(ord(char))  # what the rule alone would have kept
        shown = visible.name(f"n{char}ame")
        assert shown == "n" + char.encode("unicode_escape").decode() + "ame", hex(ord(char))
        assert not visible.drawn(f"n{char}ame")
    backdoor = "const { timeout,\u3164} = req.query;\nexec(\u3164)\t;"
    assert visible.text(backdoor) == "const { timeout,\\u3164} = req.query;\nexec(\\u3164)\t;"
    assert visible.quoted("\u2800") == '"\\u2800"'
    # The other spaces are escaped already (Zs, Cf: not printable), and stay so.
    for char in ["\u00a0", "\u2000", "\u200a", "\u205f", "\u3000", "\u180e", "\ufeff"]:
        assert visible.name(char) == char.encode("unicode_escape").decode()
    assert visible.name("café 中文 한국어 ❤") == "café 中文 한국어 ❤"  # real letters stay
    assert visible.drawn("café 中文") and visible.drawn("a b")
