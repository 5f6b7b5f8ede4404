"""The options of ``nsbox run``, ``nsbox session exec`` and ``nsbox session start``, declared once.

Three doors read this table: the click commands (``click_options``), the hand-written fast path
of nsbox/cli/fast.py (``for_door``, ``convert``), and nsbox/cli/run.py, which turns the values
into overrides of the profile's keys (``Option.key``). The limit options come from the table of
limits in nsbox/policy/limittable.py. An option added here appears in every door that lists it, with
the same flags, value checks and default; tests/test_cli_options.py checks that.

This module is imported by the fast path on every ``nsbox run``: no click at import time (it is
imported inside ``click_options`` and the callbacks, which only click calls).
"""

from __future__ import annotations

import os

from nsbox.policy import limittable
from nsbox.policy.units import parse_duration, parse_size

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    import click

VALUE, MULTIPLE, FLAG = "value", "multiple", "flag"
RUN, EXEC, START, MCP = "run", "exec", "start", "mcp"
NET_MODES = ("none", "loopback", "allow")
ISOLATION_MODES = ("auto", "namespaces", "landlock")  # policy.ISOLATION_MODES, without its import


class Option:
    """One option: its flags, parameter name, kind (VALUE, MULTIPLE, FLAG) and how its value is
    checked (``value``: None for text, "duration", "size", "dir", "file", "choice", "limit").

    ``key`` is the profile key it overrides (`nsbox profiles show NAME` prints them all), where
    it is one; ``help`` and ``default`` are a text, or a text per door."""

    __slots__ = ("flags", "name", "kind", "value", "metavar", "help", "default", "doors", "key",
                 "choices", "limit")

    def __init__(self, flags: tuple[str, ...], name: str, kind: str = VALUE, *,
                 value: str | None = None, metavar: str | None = None,
                 help: str | dict[str, str] = "", default: str | dict[str, str] | None = None,
                 doors: tuple[str, ...] = (RUN,), key: str | None = None,
                 choices: tuple[str, ...] = (), limit: limittable.LimitSpec | None = None) -> None:
        self.flags, self.name, self.kind, self.value = flags, name, kind, value
        self.metavar, self.help, self.default, self.doors = metavar, help, default, doors
        self.key, self.choices, self.limit = key, choices, limit

    def help_for(self, door: str) -> str:
        return self.help if isinstance(self.help, str) else self.help.get(door, "")

    def default_for(self, door: str) -> str | None:
        return self.default if not isinstance(self.default, dict) else self.default.get(door)


def _limit_option(spec: limittable.LimitSpec) -> Option:
    assert spec.flag is not None
    return Option((spec.flag,), spec.name, value="limit", metavar=spec.metavar, help=spec.help,
                  doors=(RUN, START, MCP), key=spec.key, limit=spec)


