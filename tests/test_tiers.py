"""The reading that sorts the tests into tiers (tests/_tiers.py): a test that launches through
a helper function or a table of them is marked; one that only computes is not."""

from __future__ import annotations

from pathlib import Path

import _tiers

SOURCE = '''
import nsbox

def helper(argv):
    return nsbox.run(argv)

def indirect():
    return helper(["true"])

TABLE = {"a": indirect}

def pure(x):
    return x * 2

def test_direct(sandbox):
    pass

def test_through_helpers():
    indirect()

def test_through_a_table():
    TABLE["a"]()

def test_pure():
    assert pure(2) == 4

class TestGroup:
    def test_method(self):
        helper(["true"])
'''


def test_the_reading_follows_helpers_tables_and_fixtures(tmp_path: Path) -> None:
    path = tmp_path / "test_sample.py"
    path.write_text(SOURCE)
    verdicts = {name: _tiers.launches(str(path), name) for name in (
        "test_direct", "test_through_helpers", "test_through_a_table", "test_pure", "TestGroup")}
    assert verdicts == {"test_direct": True, "test_through_helpers": True,
                        "test_through_a_table": True, "test_pure": False, "TestGroup": True}
