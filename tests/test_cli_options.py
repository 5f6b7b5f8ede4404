"""The option table of nsbox/cli/options.py and the table of limits of nsbox/policy/limits.py: every
door (the click commands ``nsbox run`` and ``nsbox session exec``, the fast path of ``nsbox
run``, the profile schema) is derived from them, so an option or a limit added there appears
in each."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
import pytest

from nsbox.cli import commands as cli
from nsbox.cli import fast as _fastcli
from nsbox.cli import options as _options
from nsbox.cli import run as _cli_run
from nsbox.cli import session as _cli_session
from nsbox.cli import shared
from nsbox.errors import PolicyError
from nsbox.policy import limittable
from nsbox.policy.policy import Limits
from nsbox.profiles import schema as _schema


def click_table(command: click.Command) -> dict[str, tuple[tuple[str, ...], str]]:
    """A click command's options: name -> (flags, kind)."""
    table = {}
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        kind = "flag" if param.is_flag else ("multiple" if param.multiple else "value")
        table[param.name or ""] = (tuple(sorted(param.opts)), kind)
    return table


def option_table(door: str) -> dict[str, tuple[tuple[str, ...], str]]:
    return {o.name: (tuple(sorted(o.flags)), o.kind) for o in _options.for_door(door)}


def click_defaults(command: click.Command, args: list[str]) -> dict[str, Any]:
    with command.make_context("x", args) as ctx:
        return dict(ctx.params)


def test_the_click_commands_declare_exactly_the_table():
    assert click_table(cli.run) == option_table(_options.RUN)
    assert click_table(_cli_session.exec_) == option_table(_options.EXEC)
    exec_params = click_defaults(_cli_session.exec_, ["ID", "true"])
    assert {k: v for k, v in exec_params.items() if k not in ("session_id", "command")} \
        == _options.defaults(_options.EXEC)
    # nsbox session start shares the limit options.
    start = click_table(_cli_session.start)
    limit_names = {o.name for o in _options.for_door(_options.START)}
    assert {k: v for k, v in start.items() if k in limit_names} == option_table(_options.START)


def test_the_fast_path_takes_every_option_of_the_table():
    by_hand = _fastcli.parse_run(["true"])
    assert set(by_hand) == {o.name for o in _options.for_door(_options.RUN)} | {"command"}
    with cli.run.make_context("run", ["true"]) as ctx:
        assert by_hand == ctx.params


def test_an_option_added_to_the_table_appears_in_every_door(monkeypatch: pytest.MonkeyPatch):
    added = _options.Option(("--shade",), "shade", value="size", metavar="BYTES",
                            doors=(_options.RUN, _options.EXEC), help="A test option.",
                            key="limits.shm_size")
    monkeypatch.setattr(_options, "OPTIONS", (*_options.OPTIONS, added))

    def command(door: str) -> click.Command:
        return click.command()(_options.click_options(door)(lambda **values: values))

    for door in (_options.RUN, _options.EXEC):
        assert click_table(command(door))["shade"] == (("--shade",), "value")
        with command(door).make_context("x", ["--shade", "2K"]) as ctx:
            assert ctx.params["shade"] == 2048
        with pytest.raises(click.BadParameter, match="not a size"):
            command(door).make_context("x", ["--shade", "lots"])
    assert "--shade" not in str(command(_options.START).params)
    params = _fastcli.parse_run(["--shade=1K", "--", "true"])
    assert params["shade"] == 1024
    with pytest.raises(_fastcli._Fallback):
        _fastcli.parse_run(["--shade", "lots", "true"])
    # And it overrides its profile key.
    assert _cli_run.overrides_from_options(params)["limits.shm_size"] == 1024


def test_options_become_their_profile_keys():
    params = _fastcli.parse_run(["-t", "3", "--pass-env", "HOME", "-e", "A=1", "--seccomp-log",
                                 "--allow-rule", "bind-run", "--project", "/tmp", "true"])
    overrides = _cli_run.overrides_from_options(params)
    assert overrides == {
        "limits.wall_time": 3.0, "limits.output": None, "workspace.path": None,
        "workspace.project": "/tmp", "environment.set": {"A": "1"},
        "environment.passthrough": ["HOME"], "seccomp.log_denied": True,
        "allow_rules": ["bind-run"], "isolation": None}


# --- the table of limits ---------------------------------------------------------------------


def test_every_limits_field_is_in_the_table_of_limits():
    assert [f.name for f in dataclasses.fields(Limits)] == sorted(
        limittable.BY_NAME, key=[f.name for f in dataclasses.fields(Limits)].index)
    assert set(limittable.BY_NAME) == {f.name for f in dataclasses.fields(Limits)}