# In the order of `nsbox run --help`.
OPTIONS: tuple[Option, ...] = (
    Option(("-t", "--time"), "wall_time", value="duration", metavar="SECONDS",
           key="limits.wall_time", doors=(RUN, EXEC, MCP), help={
               RUN: "Wall-clock limit; the whole sandbox is killed at the deadline.",
               EXEC: "Wall-clock limit of this command (default: the session's).",
               MCP: "Wall-clock limit of each command; bounds the timeout an agent asks "
                    "for."}),
    Option(("--output-limit",), "output_limit", value="size", metavar="BYTES",
           key="limits.output", doors=(RUN, EXEC), help={
               RUN: "Cap on stdout+stderr; the sandbox is stopped past it (status OL).",
               EXEC: "Cap on this command's stdout+stderr (default: the session's)."}),
    Option(("-w", "--workspace"), "workspace", value="dir", key="workspace.path",
           help="Host directory bound read-write at /workspace (default: a fresh tmpfs)."),
    Option(("--project",), "project", value="dir", key="workspace.project", doors=(RUN, MCP),
           help={RUN: "Host directory seen copy-on-write at /workspace; its changes are listed "
                 "after the run and never written to it (`nsbox session start --project` "
                 "keeps them for review).",
                 MCP: "Host directory seen copy-on-write at /workspace; the agent gets the "
                 "read-only tool `changes`, the user applies them (`nsbox session apply ID` "
                 "or `nsbox mcp --review ID`)."}),
    Option(("--ro-bind",), "ro_bind", MULTIPLE, metavar="SRC[:DST]",
           help="Bind a host path read-only."),
    Option(("--bind",), "rw_bind", MULTIPLE, metavar="SRC[:DST]",
           help="Bind a host path read-write."),
    Option(("-e", "--env"), "env", MULTIPLE, metavar="KEY=VAL", key="environment.set",
           doors=(RUN, EXEC), help={
               RUN: "Set a variable inside (the caller's environment never passes by itself).",
               EXEC: "Set a variable inside for this command."}),
    Option(("--pass-env",), "pass_env", MULTIPLE, metavar="NAME",
           key="environment.passthrough", help="Pass the caller's variable NAME through."),
    Option(("--cwd",), "cwd", metavar="DIR", doors=(RUN, EXEC),
           help="Working directory inside (default /workspace)."),
    Option(("--json",), "as_json", FLAG, doors=(RUN, EXEC), help={
        RUN: "Capture the output and print the result as one JSON object.",
        EXEC: "Print the result as one JSON object."}),
    Option(("--tty",), "tty", FLAG, doors=(RUN, EXEC), help={
        RUN: "Give the command a terminal of its own (a shell, a REPL, an editor), relayed to "
        "this one in raw mode with its window size; needs a terminal on stdin.",
        EXEC: "Give the command a terminal of its own, relayed to this one."}),
    Option(("--seccomp-log",), "seccomp_log", FLAG, key="seccomp.log_denied",
           help="Learning mode: report the syscalls the seccomp filter denied (still denied)."),
    Option(("-q", "--quiet"), "quiet", FLAG, doors=(RUN, EXEC),
           help="Do not say on stderr which limits this host could only approximate."),
    # network
    Option(("--net",), "net_mode", value="choice", choices=NET_MODES, doors=(RUN, MCP),
           help="none (default): no network; loopback: lo only; allow: lo plus a proxy to the "
           "--allow-host entries."),
    Option(("--allow-host",), "allow_host", MULTIPLE, metavar="HOST[:PORT]", doors=(RUN, MCP),
           help="Reachable through the proxy (implies --net allow); '*.example.org' for "
           "sub-domains. Repeatable."),
    Option(("--ask",), "ask", FLAG,
           help="With --net allow: ask on the terminal before a host not on the list is "
           "reached (each answer holds for the run; no terminal: refused)."),
    # profiles (nsbox/profiles/)
    Option(("-p", "--profile"), "profile", metavar="NAME|FILE", doors=(RUN, MCP),
           default={RUN: "default", MCP: "python"},
           help={RUN: "A shipped profile's name or a profile file (see `nsbox profiles`).",
                 MCP: "The session's profile (see `nsbox profiles`); its wall-clock limit "
                 "bounds every tool's timeout."}),
    Option(("--set",), "settings", MULTIPLE, metavar="KEY=VALUE", doors=(RUN, MCP),
           help="Override any profile key: --set limits.memory=1G --set network.mode=loopback."),
    Option(("--print-profile",), "print_profile", FLAG,
           help="Print the effective policy (profile plus options) as TOML and exit."),
    Option(("--isolation",), "isolation", value="choice", choices=ISOLATION_MODES,
           key="isolation", doors=(RUN, MCP), help="auto (default): namespaces where the host "
           "allows them, else the Landlock mode; namespaces or landlock: that one only "
           "(`nsbox doctor` says which this host allows)."),
    Option(("--allow-rule",), "allow_rules", MULTIPLE, metavar="NAME", key="allow_rules",
           doors=(RUN, MCP), help="Lift one rule of the rule book for a trusted use (a refusal "
           "names its rule). Repeatable."),
    # limits (nsbox/policy/limittable.py)
    *(_limit_option(spec) for spec in limittable.OPTION_LIMITS),
    # sessions: data in and out, audit (nsbox/cli/session.py)
    Option(("--input",), "inputs", MULTIPLE, metavar="HOST_PATH[:NAME]", doors=(RUN, MCP),
           help="Mount a host file or directory read-only at /input/NAME (repeatable)."),
    Option(("--collect",), "collect", MULTIPLE, metavar="GLOB",
           help="Copy the workspace's regular files matching GLOB out after the run."),
    Option(("--collect-dir",), "collect_dir", metavar="DIR", default="nsbox-output",
           help="Where --collect puts the files."),
    Option(("--audit",), "audit", value="file", metavar="FILE", doors=(RUN, MCP), help={
        RUN: "Append a JSON record of the run to FILE (--env values redacted).",
        MCP: "Append one JSON line per tool call to FILE."}),
)


def for_door(door: str) -> tuple[Option, ...]:
    return tuple(option for option in OPTIONS if door in option.doors)


