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

import json
import sys
from typing import Any

import click

from nsbox.cli import options as _options
from nsbox.cli import run as _cli_run
from nsbox.cli import shared
from nsbox.errors import NsboxError


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from nsbox.version import describe

        click.echo(describe())
        ctx.exit()




@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="Show the version and the commit, then exit.")
def main() -> None:
    """nsbox: run untrusted code in a Linux sandbox built from kernel namespaces."""


# As env, sudo, timeout and docker run: options stop at the command, whose own options
# (``ls -w``, ``python3 -c``) are never taken for nsbox's.
@main.command(context_settings={"ignore_unknown_options": False,
                                "allow_interspersed_args": False})
@_options.click_options(_options.RUN)
@click.argument("command", nargs=-1)
def run(command: tuple[str, ...], **values: Any) -> None:
    """Run COMMAND in a new sandbox.

    Options go before COMMAND: its first argument that is not an option starts it, and every
    argument after that is the command's own (a "--" before COMMAND is accepted too). Every
    option is an override of a profile key: `nsbox profiles show NAME` prints a profile's keys,
    --print-profile the policy these options make.

    \b
    Example:
      nsbox run --time 10 -- python3 -c 'print("hello from the sandbox")'
    """
    # The work is done without click (nsbox/cli/run.py), so that the fast path of
    # nsbox/cli/fast.py, which parses the same options by hand, does exactly the same.
    options = {**values, "command": command}
    try:
        _cli_run.check(options)
        code = _cli_run.execute(options)
    except _cli_run.OptionError as exc:
        if exc.param_hint is None:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=exc.param_hint) from None
    sys.exit(code)


# --- profiles and doctor (nsbox/profiles.py, nsbox/doctor.py); imported only when used ---------


@main.group(invoke_without_command=True)
@click.pass_context
def profiles(ctx: click.Context) -> None:
    """List the shipped profiles (`nsbox profiles show NAME` prints one).

    \b
    Example:
      nsbox profiles
    """
    if ctx.invoked_subcommand is None:
        from nsbox.profiles import profile_description, shipped_profiles

        names = shipped_profiles()
        width = max(len(name) for name in names)
        for name in names:
            click.echo(f"{name:<{width}}  {profile_description(name)}")


@profiles.command("show")
@click.argument("name", metavar="NAME|FILE")
def profiles_show(name: str) -> None:
    """Print a profile with its parents merged in, as TOML.

    \b
    Example:
      nsbox profiles show python
    """
    from nsbox.profiles import load_profile, to_toml

    try:
        click.echo(to_toml(load_profile(name)), nl=False)
    except NsboxError as error:
        shared.fail(error)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("-p", "--profile", default="default", show_default=True, metavar="NAME|FILE",
              help="Judge the host for this profile.")
@click.option("--apparmor-profile", is_flag=True,
              help="Print the AppArmor profile that gives nsbox's launcher user namespaces "
              "where AppArmor restricts them (Ubuntu 23.10 and later), and exit.")
def doctor(as_json: bool, profile: str, apparmor_profile: bool) -> None:
    """Check what this host offers and what is missing; exit 1 when the profile cannot run
    safely here.

    \b
    Example:
      nsbox doctor --json
    """
    from nsbox.doctor import run_doctor
    from nsbox.profiles import load_profile

    if apparmor_profile:
        from nsbox.doctor.isolation import apparmor_profile as text

        click.echo(text(), nl=False)
        return

    try:
        report = run_doctor(policy=load_profile(profile))
    except NsboxError as error:  # a profile that does not load: no report (docs/doctor.md)
        if as_json:
            click.echo(json.dumps({"profile": profile, "ok": False, "error": str(error)}))
        shared.fail(error)
        return
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.format_table())
    sys.exit(0 if report.ok else 1)


# --- end profiles and doctor --------------------------------------------------------------------


# --- sessions (nsbox/cli/session.py) ---
from nsbox.cli.session import session  # noqa: E402

main.add_command(session)
# --- end sessions ---


# --- bench (nsbox/bench, docs/performance.md) ---
@main.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Measure launches against bubblewrap and the other peers (--help for its options)."""
    from nsbox.bench.__main__ import main as bench_main

    sys.exit(bench_main(list(args)))
# --- end bench ---


# --- nsbox mcp: a code-execution tool for coding agents (nsbox/mcp/server.py) ----------------


@main.command("mcp")
@_options.click_options(_options.MCP)
@click.option("--review", "review_id", metavar="ID",
              help="Serve the user's tools changes/apply/discard for session ID instead "
              "(never give these to the agent).")
def mcp_command(review_id: str | None, **values: Any) -> None:
    """Serve an MCP code-execution tool on stdin/stdout.

    One sandboxed session per connection: its tools run Python and bash, and write, read and
    list files in /workspace. The session is destroyed when the client disconnects. The
    options are those of `nsbox run`, for the session. Needs the extra:
    pip install 'nsbox[mcp]'.

    \b
    Example:
      nsbox mcp --profile python --memory 1G --time 60 --input data.csv
    """
    from nsbox.mcp import server as mcp_server

    # The options are nsbox run's (nsbox/cli/options.py), and so is the policy they make.
    options = {**_options.defaults(_options.RUN), **values}
    policy = None
    try:
        if review_id is not None:
            from nsbox.mcp.review import serve_review

            serve_review(review_id)
            return
        _cli_run.check(options)
        policy = _cli_run.policy_from_options(options)
        mcp_server.serve(mcp_server.ServerConfig(
            policy=policy, inputs=values["inputs"], audit=values["audit"],
            project=policy.project))
    except _cli_run.OptionError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.param_hint) from None
    except NsboxError as error:
        shared.fail(error, options, policy, extra_inputs=True)  # the session adds the inputs


if __name__ == "__main__":
    main()
