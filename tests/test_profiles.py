"""Profiles: loading, validation errors (file, key, line, suggestion), extends and overrides."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

from nsbox import Bind, File, PolicyError, Tmpfs
from nsbox.policy.policy import DEFAULT_MOUNTS, MiB, Policy
from nsbox.profiles import (
    apply_overrides,
    load_profile,
    profile_description,
    shipped_profiles,
    to_toml,
)

SHIPPED = {"default", "python", "shell", "minimal", "net-allow", "build"}


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def error_of(path: Path) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        load_profile(str(path))
    return info.value


# --- each validation error names the file, the key and the line -------------------------------


@pytest.mark.parametrize(
    ("text", "key", "line", "message", "hint"),
    [
        ('description = "x"\nextnds = "default"\n', "extnds", 2, "unknown key",
         'did you mean "extends"?'),
        ('[limits]\npids = 5\nmemroy = "1G"\n', "limits.memroy", 3, "unknown key",
         'did you mean "memory"?'),
        ("[limit]\npids = 5\n", "limit", 1, "unknown key", 'did you mean "limits"?'),
        ('[limits]\npids = "many"\n', "limits.pids", 2,
         "expected an integer, got a string ('many')", None),
        ("[limits]\npids = true\n", "limits.pids", 2, "expected an integer, got a boolean", None),
        ("[limits]\npids = 0\n", "limits.pids", 2,
         "0 is out of range (must be at least 2; the sandbox", None),
        ("[limits]\n\nmemory = 0\n", "limits.memory", 3, "must be at least 1 byte, got 0", None),
        ('[limits]\nmemory = "12XB"\n', "limits.memory", 2,
         "'12XB' is not a size (use e.g. 4096, 64K, 256M, 1.5G)", None),
        ("[limits]\nwall_time = -1\n", "limits.wall_time", 2, "-1 is negative", None),
        ('[limits]\nwall_time = "0s"\n', "limits.wall_time", 2,
         "must be a positive duration, got '0s'", None),
        ('[limits]\ncpu_time = "soon"\n', "limits.cpu_time", 2,
         "'soon' is not a duration (use e.g. 10, 10s", None),
        ('[network]\nmode = "loopbak"\n', "network.mode", 2,
         "'loopbak' is not one of none, loopback, allow", 'did you mean "loopback"?'),
        ('[network]\nmode = "allow"\nallow = ["pypi.org:99999"]\n', "network.allow[0]", 3,
         "port 99999 is outside 1-65535", None),
        ('[network]\nallow = ["ok.example.org.", "_svc.example.org:8443", "[::1]:80", '
         '"*.example.org", "bad..example.org"]\n', "network.allow[4]", 2,
         "'bad..example.org' is not a valid host name", "write host[:port]"),
        ("[identity]\nhost_uid = 0\n", "identity.host_uid", 2,
         "0 is out of range (must be 1..4294967294)", None),
        ('[identity]\nhostname = "bad host"\n', "identity.hostname", 2,
         "'bad host' is not a host name", None),
        ('[environment.set]\n"1BAD" = "x"\n', "environment.set.1BAD", 2,
         "'1BAD' is not a variable name", None),
        ('[environment.set]\nPATH = "/x"\n', "environment.set.PATH", 2, "PATH has its own key",
         "environment.path"),
        ('[seccomp]\ndefault_action = "deny"\n', "seccomp.default_action", 2,
         "unknown action 'deny'", "use allow, kill or errno:NAME"),
        ("[filesystem]\nmounts = 3\n", "filesystem.mounts", 2, "expected an array of tables",
         None),
        ('description = "x"\nlimits = 5\n', "limits", 2, "expected a table [limits]", None),
        # Dotted and quoted keys, a table header with spaces, and keys after a multi-line string.
        ('description = """\n[limits]\nmemory = 0\n"""\nlimits.memory = 0\n',
         "limits.memory", 5, "must be at least 1 byte", None),
        ('[ "identity" ]\n"uid" = -1\n', "identity.uid", 2, "-1 is out of range", None),
        ('[seccomp]\nrules = [\n  { syscall = "ptrace", action = "nope" },\n]\n',
         "seccomp.rules[0].action", 2, "unknown action 'nope'", None),
    ],
)
def test_validation_error_names_file_key_and_line(
    tmp_path: Path, text: str, key: str, line: int, message: str, hint: str | None
) -> None:
    path = write(tmp_path, text)
    err = error_of(path)
    assert err.file == str(path)
    assert err.key == key
    assert err.line == line
    assert message in err.message
    assert str(err).startswith(f"{path}:{line}: {key}: ")
    if hint:
        assert hint in (err.hint or "")


MOUNT_HEAD = """
[[filesystem.mounts]]
type = "tmpfs"
target = "/first"

