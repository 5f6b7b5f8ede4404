"""The entry point of the ``nsbox`` command: ``nsbox run`` without importing click.

Importing click costs about 45 ms, several times a whole sandbox launch, so a plain
``nsbox run [OPTIONS] [--] COMMAND...`` is parsed here by hand and handed to nsbox/cli/run.py,
the same code the click command calls. Everything else (other commands, --help, --version, and
any form this parser does not take: bundled short flags, ``-t5``, a bad value) goes to click,
which parses and reports errors as usual. As in click's command, options stop at the command:
everything after its first word is the command's own.

One schema, two doors: RUN_OPTIONS lists ``nsbox run``'s options as click declares them in
nsbox/cli.py (flags, parameter name, kind). tests/test_perf.py checks that the two lists are the
same and that both parsers give the same parameters for the same command lines, so an option
added to the click command without being added here fails the tests.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from nsbox.units import parse_duration, parse_size

VALUE, MULTIPLE, FLAG = "value", "multiple", "flag"

# (flags, parameter name, kind), grouped as in nsbox/cli.py.
RUN_OPTIONS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    # sessions: data in and out, audit (nsbox/cli/session.py)
    (("--input",), "inputs", MULTIPLE),
    (("--collect",), "collect", MULTIPLE),
    (("--collect-dir",), "collect_dir", VALUE),
    (("--audit",), "audit", VALUE),
    # profiles (nsbox/profiles.py)
    (("-p", "--profile"), "profile", VALUE),
    (("--set",), "settings", MULTIPLE),
    (("--print-profile",), "print_profile", FLAG),
    (("--allow-rule",), "allow_rules", MULTIPLE),
    (("-t", "--time"), "wall_time", VALUE),
    (("--output-limit",), "output_limit", VALUE),
    (("-w", "--workspace"), "workspace", VALUE),
    (("--project",), "project", VALUE),
    (("--ro-bind",), "ro_bind", MULTIPLE),
    (("--bind",), "rw_bind", MULTIPLE),
    (("-e", "--env"), "env", MULTIPLE),
    (("--pass-env",), "pass_env", MULTIPLE),
    (("--cwd",), "cwd", VALUE),
    (("--json",), "as_json", FLAG),
    (("-q", "--quiet"), "quiet", FLAG),
    (("--seccomp-log",), "seccomp_log", FLAG),
    (("--net",), "net_mode", VALUE),
    (("--allow-host",), "allow_host", MULTIPLE),
    (("--ask",), "ask", FLAG),
    # limits (nsbox/limits.py)
    (("--memory",), "memory", VALUE),
    (("--pids",), "pids", VALUE),
    (("--cpus",), "cpus", VALUE),
    (("--cpu-time",), "cpu_time", VALUE),
    (("--open-files",), "open_files", VALUE),
    (("--file-size",), "file_size", VALUE),
    (("--tmp-size",), "tmp_size", VALUE),
    (("--workspace-size",), "workspace_size", VALUE),
)
# The parser of each limit option (the same as cli._LIMIT_PARSERS), by name in nsbox.limits.
LIMIT_PARSERS = {
    "memory": "parse_size", "pids": "parse_count", "cpus": "parse_cpus",
    "cpu_time": "parse_duration", "open_files": "parse_count", "file_size": "parse_size",
    "tmp_size": "parse_size", "workspace_size": "parse_size",
}
NET_MODES = ("none", "loopback", "allow")
# The click options' defaults other than None, (), False.
DEFAULTS = {"profile": "default", "collect_dir": "nsbox-output"}


class _Fallback(Exception):
    """Not a form the fast path takes: click parses it (and reports any error)."""


def _convert(name: str, flag: str, value: str) -> Any:
    """The same conversions as the click options' callbacks and types."""
    if name in LIMIT_PARSERS:
        from nsbox import limits
        from nsbox.errors import PolicyError

        try:
            return getattr(limits, LIMIT_PARSERS[name])(value, key=flag)
        except PolicyError:
            raise _Fallback from None
    try:
        if name == "wall_time":
            seconds = parse_duration(value)
            if seconds <= 0:
                raise _Fallback
            return seconds
        if name == "output_limit":
            return parse_size(value)
    except ValueError:
        raise _Fallback from None
    if name in ("workspace", "project") and os.path.exists(value) and not os.path.isdir(value):
        raise _Fallback  # click.Path(file_okay=False) refuses it
    if name == "audit" and os.path.isdir(value):
        raise _Fallback  # click.Path(dir_okay=False) refuses it
    if name == "net_mode" and value not in NET_MODES:
        raise _Fallback
    return value


def parse_run(args: list[str]) -> dict[str, Any]:
    """The parameters of ``nsbox run`` for ``args`` (what follows ``run``), as click would
    give them; raises _Fallback for anything this parser leaves to click."""
    by_flag = {flag: (name, kind) for flags, name, kind in RUN_OPTIONS for flag in flags}
    params: dict[str, Any] = {}
    for _flags, name, kind in RUN_OPTIONS:
        params[name] = () if kind == MULTIPLE else (False if kind == FLAG else None)
    params.update(DEFAULTS)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        flag, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if flag not in by_flag:
            raise _Fallback  # --help, -h, unknown options, -t5, bundled flags
        name, kind = by_flag[flag]
        if kind == FLAG:
            if eq:
                raise _Fallback
            params[name] = True
            i += 1
            continue
        if eq:
            value = inline
            i += 1
        else:
            if i + 1 >= len(args) or args[i + 1].startswith("-"):
                raise _Fallback
            value = args[i + 1]
            i += 2
        converted = _convert(name, flag, value)
        if kind == MULTIPLE:
            params[name] = (*params[name], converted)
        else:
            params[name] = converted
    command = tuple(args[i:])
    if not command:
        raise _Fallback  # click says what is missing
    params["command"] = command
    return params


def main() -> None:
    try:
        _main()
    except KeyboardInterrupt:  # Ctrl-C before or after a run (during one: _cli_run.execute)
        sys.stderr.write("nsbox: interrupted\n")
        sys.exit(130)


def _main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["run"]:
        try:
            params = parse_run(args[1:])
        except _Fallback:
            params = None
        if params is not None:
            from nsbox.helper.fork import fork_helper

            helper = fork_helper()
            from nsbox import launcher
            from nsbox.cli import run as _cli_run

            launcher._helper.adopt(*helper)
            launcher._helper.reap_at_exit()
            try:
                _cli_run.check(params)
                code = _cli_run.execute(params)
            except _cli_run.OptionError:
                pass  # click reports it; the helper ends with this process
            else:
                sys.exit(code)
    from nsbox.cli.commands import main as click_main

    click_main()
