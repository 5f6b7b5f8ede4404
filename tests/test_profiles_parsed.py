"""The shipped profiles' values parsed when the package is built (nsbox/profiles/programs.py):
the same as the TOML parser's, used only for the very text they were parsed from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require

from nsbox import profiles

PARSED = Path(profiles.PARSED)


@pytest.fixture(autouse=True)
def built() -> None:
    require(PARSED.is_file(), f"no {PARSED} (pip install -e . builds it)")


def test_the_parsed_values_are_the_parsers_for_the_files_as_they_are() -> None:
    stored = json.loads(PARSED.read_text())
    assert sorted(stored) == sorted(f"profiles/{name}.toml" for name in profiles.shipped_profiles())
    for display, entry in stored.items():
        text = (REPO / "nsbox" / display).read_text()
        assert entry["text"] == text, display
        assert entry["data"] == profiles.toml().loads(text), display


def test_a_text_other_than_the_parsed_one_is_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    stored = json.loads(PARSED.read_text())
    entry = stored["profiles/default.toml"]
    # Values for another text: the file's own text no longer matches, so they are not used.
    entry["data"] = {**entry["data"], "limits": {**entry["data"]["limits"], "pids": 7}}
    entry["text"] += "\n# changed\n"
    monkeypatch.setattr(profiles, "_parsed", stored)
    assert profiles.load_profile("default").limits.pids == 128
    entry["text"] = (REPO / "nsbox" / "profiles" / "default.toml").read_text()
    assert profiles.load_profile("default").limits.pids == 7  # the text matches: used as is


def test_a_run_of_a_shipped_profile_imports_no_toml_parser() -> None:
    code = ("import sys; from nsbox.profiles import load_profile; load_profile('python'); "
            "print('tomllib' in sys.modules, 'tomli' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]
