"""``nsbox session diff|apply|discard``: the user's review of a project session's changes.

A session started with ``--project DIR`` sees DIR copy-on-write at /workspace; what its
commands change reaches DIR only through ``apply`` (docs/sessions.md). The commands ask the
session's supervisor (nsbox/supervisor.py); ``nsbox session`` registers them
(nsbox/cli/session.py).
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from nsbox._wire import SupervisorReply
from nsbox.cli.run import fail_code
from nsbox.errors import NsboxError
from nsbox.supervisor import request


def _fail(error: NsboxError) -> NoReturn:
    """Print the error (and its hint) and exit with its code, as every command does."""
    sys.exit(fail_code(error))


def _print_change(item: dict[str, Any], with_diff: bool) -> None:
    kind = item["kind"]
    note = " (conflict: changed on the host since the session started)" if item.get(
        "conflict") else ""
    if item.get("reason"):
        note += f" (not applied: {item['reason']})"
    if kind == "mode":
        note += f" {item.get('old_mode')} -> {item.get('mode')}"
    elif kind == "symlink":
        note += f" -> {json.dumps(item.get('target'))}"
    elif item.get("binary"):
        note += f" binary, {item.get('size')} bytes, sha256 {item.get('sha256')}"
    slash = "/" if item.get("is_dir") else ""
    click.echo(f"{kind:>9}  {json.dumps(item['path'])[1:-1]}{slash}{note}")
    if with_diff and item.get("diff"):
        click.echo(item["diff"], nl=not item["diff"].endswith("\n"))


@click.command()
@click.argument("session_id", metavar="ID")
@click.argument("paths", metavar="[PATH]...", nargs=-1)
@click.option("--stat", "summary", is_flag=True, help="One line per change, no diffs.")
@click.option("--json", "as_json", is_flag=True, help="Print the changes as JSON.")
def diff(session_id: str, paths: tuple[str, ...], summary: bool, as_json: bool) -> None:
    """List what session ID changed in its project (--project), with diffs of text files.

    \b
    Example:
      nsbox session diff $ID
    """
    try:
        reply = request(session_id, {"op": "changes", "paths": list(paths) or None})
    except NsboxError as error:
        _fail(error)
        return
    if as_json:
        click.echo(json.dumps(reply))
        return
    for item in reply["changes"]:
        _print_change(item, not summary)


def _decide(op: str, session_id: str, paths: tuple[str, ...]) -> SupervisorReply:
    try:
        return request(session_id, {"op": op, "paths": list(paths) or None})
    except NsboxError as error:
        _fail(error)


@click.command()
@click.argument("session_id", metavar="ID")
@click.argument("paths", metavar="[PATH]...", nargs=-1)
def apply(session_id: str, paths: tuple[str, ...]) -> None:
    """Write session ID's changes to its project (all, or those at or below PATH).

    A file changed on the host since the session started is a conflict and is not written;
    symlinks, hard links, FIFOs and files over the copy limit are never written.

    \b
    Example:
      nsbox session apply $ID src/app.py
    """
    reply = _decide("apply", session_id, paths)
    for path in reply["applied"]:
        click.echo(f"  applied  {path}")
    for path in reply["conflicts"]:
        click.echo(f"nsbox: conflict: {path} changed on the host since the session started: "
                   "not written", err=True)
    for item in reply["refused"]:
        click.echo(f"nsbox: not applied: {item['path']}: {item['reason']}", err=True)
    if reply["conflicts"] or reply["refused"]:
        sys.exit(1)


@click.command()
@click.argument("session_id", metavar="ID")
@click.argument("paths", metavar="[PATH]...", nargs=-1)
def discard(session_id: str, paths: tuple[str, ...]) -> None:
    """Drop session ID's changes (all, or those at or below PATH) from review; nothing of them
    reaches the project.

    \b
    Example:
      nsbox session discard $ID build/
    """
    reply = _decide("discard", session_id, paths)
    for path in reply["discarded"]:
        click.echo(f"discarded  {path}")
