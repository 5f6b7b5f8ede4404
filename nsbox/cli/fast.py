"""The entry point of the ``nsbox`` command: ``nsbox run`` without importing click.

Importing click costs about 45 ms, several times a whole sandbox launch, so a plain
``nsbox run [OPTIONS] [--] COMMAND...`` is parsed here by hand and handed to nsbox/cli/run.py,
the same code the click command calls. Everything else (other commands, --help, --version, and
any form this parser does not take: bundled short flags, ``-t5``, a bad value) goes to click,
which parses and reports errors as usual. As in click's command, options stop at the command:
everything after its first word is the command's own.

One table, three doors: the options are declared once, in nsbox/cli/options.py, which builds
the click commands' options too; tests/test_cli_options.py checks that both parsers give the same
parameters for the same command lines.
"""

from __future__ import annotations

import gc
import sys

from nsbox.cli import options as _options

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class _Fallback(Exception):
    """Not a form the fast path takes: click parses it (and reports any error)."""


def parse_run(args: list[str]) -> dict[str, Any]:
    """The parameters of ``nsbox run`` for ``args`` (what follows ``run``), as click would
    give them; raises _Fallback for anything this parser leaves to click."""
    table = _options.for_door(_options.RUN)
    by_flag = {flag: option for option in table for flag in option.flags}
    params = _options.defaults(_options.RUN)
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
        option = by_flag[flag]
        if option.kind == _options.FLAG:
            if eq:
                raise _Fallback
            params[option.name] = True
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
        try:
            converted = _options.convert(option, flag, value)
        except _options.BadValue:
            raise _Fallback from None  # click says what is wrong
        if option.kind == _options.MULTIPLE:
            params[option.name] = (*params[option.name], converted)
        else:
            params[option.name] = converted
    command = tuple(args[i:])
    if not command:
        raise _Fallback  # click says what is missing
    params["command"] = command
    return params


def main() -> None:
    # No garbage collection while the command line imports and builds the policy: the objects
    # made then (modules, classes, the policy) live to the end, and the collector's passes
    # over them would cost a run several ms. nsbox/cli/run.py turns it back on before the
    # launch, for the rest of the process's life.
    gc.disable()
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
            from nsbox.cli import run as _cli_run

            try:
                _cli_run.check(params)
                code = _cli_run.execute(params)
            except _cli_run.OptionError:
                pass  # click reports it
            else:
                sys.exit(code)
    gc.enable()  # the other commands may live long (nsbox mcp): collected as usual
    from nsbox.cli.commands import main as click_main

    click_main()