def defaults(door: str) -> dict[str, Any]:
    """The parameters of a door's command line without any option, as click gives them."""
    empty: dict[str, Any] = {MULTIPLE: (), FLAG: False, VALUE: None}
    return {option.name: option.default_for(door) if option.default_for(door) is not None
            else empty[option.kind] for option in for_door(door)}


# --- the checks of the values, without click -----------------------------------------------------


class BadValue(ValueError):
    """A value an option refuses; the message says why."""


def convert(option: Option, flag: str, text: str) -> Any:
    """The value of ``option`` given as ``flag`` TEXT, as the click option gives it; raises
    BadValue (click's callbacks turn it into a usage error naming the option)."""
    check = _CHECKS.get(option.value or "")
    return check(option, flag, text) if check else text


def _duration(option: Option, flag: str, text: str) -> float | str:
    if text.strip().lower() == "none":
        if option.key != "limits.wall_time":
            raise BadValue("'none' is not allowed here: give a duration, e.g. 10s")
        return "none"  # the profile key's own word for no limit (nsbox run, session start)
    try:
        seconds = parse_duration(limittable.ascii_only(text))
    except ValueError as exc:
        raise BadValue(str(exc)) from None
    if seconds <= 0:
        raise BadValue("must be more than 0")
    return seconds


def _size(_option: Option, _flag: str, text: str) -> int:
    if text.strip().lower() == "none":
        raise BadValue("'none' is not allowed: the output is always capped; give a size, "
                       "e.g. 64M")
    try:
        return parse_size(limittable.ascii_only(text))
    except ValueError as exc:
        raise BadValue(str(exc)) from None


def _limit(option: Option, flag: str, text: str) -> Any:
    from nsbox.errors import PolicyError

    assert option.limit is not None
    try:
        return option.limit.parse_option(text, key=flag)
    except PolicyError as exc:
        hint = f" ({exc.hint})" if exc.hint else ""
        raise BadValue(f"{exc.message}{hint}") from None


def _directory(_option: Option, _flag: str, text: str) -> str:
    # As click.Path(file_okay=False): a path that exists must be a directory.
    if os.path.exists(text) and not os.path.isdir(text):
        raise BadValue(f"{text!r} is a file")
    return text


def _file(_option: Option, _flag: str, text: str) -> str:
    # As click.Path(dir_okay=False).
    if os.path.isdir(text):
        raise BadValue(f"{text!r} is a directory")
    return text


def _choice(option: Option, _flag: str, text: str) -> str:
    if text not in option.choices:
        raise BadValue(f"{text!r} is not one of {', '.join(option.choices)}")
    return text


_CHECKS: dict[str, Callable[[Option, str, str], Any]] = {
    "duration": _duration, "size": _size, "limit": _limit, "dir": _directory, "file": _file,
    "choice": _choice,
}


# --- the click door ---------------------------------------------------------------------------


def click_callback(kind: str) -> Callable[[click.Context, click.Parameter, str | None], Any]:
    """A click callback that checks a value of ``kind`` (a key of _CHECKS) as ``convert`` does;
    a bad one is click's usage error naming the option."""
    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        import click

        if value is None or param.name is None:
            return None
        option = _BY_NAME.get(param.name) or Option(tuple(param.opts), param.name, value=kind)
        try:
            return _CHECKS[kind](option, param.opts[0], value)
        except BadValue as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return callback


def click_option(option: Option, door: str) -> Callable[[Any], Any]:
    import click

    extra: dict[str, Any] = {}
    if option.kind == FLAG:
        extra["is_flag"] = True
    elif option.kind == MULTIPLE:
        extra["multiple"] = True
    elif option.value == "choice":
        extra["type"] = click.Choice(list(option.choices))
    elif option.value == "dir":
        extra["type"] = click.Path(file_okay=False)
    elif option.value == "file":
        extra["type"] = click.Path(dir_okay=False)
    elif option.value is not None:
        extra["callback"] = click_callback(option.value)
    if option.default_for(door) is not None:
        extra.update(default=option.default_for(door), show_default=True)
    if option.metavar:
        extra["metavar"] = option.metavar
    return click.option(*option.flags, option.name, help=option.help_for(door) or None,
                        **extra)


def click_options(door: str, only: Callable[[Option], bool] | None = None
                  ) -> Callable[[Any], Any]:
    """A decorator that gives a click command the options of ``door`` (those ``only`` keeps)."""
    def decorate(command: Any) -> Any:
        for option in reversed(for_door(door)):
            if only is None or only(option):
                command = click_option(option, door)(command)
        return command
    return decorate


_BY_NAME = {option.name: option for option in OPTIONS}
