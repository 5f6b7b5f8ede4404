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

import fcntl
import os
import pty
import select
import shlex
import subprocess
import sys
import termios
import threading
import time
import tty
from collections.abc import Iterator

import pytest
from conftest import REPO

from nsbox.host import terminal as host_terminal

# The sandbox's query and the terminal's answer to it: the title it set, as a command line.
TITLE_QUERY = b"\x1b[21t"
TITLE_ANSWER = b"\x1b]lid>/tmp/p\x1b\\\n"
DA1_QUERY = b"\x1b[c"
DA1_ANSWER = b"\x1b[?62;22c"
ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp", "TERM": "xterm"}


class AnsweringTerminal:
    """A pty whose master side answers the title report and DA1, each ``delay`` seconds after
    it was shown and in the order asked, and keeps every byte shown."""

    def __init__(self, delay: float) -> None:
        self.master, self.slave = pty.openpty()
        self.delay = delay
        self.shown = b""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        answered = {TITLE_QUERY: 0, DA1_QUERY: 0}
        while not self._stop.is_set():
            if not select.select([self.master], [], [], 0.05)[0]:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            with self._lock:
                self.shown += chunk
                shown = self.shown
            # In the order asked: nsbox's DA1 comes after the sandbox's query.
            for query, answer in ((TITLE_QUERY, TITLE_ANSWER), (DA1_QUERY, DA1_ANSWER)):
                while shown.count(query) > answered[query]:
                    answered[query] += 1
                    time.sleep(self.delay)
                    os.write(self.master, answer)

    def run(self, argv: list[str], timeout: float = 120) -> int:
        proc = subprocess.Popen(
            argv, stdin=self.slave, stdout=self.slave, stderr=self.slave, env=ENV, cwd="/",
            start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        try:
            return proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def left_for_the_shell(self) -> bytes:
        """What the caller's shell would read next (the answers a delay lets arrive first)."""
        time.sleep(self.delay + 0.3)
        tty.setraw(self.slave, termios.TCSANOW)  # TCSAFLUSH, its default, would flush
        os.set_blocking(self.slave, False)
        try:
            return os.read(self.slave, 1024)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminals() -> Iterator[list[AnsweringTerminal]]:
    made: list[AnsweringTerminal] = []
    yield made
    for each in made:
        each.close()


def _nsbox(*args: str) -> list[str]:
    return [sys.executable, "-m", "nsbox", *args]


def _session_start() -> str:
    started = subprocess.run(_nsbox("session", "start"), capture_output=True, env=ENV, cwd="/",
                             timeout=120)
    assert started.returncode == 0, started.stderr
    return started.stdout.decode().split()[-1]


@pytest.mark.parametrize("delay", [0.0, 0.4])
@pytest.mark.parametrize("door", ["run", "run --tty", "session exec"])
def test_an_answer_to_the_sandboxs_query_is_not_left_for_the_shell(
        terminals: list[AnsweringTerminal], door: str, delay: float) -> None:
    """The answer comes after the run has ended (``delay``, as over ssh): nsbox asks DA1 last,
    reads what the terminal answers up to its DA1 answer, and discards it."""
    term = AnsweringTerminal(delay)
    terminals.append(term)
    script = ["--", "sh", "-c", r"printf 'done\033]2;id>/tmp/p\a\033[21t'"]
    session_id = ""
    if door == "session exec":
        session_id = _session_start()
        argv = _nsbox("session", "exec", session_id, *script[1:])
    else:
        argv = _nsbox(*door.split(), *script)
    try:
        assert term.run(argv) == 0, term.shown[-500:]
    finally:
        if session_id:
            subprocess.run(_nsbox("session", "stop", session_id), capture_output=True, env=ENV,
                           cwd="/", timeout=60)
    assert TITLE_QUERY in term.shown
    assert term.left_for_the_shell() == b""
    # Asked after the sandbox's own query, so that its answer is known to have come.
    assert term.shown.rindex(DA1_QUERY) > term.shown.rindex(TITLE_QUERY)


def test_an_open_string_does_not_swallow_what_nsbox_writes_next(
        terminals: list[AnsweringTerminal]) -> None:
    """An OSC left open would take nsbox's own line for title text (and the DA1 query with
    it): CAN and ST end it, the modes are put back, and only then nsbox writes its line."""
    term = AnsweringTerminal(0.0)
    terminals.append(term)
    code = term.run(_nsbox("run", "--time", "1", "--", "sh", "-c",
                           r"printf '\033[8m\033]2;hidden'; sleep 30"))
    assert code == 124, term.shown[-500:]
    shown = term.shown
    line = shown.index(b"nsbox: TO")
    close = shown.index(b"\x18\x1b\\", shown.index(b"\x1b]2;hidden"))
    assert close < shown.index(host_terminal.TERMINAL_DEFAULTS, close) < line
    assert shown.index(DA1_QUERY, close) < line


def test_output_without_a_control_leaves_the_terminal_alone(
        terminals: list[AnsweringTerminal]) -> None:
    """Plain text asks nothing: no reset, no DA1, nothing discarded."""
    term = AnsweringTerminal(0.0)
    terminals.append(term)
    assert term.run(_nsbox("run", "--", "echo", "plain")) == 0
    assert term.shown == b"plain\r\n"


def test_a_run_in_the_background_does_not_read_the_terminal(
        terminals: list[AnsweringTerminal]) -> None:
    """In the background (a shell with job control, ``&``) the shell has the terminal: nsbox
    puts the modes back but neither reads the terminal (SIGTTIN would stop it) nor changes
    its modes (SIGTTOU); it ends at once."""
    term = AnsweringTerminal(0.0)
    terminals.append(term)
    job = shlex.join(_nsbox("run", "--", "printf", r"\033[21t"))
    started = time.monotonic()
    assert term.run(["sh", "-c", f"set -m; {job} & wait $!; echo status=$?"], timeout=60) == 0
    assert b"status=0" in term.shown, term.shown[-500:]
    assert time.monotonic() - started < 30
    assert host_terminal.TERMINAL_DEFAULTS in term.shown
    assert DA1_QUERY not in term.shown
