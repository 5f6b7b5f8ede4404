"""``nsbox session diff|apply|discard``: the user's review of a project session's changes.

A session started with ``--project DIR`` sees DIR copy-on-write at /workspace; what its
commands change reaches DIR only through ``apply`` (docs/sessions.md). The commands ask the
session's supervisor (nsbox/session/supervisor.py); ``nsbox session`` registers them
(nsbox/cli/session.py).
"""

from __future__ import annotations

import shlex
import sys
from typing import Any, NoReturn

import click

from nsbox import visible
from nsbox._sys.wire import SupervisorReply
from nsbox.cli.lines import fail_code
from nsbox.errors import NsboxError
from nsbox.host import autorun
from nsbox.session.supervisor import request


def _fail(error: NsboxError) -> NoReturn:
    """Print the error (and its hint) and exit with its code, as every command does."""
    sys.exit(fail_code(error))


def _marked(item: dict[str, Any]) -> bool:
    """Listed first and marked "!": a file the host runs by itself, or one never applied
    because it is under a .git (nsbox/host/autorun.py)."""
    return bool(item.get("runs_on_host")) or "(rule git-dir)" in str(item.get("reason"))


def _notes(item: dict[str, Any]) -> str:
    """What the line says after the path; every sandbox-made value escaped."""
    kind, note = item["kind"], ""
    asked = f" (asked {item['asked_mode']})" if item.get("asked_mode") else ""
    if kind == "added" and item.get("mode"):
        note += f" mode {item['mode']}{asked}"
    elif kind in ("mode", "modified") and item.get("mode") and item.get("mode") != item.get(
            "old_mode"):
        note += f" mode {item.get('old_mode')} -> {item['mode']}{asked}"
    if item.get("conflict"):
        note += " (conflict: changed on the host since the session started)"
    if item.get("reason"):
        note += f" (not applied: {visible.name(item['reason'])})"
    if kind == "symlink":
        note += f" -> {visible.quoted(item.get('target'))}"
    elif item.get("binary"):
        note += f" binary, {item.get('size')} bytes, sha256 {item.get('sha256')}"
    elif item.get("no_diff"):
        note += (f" ({visible.name(item['no_diff'])}), {item.get('size')} bytes, "
                 f"sha256 {item.get('sha256')}")
    if item.get("runs_on_host"):
        note += f" [runs on the host: {visible.name(item['runs_on_host'])}]"
    return note


def _print_change(item: dict[str, Any], with_diff: bool) -> None:
    mark = "!" if _marked(item) else " "
    slash = "/" if item.get("is_dir") else ""
    click.echo(f"{mark}{item['kind']:>8}  {visible.name(item['path'])}{slash}{_notes(item)}")
    if with_diff and item.get("diff"):
        shown = visible.text(item["diff"])
        click.echo(shown, nl=not shown.endswith("\n"))


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
        # --stat asks for no diffs: the supervisor then reads no file of the sandbox.
        reply = request(session_id, {"op": "changes", "paths": list(paths) or None,
                                     "diff": not summary})
    except NsboxError as error:
        _fail(error)
        return
    if as_json:
        click.echo(visible.json_text(reply))
        return
    for item in reply["changes"]:
        _print_change(item, not summary)
    marked = sum(1 for item in reply["changes"] if _marked(item))
    if marked:
        click.echo(f"nsbox: {marked} change(s) marked '!' (listed first): files under .git, "
                   "never applied, or files the host runs by itself", err=True)
    if reply["changes"]:
        # A command run after this review could change what apply would write: with the
        # token, apply writes only these changes, or nothing.
        chosen = "".join(f" {shlex.quote(p)}" for p in paths)
        click.echo(f"nsbox: to apply exactly these: nsbox session apply {session_id} "
                   f"--reviewed {reply['review']}{visible.name(chosen)}", err=True)


def _decide(op: str, session_id: str, paths: tuple[str, ...],
            reviewed: str | None = None) -> SupervisorReply:
    try:
        return request(session_id, {"op": op, "paths": list(paths) or None,
                                    **({"reviewed": reviewed} if reviewed else {})})
    except NsboxError as error:
        _fail(error)


@click.command()
@click.argument("session_id", metavar="ID")
@click.argument("paths", metavar="[PATH]...", nargs=-1)
@click.option("--reviewed", metavar="TOKEN",
              help="Write only if the changes are still those `nsbox session diff` showed "
                   "with this token (for the same PATHs); otherwise nothing.")
def apply(session_id: str, paths: tuple[str, ...], reviewed: str | None) -> None:
    """Write session ID's changes to its project (all, or those at or below PATH).

    A file changed on the host since the session started is a conflict and is not written;
    symlinks, hard links, FIFOs and files over the copy limit are never written. Without
    --reviewed, what the sandbox holds now is written, which a command run since the review
    may have changed.

    \b
    Example:
      nsbox session apply $ID --reviewed TOKEN src/app.py
    """
    reply = _decide("apply", session_id, paths, reviewed)
    for path in reply["applied"]:
        click.echo(f"  applied  {visible.name(path)}")
    for path in reply["conflicts"]:
        click.echo(f"nsbox: conflict: {visible.name(path)} changed on the host since the session "
                   "started: not written", err=True)
    for item in reply["refused"]:
        click.echo(f"nsbox: not applied: {visible.name(item['path'])}: "
                   f"{visible.name(item['reason'])}", err=True)
    # A bytecode cache left out is as it should be (Python makes it again from the source,
    # which is in the review): no failure, unlike the other refusals.
    if reply["conflicts"] or any(item["reason"] != autorun.PYC_REASON
                                 for item in reply["refused"]):
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
        click.echo(f"discarded  {visible.name(path)}")
