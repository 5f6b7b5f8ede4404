"""``nsbox run`` commands that need a session of their own: ``--project`` and ``--ask`` (what
the command changed in the project is listed, the question goes to the terminal) and
``--collect`` (files copied out of the sandbox before it goes).

Below both nsbox/cli/run.py, which calls it, and nsbox/cli/session.py: neither imports the other.
"""

from __future__ import annotations

import os

import click

from nsbox import errors, visible
from nsbox._sys.wire import FileEntry
from nsbox.policy.policy import Policy
from nsbox.result import Result
from nsbox.session.session import Session


def terminal_ask(host: str, port: int) -> bool:
    """``nsbox run --ask``: the question on the controlling terminal (never on the sandbox's
    stdin or stdout); without a terminal the answer is no."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "r+b", buffering=0) as tty:
        # ``host`` is the proxy's checked, canonical form (printable ASCII); escaped all the
        # same, as everything shown of the sandbox's making is.
        tty.write(f"\nnsbox: the sandbox asks to reach {visible.name(host)}:{int(port)}, which "
                  "is not on the allow-list. Allow it for this run? [y/N] ".encode())
        answer = tty.readline(64)
    return answer.strip().lower() in (b"y", b"yes")


def run_in_project(command: list[str], policy: Policy, *, stdin: int | None, cwd: str | None,
                   passthrough: bool, audit: str | None, ask: bool = False) -> Result:
    """``nsbox run --project`` or ``--ask``: one command in a session of its own. What it
    changed in the project is listed on stderr and dropped with the sandbox (review and apply
    need a session: ``nsbox session start --project``)."""
    with Session(policy, audit=audit, idle_timeout=None,
                 ask=terminal_ask if ask else None) as s:
        result = s.run(command, stdin=stdin, cwd=cwd, passthrough=passthrough)
        found = s.changes(diff=False) if policy.project is not None else []
        notes = s.project_notes
    for note in notes:
        click.echo(f"nsbox: project: {visible.name(note)}", err=True)
    if found:
        click.echo(f"nsbox: {len(found)} change(s) to the project, not applied "
                   "(use `nsbox session start --project` to review and apply):", err=True)
        for change in found:
            mark = " (runs on the host)" if change.runs_on_host else ""
            click.echo(f"nsbox:   {change.kind} {visible.name(change.path)}{mark}", err=True)
    return result


# --- nsbox run --collect ---------------------------------------------------------------------


def run_and_collect(command: list[str], policy: Policy, *, patterns: tuple[str, ...],
                    dest: str, stdin: int | None, cwd: str | None, passthrough: bool,
                    audit: str | None
                    ) -> tuple[Result, list[FileEntry], list[tuple[str, str]]]:
    """Run one command in a session of its own and copy out what matches ``patterns``."""
    _check_destination(dest)
    with Session(policy, audit=audit, idle_timeout=None) as s:
        result = s.run(command, stdin=stdin, cwd=cwd, passthrough=passthrough)
        skipped: list[tuple[str, str]] = []
        copied = s.copy_out(dest, patterns, skipped=skipped)
    return result, [f.to_dict() for f in copied], skipped


def _check_destination(dest: str) -> None:
    """Before the run: the directory for --collect can be made and its filesystem has room (a
    full disk would otherwise fail only after the command ran)."""
    try:
        os.makedirs(dest, exist_ok=True)
        fs = os.statvfs(dest)
    except OSError as exc:
        raise errors.FileTransferError(
            dest, f"cannot use it for --collect: {exc.strerror}") from None
    free = fs.f_bfree if os.geteuid() == 0 else fs.f_bavail  # root may use the reserved blocks
    if free == 0 or not os.access(dest, os.W_OK):
        raise errors.FileTransferError(dest, "cannot use it for --collect: "
                                + ("no space left on its filesystem" if free == 0
                                   else "not writable"))
