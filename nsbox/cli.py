"""The nsbox command line. Only this module prints and picks exit codes.

Exit codes of ``nsbox run``: the command's own status, 128+N when it was killed by signal N, and
for what nsbox decided:

  123  the output limit was reached (OL)
  124  the wall-clock or CPU time limit was reached (TO)
  125  the sandbox could not be set up, or nsbox itself failed (XX)
  126  the command is not executable inside the sandbox
  127  the command was not found inside the sandbox
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import click

import nsbox
from nsbox import limits
from nsbox.errors import CommandNotFound, NsboxError, PolicyError, SetupError
from nsbox.network import from_options
from nsbox.policy import Bind, Policy
from nsbox.result import Result, Status
from nsbox.units import parse_duration, parse_size

EXIT_OUTPUT_LIMIT = 123
EXIT_TIMEOUT = 124
EXIT_SETUP = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


def _fail(error: NsboxError) -> None:
    """Print ``nsbox: <step>: <reason>`` (and the hint) and exit with the matching code."""
    click.echo(f"nsbox: {error}", err=True)
    if isinstance(error, CommandNotFound):
        sys.exit(EXIT_NOT_FOUND)
    if isinstance(error, SetupError) and error.step == "exec":
        sys.exit(EXIT_NOT_EXECUTABLE)
    sys.exit(EXIT_SETUP)


def _exit_code(result: Result) -> int:
    if result.status is Status.TO:
        return EXIT_TIMEOUT
    if result.status is Status.OL:
        return EXIT_OUTPUT_LIMIT
    if result.signal is not None:
        return 128 + result.signal
    return result.exit_code or 0


def _split_bind(spec: str, writable: bool) -> Bind:
    source, _, target = spec.partition(":")
    if not source:
        raise click.BadParameter(f"{spec!r}: expected SRC[:DST]")
    return Bind(os.path.abspath(source), target or os.path.abspath(source), writable=writable)


def _size(_ctx: Any, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _duration(_ctx: Any, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None
    if seconds <= 0:
        raise click.BadParameter("must be more than 0", param=param)
    return seconds


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from nsbox.version import describe

        click.echo(describe())
        ctx.exit()


# --- resource limit options (limits.py; docs/limits.md) ---------------------------------------
# One parser per kind of value, shared by every option of that kind; a bad value (``--memory 0``,
# ``--memory lots``) is a usage error that names the option and says what to write.
_LIMIT_PARSERS: dict[str, Any] = {
    "memory": limits.parse_size, "pids": limits.parse_count, "cpus": limits.parse_cpus,
    "cpu_time": limits.parse_duration, "open_files": limits.parse_count,
    "file_size": limits.parse_size, "tmp_size": limits.parse_size,
    "workspace_size": limits.parse_size,
}


def _limit(_ctx: Any, param: click.Parameter, value: str | None) -> Any:
    if value is None or param.name is None:
        return None
    try:
        return _LIMIT_PARSERS[param.name](value, key=param.opts[0])
    except PolicyError as exc:
        hint = f" ({exc.hint})" if exc.hint else ""
        raise click.BadParameter(f"{exc.message}{hint}", param=param) from None


def _limit_options(command: Any) -> Any:
    specs = [
        ("--memory", "SIZE", "Memory limit, swap off (e.g. 256M); past it: OOM kill (ML)."),
        ("--pids", "N", "Most processes and threads at once."),
        ("--cpus", "SHARE", "Share of cores (e.g. 0.5)."),
        ("--cpu-time", "DURATION", "Total CPU time (e.g. 10s); over it the run ends (TO)."),
        ("--open-files", "N", "Most open file descriptors per process."),
        ("--file-size", "SIZE", "Largest file a process may write."),
        ("--tmp-size", "SIZE", "Size of the tmpfs at /tmp."),
        ("--workspace-size", "SIZE", "Size of the tmpfs at /workspace (without --workspace)."),
    ]
    for flag, metavar, text in reversed(specs):
        command = click.option(flag, callback=_limit, metavar=metavar, help=text)(command)
    return command


def _with_limits(policy: Policy, values: dict[str, Any]) -> Policy:
    changes = {k: v for k, v in values.items() if k in _LIMIT_PARSERS and v is not None}
    return policy.with_limits(**changes) if changes else policy

# --- end of resource limit options ---------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="Show the version and the commit, then exit.")
def main() -> None:
    """nsbox: run untrusted code in a Linux sandbox built from kernel namespaces."""


@main.command(context_settings={"ignore_unknown_options": False})
@click.option("-t", "--time", "wall_time", callback=_duration, metavar="SECONDS",
              help="Wall-clock limit; the whole sandbox is killed at the deadline.")
@click.option("--output-limit", callback=_size, metavar="BYTES",
              help="Cap on stdout+stderr; the sandbox is stopped past it (status OL).")
@click.option("-w", "--workspace", type=click.Path(file_okay=False),
              help="Host directory bound read-write at /workspace (default: a fresh tmpfs).")
@click.option("--ro-bind", multiple=True, metavar="SRC[:DST]", help="Bind a host path read-only.")
@click.option("--bind", "rw_bind", multiple=True, metavar="SRC[:DST]",
              help="Bind a host path read-write.")
@click.option("-e", "--env", multiple=True, metavar="KEY=VAL",
              help="Set a variable inside (the caller's environment never passes by itself).")
@click.option("--pass-env", multiple=True, metavar="NAME",
              help="Pass the caller's variable NAME through.")
@click.option("--cwd", metavar="DIR", help="Working directory inside (default /workspace).")
@click.option("--json", "as_json", is_flag=True,
              help="Capture the output and print the result as one JSON object.")
@click.option("--seccomp-log", is_flag=True,
              help="Learning mode: report the syscalls the seccomp filter denied (still "
              "denied).")
# --- network (docs/network.md) ---
@click.option("--net", "net_mode", type=click.Choice(["none", "loopback", "allow"]),
              help="none (default): no network; loopback: lo only; allow: lo plus a proxy to "
              "the --allow-host entries.")
@click.option("--allow-host", multiple=True, metavar="HOST[:PORT]",
              help="Reachable through the proxy (implies --net allow); '*.example.org' for "
              "sub-domains. Repeatable.")
# --- end network ---
@_limit_options
@click.argument("command", nargs=-1, required=True)
def run(wall_time: float | None, output_limit: int | None, workspace: str | None,
        ro_bind: tuple[str, ...], rw_bind: tuple[str, ...], env: tuple[str, ...],
        pass_env: tuple[str, ...], cwd: str | None, as_json: bool, seccomp_log: bool,
        net_mode: str | None, allow_host: tuple[str, ...], command: tuple[str, ...],
        **limit_values: Any) -> None:
    """Run COMMAND in a new sandbox.

    \b
    Example:
      nsbox run --time 10 -- python3 -c 'print("hello from the sandbox")'
    """
    policy = _with_limits(Policy(), limit_values)
    extra = tuple(_split_bind(s, False) for s in ro_bind)
    extra += tuple(_split_bind(s, True) for s in rw_bind)
    env_set: dict[str, str] = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise click.BadParameter(f"{item!r}: expected KEY=VAL", param_hint="--env")
        env_set[key] = value
    policy = policy.replace(
        mounts=policy.mounts + extra,
        env_passthrough=policy.env_passthrough + pass_env,
    )
    if seccomp_log:
        policy = policy.replace(seccomp=dataclasses.replace(policy.seccomp, log_denied=True))
    # --- network (docs/network.md) ---
    try:
        policy = policy.replace(network=from_options(policy.network, net_mode, allow_host))
    except NsboxError as error:
        _fail(error)
    # --- end network ---
    try:
        result = nsbox.run(
            list(command), policy, stdin=None if as_json else 0, timeout=wall_time,
            output_limit=output_limit, env=env_set, workspace=workspace, cwd=cwd,
            passthrough=not as_json,
        )
    except NsboxError as error:
        if as_json:
            click.echo(json.dumps({"status": Status.XX.value, "error": str(error)}))
        _fail(error)
        return
    if as_json:
        click.echo(json.dumps(result.to_dict(with_output=True)))
    elif "seccomp_denied" in result.extra:
        denied = ", ".join(result.extra["seccomp_denied"]) or "nothing"
        click.echo(f"nsbox: seccomp denied: {denied}", err=True)
    elif result.status in (Status.TO, Status.OL, Status.ML):
        reason = {"memory": "memory limit reached (OOM kill)",
                  "cpu_time": "CPU-time limit reached"}.get(result.extra.get("limit", ""))
        click.echo(f"nsbox: {result.status.value}: "
                   + (reason or ("wall-clock limit reached" if result.status is Status.TO
                                 else "output limit reached")), err=True)
    sys.exit(_exit_code(result))


if __name__ == "__main__":
    main()
