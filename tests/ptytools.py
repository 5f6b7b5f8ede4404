"""Run nsbox's CLI on a new pseudo-terminal and keep every byte it showed there.

The terminal is the command's controlling terminal and its stdin, stdout and stderr, as a
person's is. Bytes are as the terminal got them: the line discipline turns "\\n" into "\\r\\n"
(ONLCR), so ``lines`` undoes only that and leaves any other CR to be seen.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import subprocess
import termios
import threading
import time
import tty
from types import TracebackType

from conftest import PYTHON
from sessiontools import wait_until

# Bytes a terminal obeys rather than shows, none of which nsbox may write of the sandbox's
# making: ESC, CR (alone), BEL, backspace, the C1 CSI (U+009B in UTF-8), DEL, and the bidi
# overrides and isolates (U+202E, U+2066 in UTF-8).
OBEYED = (b"\x1b", b"\x07", b"\x08", b"\xc2\x9b", b"\x7f", b"\xe2\x80\xae", b"\xe2\x81\xa6")


def run_on_terminal(argv: list[str], env: dict[str, str], answers: list[bytes] | None = None,
                    timeout: float = 90) -> tuple[int, bytes]:
    """Run ``argv`` with a new pseudo-terminal as its controlling terminal, answering each
    nsbox question ("[y/N]") with the next of ``answers``; its exit status and all it wrote."""
    answers = list(answers or [])
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd="/",
                            start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    shown = b""
    asked = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            shown += chunk
            while answers and shown.count(b"[y/N]") > asked:
                os.write(master, answers.pop(0) + b"\n")
                asked += 1
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), shown


def nsbox_argv(prefix: list[str], *args: str) -> list[str]:
    return [*prefix, PYTHON, "-m", "nsbox", *args]


def lines(shown: bytes) -> list[str]:
    """The lines the terminal got (ONLCR undone); the echo of answers typed is in them."""
    return shown.replace(b"\r\n", b"\n").decode("utf-8", "surrogateescape").split("\n")


def obeyed(shown: bytes) -> list[bytes]:
    """The bytes of OBEYED found in ``shown``, a lone CR among them."""
    text = shown.replace(b"\r\n", b"\n")
    return [b for b in (*OBEYED, b"\r") if b in text]


# What nsbox asks a terminal once a run's output held a control (nsbox/host/terminal.py,
# discard_answers), and a VT220's answer.
DA1_QUERY = b"\x1b[c"
DA1_ANSWER = b"\x1b[?62;22c"


class AnsweringPty:
    """A pty of the test's own whose master is read all along, as a terminal emulator does:
    every byte shown is kept in ``seen``, and each query of ``answers`` shown is answered with
    its answer ``delay`` seconds later (as over ssh), in the order of ``answers``. The slave
    stays open, so that what the caller's shell would read next is left to look at."""

    def __init__(self, answers: dict[bytes, bytes], delay: float = 0.0) -> None:
        self.master, self.slave = pty.openpty()
        self.before = termios.tcgetattr(self.slave)
        self.answers, self.delay = answers, delay
        self.seen = bytearray()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._serve, daemon=True)
        self._reader.start()

    def _serve(self) -> None:
        answered = dict.fromkeys(self.answers, 0)
        while not self._stop.is_set():
            if not select.select([self.master], [], [], 0.05)[0]:
                continue
            try:
                self.seen += os.read(self.master, 65536)
            except OSError:
                return
            for query, answer in self.answers.items():
                while self.seen.count(query) > answered[query]:
                    answered[query] += 1
                    time.sleep(self.delay)
                    os.write(self.master, answer)

    def run(self, argv: list[str], env: dict[str, str], timeout: float = 120) -> int:
        """Run ``argv`` with the pty as its controlling terminal and streams; its exit status."""
        proc = subprocess.Popen(
            argv, stdin=self.slave, stdout=self.slave, stderr=self.slave, env=env, cwd="/",
            start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        try:
            code = proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # Every byte it wrote taken in by the reader: the master has nothing left to read.
        assert wait_until(lambda: not select.select([self.master], [], [], 0.05)[0])
        return code

    def wait_seen(self, tail: bytes) -> None:
        """Until what the terminal got ends with ``tail`` (the reader runs behind the writer)."""
        assert wait_until(lambda: bytes(self.seen).endswith(tail)), bytes(self.seen[-200:])

    def left_for_the_shell(self) -> bytes:
        """What the caller's shell would read next (once answers ``delay`` lets come have come)."""
        time.sleep(self.delay + 0.3)
        tty.setraw(self.slave, termios.TCSANOW)  # TCSAFLUSH, its default, would flush
        os.set_blocking(self.slave, False)
        try:
            return os.read(self.slave, 1024)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        self._stop.set()
        self._reader.join()
        os.close(self.master)
        os.close(self.slave)

    def __enter__(self) -> AnsweringPty:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
