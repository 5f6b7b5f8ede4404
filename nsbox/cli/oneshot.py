"""``nsbox run`` commands that need a session of their own: ``--project`` and ``--ask`` (what
the command changed in the project is listed, the question goes to the terminal) and
``--collect`` (files copied out of the sandbox before it goes).

Below both nsbox/cli/run.py, which calls it, and nsbox/cli/session.py: neither imports the other.
"""

from __future__ import annotations

import os
import termios
import time

import click

from nsbox import errors, visible
from nsbox._sys.wire import FileEntry, write_all
from nsbox.cli.lines import settle_terminal
from nsbox.host import output
from nsbox.policy.policy import Policy
from nsbox.result import Result
from nsbox.session.session import Session

# Drawn before the question. The sandbox's output went raw to this same terminal and may have
# left it in a state that hides or fakes what comes next; this puts back what matters, with
# sequences a terminal that does not know them ignores.
_TERMINAL_RESET = (
    # CAN ends any escape, control or string sequence left open (an OSC title or a DCS would
    # swallow the question whole); ST for a terminal that waits for one.
    b"\x18\x1b\\"
    # DECSTR, the soft reset (scroll region, origin mode, character sets, insert mode, SGR),
    # then the same by hand for terminals without it: SGR 0 (no concealed, blinking or
    # same-coloured letters), SI and G0 = ASCII (no line-drawing letters), no insert mode, no
    # origin mode, no scroll region, autowrap on (a long line is not cut), cursor shown, no
    # synchronized update (which would keep the screen from being drawn).
    b"\x1b[!p\x1b[0m\x0f\x1b(B\x1b[4l\x1b[?6l\x1b[r\x1b[?7h\x1b[?25h\x1b[?2026l"
    # OSC 104, 110, 111: the palette and the default colours back (text the colour of the
    # background is as hidden as concealed text).
    b"\x1b]104\x1b\\\x1b]110\x1b\\\x1b]111\x1b\\"
    # No mouse, focus or bracketed-paste reports: they would be read with the answer (and
    # make a "y" typed a no).
    b"\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1004l\x1b[?1006l\x1b[?2004l"
    # The foot of the screen, then a line feed (which scrolls there, the scroll region gone):
    # the question starts on a new, empty line of normal width.
    b"\x1b[999;1H\n"
)

# The question is drawn, then after this long the input typed so far is discarded and the
# prompt "[y/N]" drawn: keys typed before the question could be read (for a prompt of the
# sandbox's own, say, or still on their way over ssh) never answer it.
_SETTLE = 0.5


def terminal_ask(host: str, port: int) -> bool:
    """``nsbox run --ask``: the question on the controlling terminal (never on the sandbox's
    stdin or stdout); without a terminal the answer is no.

    What the person answers is nsbox's question alone: the sandbox's output is held from
    before the question until after the answer (nsbox/host/output.py, TerminalHold), the
    terminal is reset first (``_TERMINAL_RESET``), and only what is typed once the question
    is there counts (docs/agents.md, "Ask before the network")."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    # From here to the answer nothing of the sandbox's reaches the terminal (what it writes
    # meanwhile is sent on after): the question is the last thing drawn, and the echo of
    # what is typed all that follows it.
    output.TERMINAL_HOLD.hold()
    try:
        with os.fdopen(fd, "r+b", buffering=0) as tty:
            # ``host`` is the proxy's checked, canonical form (printable ASCII); escaped all
            # the same, as everything shown of the sandbox's making is.
            write_all(fd, _TERMINAL_RESET + (
                f"nsbox: the sandbox asks to reach {visible.name(host)}:{int(port)}, which is "
                "not on the allow-list. Allow it for this run? ").encode())
            time.sleep(_SETTLE)
            termios.tcflush(fd, termios.TCIFLUSH)  # what was typed before, unread: gone
            write_all(fd, b"[y/N] ")
            answer = tty.readline(64)
            if not answer.endswith(b"\n"):  # end of file: the sandbox's output on a line below
                write_all(fd, b"\r\n")
    except (OSError, termios.error):
        return False  # no flush, no answer: no
    finally:
        output.TERMINAL_HOLD.release()
    return answer.strip().lower() in (b"y", b"yes")


def run_in_project(command: list[str], policy: Policy, *, stdin: int | None, cwd: str | None,
                   passthrough: bool, audit: str | None, ask: bool = False) -> Result:
    """``nsbox run --project`` or ``--ask``: one command in a session of its own. What it
    changed in the project is listed on stderr and dropped with the sandbox (review and apply
    need a session: ``nsbox session start --project``)."""
    try:
        with Session(policy, audit=audit, idle_timeout=None,
                     ask=terminal_ask if ask else None) as s:
            result = s.run(command, stdin=stdin, cwd=cwd, passthrough=passthrough)
            found = s.changes(diff=False) if policy.project is not None else []
            notes = s.project_notes
    finally:
        # A question still waiting when the sandbox is gone decides nothing now: what its
        # output left is shown rather than lost.
        output.TERMINAL_HOLD.release()
    settle_terminal()
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