def test_the_schema_and_the_options_come_from_the_table_of_limits():
    for spec in limittable.LIMITS:
        assert _schema.FIELDS[spec.key].attr == ("limits", spec.name)
    flagged = {spec.flag: spec.name for spec in limittable.LIMITS if spec.flag}
    run_limits = {o.flags[0]: o.name for o in _options.for_door(_options.RUN) if o.limit}
    assert run_limits == flagged
    assert shared.LIMIT_PARSERS.keys() == set(flagged.values())


def test_a_limit_added_to_the_table_gets_its_profile_key(monkeypatch: pytest.MonkeyPatch):
    added = limittable.LimitSpec("threads", limittable.COUNT, nullable=True, flag="--threads")
    monkeypatch.setattr(limittable, "LIMITS", (*limittable.LIMITS, added))
    fields = _schema.limit_fields("limits.")
    origin = _schema.Origin("test.toml")
    assert fields["limits.threads"].attr == ("limits", "threads")
    assert fields["limits.threads"].parse(origin, "limits.threads", 8) == 8
    assert fields["limits.threads"].parse(origin, "limits.threads", "none") is None
    with pytest.raises(Exception, match="out of range"):
        fields["limits.threads"].parse(origin, "limits.threads", 0)
    assert added.parse_option("16") == 16
    with pytest.raises(Exception, match="--threads"):
        added.parse_option("0")


def test_the_limit_checks_come_from_the_table():
    with pytest.raises(PolicyError, match="limits.shm_size"):
        Limits(shm_size=0)
    assert Limits(output=0).output == 0  # the table's range of output starts at zero
    # None ("no limit") only where the table allows it: a tmpfs always has a size.
    assert Limits(memory=None, pids=None, workspace_size=None).memory is None
    for name in ("output", "tmp_size", "shm_size", "open_files"):
        with pytest.raises(PolicyError, match=f"limits.{name}"):
            Limits(**{name: None})
    for name, value in (("wall_time", float("nan")), ("memory", 2**64), ("pids", "5"),
                        ("cpus", 0), ("require_cgroup", 1)):
        with pytest.raises(PolicyError, match=f"limits.{name}"):
            Limits(**{name: value})


# --- the fast path parses as click does --------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["--", "/bin/true"],
    ["true"],
    ["-t", "1.5", "--output-limit", "1K", "--", "sh", "-c", "echo hi"],
    ["--time=2m", "-w", "/tmp", "--ro-bind", "/etc:/hostetc", "--ro-bind=/opt", "--bind",
     "/tmp:/scratch", "-e", "A=1", "--env=B=2", "--pass-env", "HOME", "--cwd", "/tmp",
     "--json", "--seccomp-log", "--net", "loopback", "--", "ls", "-la"],
    ["--net=allow", "--allow-host", "example.org:443", "--allow-host=*.test", "echo", "x"],
    ["-p", "python", "--set", "limits.memory=64M", "--set=hostname=box", "--print-profile", "--",
     "true"],
    ["--profile=minimal", "true"],
    ["echo", "--json"], ["ls", "-w", "data", "--", "-t", "1"], ["--json", "python3", "-c", "1"],
    ["--input", "/etc/hostname:h", "--collect", "*.txt", "--collect-dir=out", "--audit",
     "/tmp/audit.jsonl", "--", "true"],
    ["--memory", "256M", "--pids=64", "--cpus", "0.5", "--cpu-time", "10s", "--open-files", "99",
     "--file-size", "1M", "--tmp-size=8M", "--workspace-size", "16M", "--", "true"],
])
def test_fast_path_and_click_parse_the_same(args: list[str]):
    from nsbox.cli import commands as cli
    from nsbox.cli import fast as _fastcli

    with cli.run.make_context("run", list(args)) as ctx:
        by_click = dict(ctx.params)
    by_hand = _fastcli.parse_run(list(args))
    assert by_hand == by_click


@pytest.mark.parametrize("args", [
    ["--help"], ["-h", "true"], ["-t5", "true"], ["--time", "0", "true"], ["--time", "x", "true"],
    ["--net", "everything", "true"], ["--json=1", "true"], ["--unknown", "true"], [],
    ["--cwd"], ["--output-limit", "lots", "true"], ["--memory", "0", "true"],
    ["--pids", "many", "true"], ["--print-profile"],
])
def test_fast_path_leaves_the_rest_to_click(args: list[str]):
    from nsbox.cli import fast as _fastcli

    with pytest.raises(_fastcli._Fallback):
        _fastcli.parse_run(list(args))