[[filesystem.mounts]]
"""


@pytest.mark.parametrize(
    ("entry", "key", "line", "message", "hint"),
    [
        ('type = "bind"\nsource = "/usr"\ntarget = "data"\n', "filesystem.mounts[1].target", 8,
         "'data' is a relative path", '"/data"'),
        ('type = "bind"\nsource = "/usr"\ntarget = "/data/../etc"\n',
         "filesystem.mounts[1].target", 8, 'contains ".."', None),
        ('type = "dir"\ntarget = "/"\n', "filesystem.mounts[1].target", 7,
         "the root itself cannot be a mount target", None),
        ('type = "dir"\ntarget = "/proc/sys"\n', "filesystem.mounts[1].target", 7,
         "/proc/sys is set up by nsbox itself", None),
        ('type = "dir"\ntarget = "/workspace/in"\n', "filesystem.mounts[1].target", 7,
         "/workspace/in is set up by nsbox itself", "workspace.path"),
        ('type = "file"\ntarget = "/etc/passwd"\ncontent = "root::0:0::/:/bin/sh"\n',
         "filesystem.mounts[1].target", 7, "/etc/passwd is written by nsbox itself", None),
        ('type = "bind"\nsource = "/nonexistent/x"\ntarget = "/x"\n',
         "filesystem.mounts[1].source", 7, "/nonexistent/x does not exist", "optional = true"),
        ('type = "bnd"\ntarget = "/x"\n', "filesystem.mounts[1].type", 6,
         "'bnd' is not one of", 'did you mean "bind"?'),
        ('type = "bind"\nsorce = "/usr"\ntarget = "/x"\n', "filesystem.mounts[1].sorce", 7,
         "unknown key", 'did you mean "source"?'),
        ('type = "bind"\ntarget = "/x"\n', "filesystem.mounts[1]", 5, 'missing "source"', None),
        ('type = "tmpfs"\ntarget = "/t"\nsize = "lots"\n', "filesystem.mounts[1].size", 8,
         "'lots' is not a size", None),
        ('type = "tmpfs"\ntarget = "/t"\nmode = "0999"\n', "filesystem.mounts[1].mode", 8,
         "'0999' is not an octal mode", None),
        ('type = "tmpfs"\ntarget = "/first"\n', "filesystem.mounts[1].target", 7,
         "/first is already the target of filesystem.mounts[0]", None),
        ('type = "bind"\nsource = "/etc"\ntarget = "/hostetc"\nwritable = true\n',
         "filesystem.mounts[1].source", 7, "refused by rule writable-system-dir: /etc",
         "--allow-rule writable-system-dir"),
        ('type = "bind"\nsource = "/var/run"\ntarget = "/hostrun"\n',
         "filesystem.mounts[1].source", 7,
         "refused by rule bind-run: /run is at or below /run", "the one file"),
        ('type = "bind"\nsource = "/"\ntarget = "/host"\n', "filesystem.mounts[1].source", 7,
         "refused by rule bind-root: / is /", "bind the directories"),
        ('type = "dir"\ntarget = "/first/sub"\n', "filesystem.mounts[1].target", 7, None, None),
        ('type = "tmpfs"\ntarget = "/usr"\n', None, None, None, None),
    ],
)
def test_mount_errors(
    tmp_path: Path, entry: str, key: str | None, line: int | None, message: str | None,
    hint: str | None
) -> None:
    path = write(tmp_path, MOUNT_HEAD + entry)
    if key is None:  # replacing an inherited mount in place is allowed
        policy = load_profile(str(path))
        assert Tmpfs("/usr", size=16 * MiB) in policy.mounts
        assert not any(isinstance(m, Bind) and m.target == "/usr" for m in policy.mounts)
        return
    if message is None:  # a mount below an earlier one is fine
        assert load_profile(str(path)).mounts[-1].target == "/first/sub"
        return
    err = error_of(path)
    assert (err.key, err.line) == (key, line)
    assert message in err.message
    if hint:
        assert hint in (err.hint or "")


def test_mount_hidden_by_a_later_mount(tmp_path: Path) -> None:
    path = write(tmp_path, """
        [[filesystem.mounts]]
        type = "bind"
        source = "/usr/bin"
        target = "/etc/tools"

        [[filesystem.mounts]]
        type = "tmpfs"
        target = "/etc"
    """)
    err = error_of(path)
    assert err.key == "filesystem.mounts[1].target"
    assert err.line == 8
    # /etc/ld.so.cache (a built-in mount) comes first and would be covered too.
    assert "would hide the earlier mount at /etc/ld.so.cache" in err.message


def test_seccomp_rule_errors(tmp_path: Path) -> None:
    path = write(tmp_path, """
        [[seccomp.rules]]
        syscall = "ptrce"
        action = "errno:EPERM"
    """)
    err = error_of(path)
    assert (err.key, err.line) == ("seccomp.rules[0].syscall", 2)
    assert err.message == "'ptrce' is not a system call libseccomp knows"
    assert err.hint == 'did you mean "ptrace"?'
    # A syscall of another architecture is accepted (and has no effect here).
    path = write(tmp_path, '[[seccomp.rules]]\nsyscall = "vm86"\naction = "errno:EPERM"\n')
    assert load_profile(str(path)).seccomp.rules[0].syscall == "vm86"

    path = write(tmp_path, """
        [[seccomp.rules]]
        syscall = "ptrace"
        action = "errno:EPREM"
    """)
    err = error_of(path)
    assert (err.key, err.line) == ("seccomp.rules[0].action", 3)
    assert err.hint == 'did you mean "EPERM"?'

    path = write(tmp_path, """
        [[seccomp.rules]]
        syscall = "ioctl"
        action = "errno:EPERM"
        args = [{ index = 1, op = "eq", value = 0x5412, mask = 3 }]
    """)
    err = error_of(path)
    assert (err.key, err.line) == ("seccomp.rules[0].args[0].mask", 4)
    assert "masked_eq" in err.message


def test_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, '[limits]\nmemory = "1G\n'))
    assert err.line == 2
    assert "not valid TOML" in err.message


def test_missing_profile_file(tmp_path: Path) -> None:
    err = error_of(tmp_path / "nope.toml")
    assert err.file == str(tmp_path / "nope.toml")
    assert "profile file not found" in err.message


def test_unknown_shipped_name_suggests() -> None:
    with pytest.raises(PolicyError) as info:
        load_profile("pyhton")
    assert "no shipped profile named 'pyhton'" in str(info.value)
    assert info.value.hint == 'did you mean "python"?'


# --- what a valid profile produces ---------------------------------------------------------------


def test_values_and_units(tmp_path: Path) -> None:
    path = write(tmp_path, """
        description = "test"
        [limits]
        memory = "1.5G"
        wall_time = "500ms"
        cpu_time = "2m"
        pids = "none"
        output = 4096
        [[filesystem.mounts]]
        type = "file"
        target = "/etc/motd"
        content = "hi"
        mode = 0o600
    """)
    policy = load_profile(str(path))
    assert policy.name == "p"
    assert policy.description == "test"
    assert policy.limits.memory == 1536 * MiB
    assert policy.limits.wall_time == 0.5
    assert policy.limits.cpu_time == 120.0
    assert policy.limits.pids is None
    assert policy.limits.output == 4096
    assert policy.mounts == (*DEFAULT_MOUNTS, File("/etc/motd", "hi", mode=0o600))
    # Everything not named keeps Policy's default: the field defaults are the schema defaults.
    assert policy.replace(description="", mounts=DEFAULT_MOUNTS, limits=Policy().limits) == \
        Policy(name="p")


def test_bind_source_is_canonical_and_optional_is_kept(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "data").mkdir(parents=True)
    (tmp_path / "via").symlink_to(real)
    (real / "link").symlink_to("data")
    path = write(tmp_path, f"""
        [filesystem]
        inherit = false

        [[filesystem.mounts]]
        type = "bind"
        source = "{tmp_path}/via/./data/"
        target = "/data"

        [[filesystem.mounts]]
        type = "bind"
        source = "{tmp_path}/via/link"
        target = "/link"

        [[filesystem.mounts]]
        type = "bind"
        source = "/bin"
        target = "/bin"

        [[filesystem.mounts]]
        type = "bind"
        source = "missing-here"
        target = "/maybe"
        optional = true
    """)
    # Every symlink on the way is resolved at load time, also a symlink as the last part: the
    # policy names what will be bound. The exception is a read-only bind onto the same path,
    # which the launch reproduces as the same link (the merged-usr /bin -> usr/bin).
    assert load_profile(str(path)).mounts == (
        Bind(str(real / "data"), "/data"),
        Bind(str(real / "data"), "/link"),
        Bind("/bin", "/bin"),
        Bind(str(tmp_path / "missing-here"), "/maybe", optional=True),
    )


def test_workspace_must_be_an_existing_directory_of_its_own(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, f'[workspace]\npath = "{tmp_path}/nope"\n'))
    assert (err.key, err.line) == ("workspace.path", 2)
    assert "does not exist" in err.message
    err = error_of(write(tmp_path, '[workspace]\npath = "/etc"\n'))
    assert (err.rule, err.key, err.line) == ("writable-system-dir", "workspace.path", 2)
    assert "refused by rule writable-system-dir: /etc" in err.message
    (tmp_path / "ws").mkdir()
    assert load_profile(str(write(tmp_path, '[workspace]\npath = "ws"\n'))).workspace == \
        str(tmp_path / "ws")


# --- extends -------------------------------------------------------------------------------------


def test_extends_chains_and_merges(tmp_path: Path) -> None:
    write(tmp_path, """
        extends = "python"
        [environment.set]
        MPLBACKEND = "svg"
        EXTRA = "1"
        [limits]
        pids = 7
        [[filesystem.mounts]]
        type = "tmpfs"
        target = "/cache"
        size = "8M"
    """, name="base.toml")
    child = write(tmp_path, """
        extends = "base.toml"
        description = "child"
        [limits]
        memory = "300M"
        [[seccomp.rules]]
        syscall = "ptrace"
        action = "errno:EPERM"
    """, name="child.toml")
    python = load_profile("python")
    policy = load_profile(str(child))
    env = dict(policy.env)
    assert env["MPLBACKEND"] == "svg"  # the child's value wins
    assert env["EXTRA"] == "1" and env["OMP_NUM_THREADS"] == "1"  # merged with the parents'
    assert policy.limits.pids == 7
    assert policy.limits.memory == 300 * MiB
    assert policy.limits.wall_time == python.limits.wall_time  # from python
    assert policy.mounts == (*python.mounts, Tmpfs("/cache", size=8 * MiB))
    assert [r.syscall for r in policy.seccomp.rules] == ["ptrace"]
    assert policy.description == "child"
    assert policy.name == "child"


def test_extends_cycle_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, 'extends = "b.toml"\n', name="a.toml")
    write(tmp_path, '# b\nextends = "./a.toml"\n', name="b.toml")
    with pytest.raises(PolicyError) as info:
        load_profile(str(tmp_path / "a.toml"))
    err = info.value
    assert (err.file, err.key, err.line) == (str(tmp_path / "b.toml"), "extends", 2)
    assert f"cycle: {tmp_path}/a.toml -> {tmp_path}/b.toml -> {tmp_path}/a.toml" in err.message


def test_extends_unknown_profile(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, '# mine\nextends = "defualt"\n'))
    assert (err.key, err.line) == ("extends", 2)
    assert err.hint == 'did you mean "default"?'


def test_minimal_drops_inherited_mounts() -> None:
    assert load_profile("minimal").mounts == ()


def test_a_file_in_the_working_directory_cannot_replace_a_shipped_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "default.toml").write_text('[limits]\nmemory = "64G"\n')
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "default.toml").write_text('[network]\nmode = "loopback"\n')
    monkeypatch.chdir(tmp_path)
    policy = load_profile("default")
    assert policy.limits.memory == 512 * MiB
    assert policy.network.mode == "none"


# --- overrides -----------------------------------------------------------------------------------


def test_overrides_use_the_same_keys_and_checks(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ws").mkdir()
    monkeypatch.chdir(tmp_path)
    policy = apply_overrides(load_profile("default"), {
        "memory": "1G", "limits.wall_time": 5, "cpu_time": None, "network": "loopback",
        "workspace": "ws", "env": {"A": "b"}, "hostname": "box",
        "mounts": [{"type": "bind", "source": "ws", "target": "/data"}],
    })
    assert policy.limits.memory == 1024 * MiB
    assert policy.limits.wall_time == 5.0
    assert policy.limits.cpu_time is None
    assert policy.network.mode == "loopback"
    assert policy.workspace == str(tmp_path / "ws")
    assert dict(policy.env) == {"A": "b"}
    assert policy.hostname == "box"
    assert policy.mounts[-1] == Bind(str(tmp_path / "ws"), "/data")

    with pytest.raises(PolicyError) as info:
        apply_overrides(policy, {"memory": 0})
    assert (info.value.key, info.value.file, info.value.line) == ("limits.memory", None, None)
    assert str(info.value) == "limits.memory: must be at least 1 byte, got 0"
    with pytest.raises(PolicyError) as info:
        apply_overrides(policy, {"memroy": "1G"})
    assert info.value.key == "memroy"
    assert info.value.hint == 'did you mean "memory"?'
    with pytest.raises(PolicyError) as info:
        load_profile("default", {"network.mode": "everything"})
    assert "'everything' is not one of none, loopback, allow" in str(info.value)


# --- the shipped profiles ------------------------------------------------------------------------


def test_shipped_profiles_load_and_print_back(tmp_path: Path) -> None:
    assert set(shipped_profiles()) == SHIPPED
    for name in SHIPPED:
        policy = load_profile(name)
        assert policy.name == name
        assert profile_description(name) and "\n" not in profile_description(name)
        assert policy.description.startswith(profile_description(name))
        text = to_toml(policy)
        saved = tmp_path / f"{name}-copy.toml"
        saved.write_text(text)
        assert load_profile(str(saved)) == policy.replace(name=f"{name}-copy")


def test_shipped_profile_essentials() -> None:
    default = load_profile("default")
    assert default.network.mode == "none" and default.seccomp.enabled
    assert default.limits.memory is not None and default.limits.pids is not None
    python = load_profile("python")
    assert dict(python.env)["MPLBACKEND"] == "Agg"
    assert all(m.optional for m in python.mounts if isinstance(m, Bind)
               and m not in default.mounts)
    net = load_profile("net-allow")
    assert net.network.mode == "allow" and net.network.allow
    build = load_profile("build")
    assert build.limits.pids > default.limits.pids  # type: ignore[operator]
    assert build.limits.memory > default.limits.memory  # type: ignore[operator]
    assert not any(m.target == "/usr" for m in load_profile("minimal").mounts)


def test_repository_profiles_dir_is_the_package_data() -> None:
    top = Path(__file__).resolve().parent.parent / "profiles"
    assert os.path.realpath(top) == str(Path(__file__).resolve().parent.parent / "nsbox"
                                        / "profiles")


def test_docs_list_every_key_with_the_schema_default() -> None:
    from nsbox.profiles import schema as _schema
    from nsbox.profiles import tomllib

    docs = (Path(__file__).resolve().parent.parent / "docs" / "profiles.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| `([^`]+)` \|", docs, re.MULTILINE))
    for key in (*_schema.FIELDS, *_schema.LIST_KEYS, "filesystem.inherit"):
        assert f"`{key}`" in docs, key
    defaults = Policy()
    checked = 0
    for key, spec in _schema.FIELDS.items():
        if key in rows:
            value: object = defaults
            for attr in spec.attr:
                value = getattr(value, attr)
            assert tomllib.loads(f"x = {rows[key]}")["x"] == spec.to_toml(value), key
            checked += 1
    # All but workspace.path and workspace.project, whose default is none.
    assert checked == len(_schema.FIELDS) - 2


def test_api_overrides_take_mount_objects_and_check_them(tmp_path: Path) -> None:
    policy = apply_overrides(Policy(), {"mounts": [Tmpfs("/cache", size=MiB), Bind("/usr", "/u")]})
    assert policy.mounts[-2:] == (Tmpfs("/cache", size=MiB), Bind("/usr", "/u"))
    with pytest.raises(PolicyError) as info:
        apply_overrides(Policy(), {"mounts": [Bind("/etc", "/e", writable=True)]})
    assert str(info.value).startswith("filesystem.mounts[0].source: refused by rule "
                                      "writable-system-dir: /etc")


def test_every_policy_field_is_a_schema_key() -> None:
    """The schema is the one description of a sandbox: a field added to Policy (or to its
    parts) without a key in nsbox/profiles/schema.py fails here."""
    import dataclasses

    from nsbox.profiles import schema as _schema

    reachable = {spec.attr for spec in _schema.FIELDS.values()}
    reachable |= {("mounts",), ("seccomp", "rules"), ("name",)}  # lists; name: the file's

    def fields(cls: type, prefix: tuple[str, ...]) -> set[tuple[str, ...]]:
        found = set()
        for f in dataclasses.fields(cls):
            default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else f.default)
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                found |= fields(type(default), (*prefix, f.name))
            else:
                found.add((*prefix, f.name))
        return found

    assert fields(Policy, ()) - reachable == set()


def test_the_default_profile_is_the_default_policy() -> None:
    # nsbox.run, Session and Pool use Policy() when given no policy; the command line uses the
    # `default` profile: both doors must start from the same sandbox.
    profile = load_profile("default")
    assert profile.description  # the profile's own text; the policy carries none
    assert profile.replace(description="") == Policy()


# --- what --print-profile writes loads back to the same values -----------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nsbox.policy.checks import MAX_SECONDS  # noqa: E402
from nsbox.profiles import writers  # noqa: E402
from nsbox.profiles.schema import Origin, duration, size  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(seconds=st.floats(min_value=5e-324, max_value=1e300, allow_nan=False,
                         allow_infinity=False), nbytes=st.integers(1, 2**63 - 1))
def test_a_duration_and_a_size_as_written_parse_back_the_same(seconds: float, nbytes: int):
    written = writers.format_duration(seconds)
    assert "e" not in written.lower().removesuffix("s")  # the parser reads no exponent
    assert duration(Origin("p.toml"), "limits.wall_time", written) == seconds
    assert size()(Origin("p.toml"), "limits.memory", writers.format_size(nbytes)) == nbytes


@settings(max_examples=40, deadline=None)
@given(wall=st.floats(min_value=1e-9, max_value=MAX_SECONDS),
       connect=st.floats(min_value=1e-9, max_value=MAX_SECONDS))
def test_print_profile_of_any_duration_loads_back(wall: float, connect: float):
    import dataclasses
    import tempfile

    policy = load_profile("default").with_limits(wall_time=wall)
    policy = policy.replace(network=dataclasses.replace(policy.network, connect_timeout=connect))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "saved.toml")
        path.write_text(to_toml(policy))
        loaded = load_profile(str(path))
    assert loaded.limits.wall_time == wall
    assert loaded.network.connect_timeout == connect


def test_seccomp_args_compare_each_argument_once(tmp_path: Path) -> None:
    args = ", ".join(f"{{ index = {i % 6}, op = \"eq\", value = 1 }}" for i in range(7))
    error = error_of(write(tmp_path, f"""
        [[seccomp.rules]]
        syscall = "ioctl"
        action = "kill"
        args = [{args}]
        """))
    assert (error.key, error.line) == ("seccomp.rules[0].args[6].index", 4)
    assert "argument 0 is already compared in this rule" in error.message


def test_a_bind_with_an_empty_source_is_refused(tmp_path: Path) -> None:
    error = error_of(write(tmp_path, """
        [[filesystem.mounts]]
        type = "bind"
        source = ""
        target = "/x"
        """))
    assert (error.key, error.line, error.message) == ("filesystem.mounts[0].source", 3,
                                                      "is empty")


@pytest.mark.parametrize("text", ['memory = "١٢M"', 'wall_time = "٣s"', "pids = 1"])
def test_limits_refused_at_load(tmp_path: Path, text: str) -> None:
    error = error_of(write(tmp_path, f"[limits]\n{text}\n"))
    assert error.line == 2 and error.file == str(tmp_path / "p.toml")
    assert ("not ASCII" in error.message) or "(must be at least 2; the sandbox's own init" \
        in error.message
