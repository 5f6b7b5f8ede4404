"""What the sandbox's output asks the caller's terminal, answered after the run.

Without --tty the sandbox's output still reaches the caller's terminal raw (docs/cli.md). A
query in it (ESC [ 21 t reports a title the sandbox set to a command line; DECRQSS, ENQ and
the like answer too) makes the terminal type its answer into its own input, and an answer
that arrives once the run is over waits there for the caller's shell to read as a typed line.
Each test runs the CLI on a pty of its own, its controlling terminal in the foreground, with a
thread that answers queries as a terminal does, in order and after a delay (ssh); what the
shell would read next is read from the pty's input queue after nsbox has exited.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time

import pytest
from conftest import REPO
from ptytools import DA1_ANSWER, DA1_QUERY, AnsweringPty

from nsbox.host import terminal as host_terminal

# The sandbox's query and the terminal's answer to it: the title it set, as a command line.
TITLE_QUERY = b"\x1b[21t"
TITLE_ANSWER = b"\x1b]lid>/tmp/p\x1b\\\n"
ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp", "TERM": "xterm"}


def _terminal(delay: float = 0.0) -> AnsweringPty:
    """The caller's terminal: it answers the title report and DA1, ``delay`` s late."""
    return AnsweringPty({TITLE_QUERY: TITLE_ANSWER, DA1_QUERY: DA1_ANSWER}, delay)


def _nsbox(*args: str) -> list[str]:
    return [sys.executable, "-m", "nsbox", *args]


def _session_start() -> str:
    started = subprocess.run(_nsbox("session", "start"), capture_output=True, env=ENV, cwd="/",
                             timeout=120)
    assert started.returncode == 0, started.stderr
    return started.stdout.decode().split()[-1]


@pytest.mark.parametrize("delay", [0.0, 0.4])
@pytest.mark.parametrize("door", ["run", "run --tty", "session exec"])
def test_an_answer_to_the_sandboxs_query_is_not_left_for_the_shell(door: str,
                                                                    delay: float) -> None:
    """The answer comes after the run has ended (``delay``, as over ssh): nsbox asks DA1 last,
    reads what the terminal answers up to its DA1 answer, and discards it."""
    script = ["--", "sh", "-c", r"printf 'done\033]2;id>/tmp/p\a\033[21t'"]
    session_id = ""
    if door == "session exec":
        session_id = _session_start()
        argv = _nsbox("session", "exec", session_id, *script[1:])
    else:
        argv = _nsbox(*door.split(), *script)
    with _terminal(delay) as term:
        try:
            assert term.run(argv, ENV) == 0, term.seen[-500:]
        finally:
            if session_id:
                subprocess.run(_nsbox("session", "stop", session_id), capture_output=True,
                               env=ENV, cwd="/", timeout=60)
        assert TITLE_QUERY in term.seen
        assert term.left_for_the_shell() == b""
        # Asked after the sandbox's own query, so that its answer is known to have come.
        assert term.seen.rindex(DA1_QUERY) > term.seen.rindex(TITLE_QUERY)


def test_an_open_string_does_not_swallow_what_nsbox_writes_next() -> None:
    """An OSC left open would take nsbox's own line for title text (and the DA1 query with
    it): CAN and ST end it, the modes are put back, and only then nsbox writes its line."""
    with _terminal() as term:
        code = term.run(_nsbox("run", "--time", "1", "--", "sh", "-c",
                               r"printf '\033[8m\033]2;hidden'; sleep 30"), ENV)
        shown = bytes(term.seen)
    assert code == 124, shown[-500:]
    line = shown.index(b"nsbox: TO")
    close = shown.index(b"\x18\x1b\\", shown.index(b"\x1b]2;hidden"))
    assert close < shown.index(host_terminal.TERMINAL_DEFAULTS, close) < line
    assert shown.index(DA1_QUERY, close) < line


def test_output_without_a_control_leaves_the_terminal_alone() -> None:
    """Plain text asks nothing: no reset, no DA1, nothing discarded."""
    with _terminal() as term:
        assert term.run(_nsbox("run", "--", "echo", "plain"), ENV) == 0
        assert term.seen == b"plain\r\n"


def test_a_run_in_the_background_does_not_read_the_terminal() -> None:
    """In the background (a shell with job control, ``&``) the shell has the terminal: nsbox
    puts the modes back but neither reads the terminal (SIGTTIN would stop it) nor changes
    its modes (SIGTTOU); it ends at once."""
    job = shlex.join(_nsbox("run", "--", "printf", r"\033[21t"))
    started = time.monotonic()
    with _terminal() as term:
        code = term.run(["sh", "-c", f"set -m; {job} & wait $!; echo status=$?"], ENV, 60)
        shown = bytes(term.seen)
    assert code == 0 and b"status=0" in shown, shown[-500:]
    assert time.monotonic() - started < 30
    assert host_terminal.TERMINAL_DEFAULTS in shown
    assert DA1_QUERY not in shown
