"""Mount kinds are one closed set (nsbox.policy.policy.MOUNT_KINDS): a kind declared there is
checked, read from a profile, written back and planned without an edit to those places."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from conftest import require
from test_profiles import error_of, write  # the profile tests' helpers

from nsbox.errors import PolicyError
from nsbox.plan import plan
from nsbox.policy.policy import MOUNT_KINDS, Bind, Dir, File, Policy, Symlink, Tmpfs
from nsbox.profiles import apply_overrides, load_profile, schema, to_toml
from nsbox.sandbox import mounts as sandbox_mounts
from nsbox.sandbox import native


@dataclass(frozen=True)
class Fifo:
    """A kind that exists for these tests only: its fields are of the sorts the profile's
    reader knows (a path, a required string, a mode, an integer, a flag)."""

    target: str
    label: str
    mode: int = 0o600
    capacity: int = 4096
    shared: bool = False
    kind: Literal["fifo"] = "fifo"


@pytest.fixture
def fifo_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MOUNT_KINDS, "fifo", Fifo)  # type: ignore[arg-type]


def test_the_closed_set_is_the_five_kinds() -> None:
    # In this order: the profile's "type" error lists them so.
    assert list(MOUNT_KINDS.items()) == [("bind", Bind), ("tmpfs", Tmpfs), ("file", File),
                                         ("symlink", Symlink), ("dir", Dir)]
    with pytest.raises(PolicyError) as info:
        Policy(mounts=(Fifo("/opt/f", "x"),))  # type: ignore[arg-type]
    assert info.value.key == "mounts[0]"
    assert info.value.message.startswith("expected a Bind, Tmpfs, File, Symlink or Dir, got ")


def test_a_new_kind_round_trips_through_the_profile_reader_and_writer(
        fifo_kind: None, tmp_path: Path) -> None:
    path = write(tmp_path, """
        [[filesystem.mounts]]
        type = "fifo"
        target = "/opt/pipe"
        label = "jobs"
        mode = "0640"
        shared = true
    """)
    policy = load_profile(str(path))
    assert policy.mounts[-1] == Fifo("/opt/pipe", "jobs", mode=0o640, shared=True)
    text = to_toml(policy)
    assert ('type = "fifo"\ntarget = "/opt/pipe"\nlabel = "jobs"\nmode = "0640"\n'
            'capacity = 4096\nshared = true\n') in text
    saved = tmp_path / "saved.toml"
    saved.write_text(text)
    assert load_profile(str(saved)) == policy.replace(name="saved")
    # The API's door takes the kind's objects too.
    added = apply_overrides(Policy(), {"mounts": [Fifo("/opt/q", "q", capacity=1)]})
    assert added.mounts[-1] == Fifo("/opt/q", "q", capacity=1)


@pytest.mark.parametrize(
    ("entry", "key", "line", "message"),
    [
        ('target = "/opt/pipe"\n', "filesystem.mounts[0]", 1, 'missing "label"'),
        ('target = "/opt/pipe"\nlabel = "x"\nlable = "y"\n', "filesystem.mounts[0].lable", 5,
         "unknown key"),
        ('target = "/opt/pipe"\nlabel = "x"\nmode = "0999"\n', "filesystem.mounts[0].mode", 5,
         "'0999' is not an octal mode"),
        ('target = "/opt/pipe"\nlabel = "x"\ncapacity = -1\n', "filesystem.mounts[0].capacity",
         5, "-1 is out of range (must be at least 0)"),
        ('target = "/opt/pipe"\nlabel = "x"\nshared = "yes"\n', "filesystem.mounts[0].shared", 5,
         "expected true or false, got a string ('yes')"),
        ('target = "/proc/x"\nlabel = "x"\n', "filesystem.mounts[0].target", 3, "/proc"),
    ],
)
def test_a_new_kinds_errors_name_the_key_and_line(fifo_kind: None, tmp_path: Path, entry: str,
                                                  key: str, line: int, message: str) -> None:
    err = error_of(write(tmp_path, '[[filesystem.mounts]]\ntype = "fifo"\n' + entry))
    assert (err.key, err.line) == (key, line)
    assert message in err.message
    if key.endswith(".lable"):
        assert err.hint == 'did you mean "label"?'


def test_the_kinds_are_listed_in_the_type_error(fifo_kind: None, tmp_path: Path) -> None:
    err = error_of(write(tmp_path, '[[filesystem.mounts]]\ntype = "pipe"\ntarget = "/opt/p"\n'))
    assert (err.key, err.line) == ("filesystem.mounts[0].type", 2)
    assert err.message == "'pipe' is not one of bind, tmpfs, file, symlink, dir, fifo"


def test_a_field_of_an_unknown_sort_is_named() -> None:
    @dataclass(frozen=True)
    class Odd:
        target: str
        ratio: float = 0.5
        kind: Literal["odd"] = "odd"

    ratio = dataclasses.fields(Odd)[1]
    with pytest.raises(TypeError, match="mount kind 'odd': no profile parser for its field "
                                        "'ratio' \\(float\\)"):
        schema.mount_field_parser("odd", ratio)


def test_every_kind_is_read_planned_and_handled() -> None:
    """Each declared kind: a parser for each field, a plan operation, a handler in the child."""
    for kind, cls in MOUNT_KINDS.items():
        for field in dataclasses.fields(cls):
            if field.name not in ("target", "kind"):
                assert callable(schema.mount_field_parser(kind, field))
        assert kind in plan.MOUNT_OPS, kind
        assert kind in sandbox_mounts.HANDLERS, kind


def test_a_plan_operation_the_native_core_lacks_takes_the_python_child() -> None:
    require(native.MISSING == "", native.MISSING or "the native core")
    carried = {"op": "dir", "target": "/opt/d", "mode": 0o755}
    assert native.unsupported({"mounts": [carried]}) is None
    assert native.unsupported({"mounts": [carried, {"op": "fifo", "target": "/opt/p"}]}) == (
        "fifo mounts are made by the Python child")


def test_the_plain_kinds_plan_exactly_their_fields() -> None:
    policy = Policy(mounts=(Tmpfs("/opt/t", size=4096, mode=0o700), File("/opt/f", "x"),
                            Symlink("/opt/s", "/x"), Dir("/opt/d")))
    ops = plan.build(policy, ["/bin/true"]).mounts[:4]
    assert ops == [
        {"op": "tmpfs", "target": "/opt/t", "size": 4096, "mode": 0o700},
        {"op": "file", "target": "/opt/f", "content": "x", "mode": 0o644},
        {"op": "symlink", "target": "/opt/s", "points_to": "/x"},
        {"op": "dir", "target": "/opt/d", "mode": 0o755},
    ]
