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
import time

from conftest import PYTHON

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
