"""`nsbox run --ask` on a person's terminal: what they answer is nsbox's question alone.

The sandbox's output goes raw to the terminal the question is drawn on, and a key typed there
waits in the terminal's input queue until something reads it. So a hostile sandbox could
repaint the question while it waits (CR, erase-line, a copy naming another host) or ask its
own question first and let nsbox's take the answer typed for it. Each test runs the real CLI
on a pseudo-terminal of the test's (its controlling terminal, stdin, stdout and stderr), types
as a person would, and checks the host's side: a listener of the test's own records every
connection, and none may come from a question the person did not answer.

The host asked about is an address that can be approved: a public one, on a network namespace
of the test's own (root makes it), joined to the CLI's by a veth pair.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, require

# The host asked about is 1.2.3.4, a public address, on a peer namespace: the CLI runs in a
# network namespace of the test's own (A), joined by a veth pair to another (B) where a
# listener on 1.2.3.4 records each connection. (An address of A's own interfaces would be
# refused unasked: that address is the host.) B's script waits for its end of the pair, then
# listens; once the CLI has ended, it tells what it saw.
PEER = """
import json, socket, subprocess, sys, threading
print("up", flush=True)
sys.stdin.readline()
for command in ("ip link set lo up", "ip link set v1 up", "ip addr add 1.2.3.4/32 dev v1",
                "ip route add 5.6.7.8/32 dev v1"):
    subprocess.run(command.split(), check=True)
listener = socket.create_server(("1.2.3.4", 0))
seen = []
def serve():
    while True:
        conn, _ = listener.accept()
        seen.append("connected")
        conn.settimeout(5)
        try:
            seen.append(conn.recv(100).decode("ascii", "replace"))
        except OSError:
            pass
        conn.close()
threading.Thread(target=serve, daemon=True).start()
print(listener.getsockname()[1], flush=True)
sys.stdin.readline()
print(json.dumps(seen), flush=True)
"""
# A's script: B, the pair, then the CLI on the terminal the script inherited; the record last.
SCRIPT = """
import json, subprocess, sys
peer = subprocess.Popen(["unshare", "--net", "--", sys.executable, "-c", sys.argv[2]],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
peer.stdout.readline()
for command in (f"ip link add v0 type veth peer name v1 netns {peer.pid}", "ip link set lo up",
                "ip link set v0 up", "ip addr add 5.6.7.8/32 dev v0",
                "ip route add 1.2.3.4/32 dev v0"):
    subprocess.run(command.split(), check=True)
peer.stdin.write("\\n")
peer.stdin.flush()
port = int(peer.stdout.readline())
code = subprocess.call([sys.executable, "-m", "nsbox", "run", "--allow-host",
                        "example.invalid:1", "--ask", "--", "python3", "-c", sys.argv[1],
                        f"1.2.3.4:{port}"])
peer.stdin.write("\\n")
peer.stdin.flush()
seen = json.loads(peer.stdout.readline())
print("RECORD " + json.dumps({"port": port, "seen": seen, "exit": code}), flush=True)
"""

# The sandbox's side: CONNECT to the host named in argv[1] through the proxy; BEFORE runs
# first, DURING once the proxy has had the request a second (nsbox is asking by then).
PROBE = """
import os, socket, sys, time
{before}
proxy = os.environ["http_proxy"].rsplit(":", 1)
s = socket.create_connection((proxy[0][len("http://"):], int(proxy[1])))
s.sendall(b"CONNECT " + sys.argv[1].encode() + b" HTTP/1.1\\r\\n\\r\\n")
time.sleep(1)
{during}
reply = s.recv(100)
if reply.startswith(b"HTTP/1.1 200"):
    s.sendall(b"SECRET\\n")
    time.sleep(0.5)
print("proxy said", reply.split(b"\\r\\n")[0].decode())
"""

QUESTION = (rb"nsbox: the sandbox asks to reach 1\.2\.3\.4:\d+, which is not on the allow-list\. "
            rb"Allow it for this run\? \[y/N\] ")
# What the sandbox draws over it: the question a person would agree to.
FORGED = ("nsbox: the sandbox asks to reach files.pythonhosted.org:443, which is not on the "
          "allow-list. Allow it for this run? [y/N] ")


class Terminal:
    """The script on a new pty of the test's, as on a person's terminal."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, (40 | 200 << 16).to_bytes(8, "little"))
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd="/",
            start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.shown = b""

    def _read(self, timeout: float) -> bool:
        if not select.select([self.master], [], [], timeout)[0]:
            return False
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: every writer of the terminal has closed it
            chunk = b""
        self.shown += chunk
        return bool(chunk)

    def expect(self, pattern: bytes, timeout: float = 60) -> re.Match[bytes]:
        deadline = time.monotonic() + timeout
        while (found := re.search(pattern, self.shown)) is None:
            if time.monotonic() > deadline or (not self._read(0.2)
                                               and self.proc.poll() is not None):
                raise AssertionError(f"no {pattern!r} in {self.shown!r}")
        return found

    def look(self, seconds: float) -> bytes:
        """What the terminal shows after the person has looked at it this long."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            self._read(left)
        return self.shown

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def finish(self) -> dict[str, object]:
        """The script's record, once it ended."""
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        while self._read(0.2):
            pass
        found = re.search(rb"RECORD (.*)\r\n", self.shown)
        assert found is not None, self.shown
        return dict(json.loads(found.group(1)))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminal(public_tree: Path) -> Iterator[list[Terminal]]:
    require(os.geteuid() == 0 and shutil.which("ip") is not None,
            "needs root and ip(8) for a network namespace of the test's own")
    made: list[Terminal] = []
    yield made
    for each in made:
        each.close()


def _start(made: list[Terminal], public_tree: Path, before: str = "", during: str = ""
           ) -> Terminal:
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "PYTHONPATH": str(public_tree),
           "HOME": "/tmp", "TERM": "xterm"}
    probe = PROBE.format(before=before, during=during)
    term = Terminal(["unshare", "--net", "--", PYTHON, "-c", SCRIPT, probe, PEER], env)
    made.append(term)
    return term


def _last_line(shown: bytes) -> str:
    """The line the cursor is on, as a terminal shows it: CR goes back to its start, ESC[2K
    erases it, other escape sequences draw nothing."""
    line: list[str] = []
    col = 0
    text = shown.decode("utf-8", "replace").rsplit("\n", 1)[-1]
    for part in re.split(r"(\x1b\[[0-9;?!]*[A-Za-z]|\r)", text):
        if part == "\r":
            col = 0
        elif part == "\x1b[2K":
            line = [" "] * len(line)
        elif not part.startswith("\x1b"):
            for c in part:
                line[col:col + 1] = [c]
                col += 1  # noqa: SIM113 (a CR sets it back)
    return "".join(line).strip()


def test_the_sandbox_cannot_redraw_the_question(terminal: list[Terminal], public_tree: Path):
    """The sandbox asks for 1.2.3.4, and while nsbox asks, draws over the question one that
    names files.pythonhosted.org. The person answers what the screen shows them: y only to
    files.pythonhosted.org. Its output waits until the answer, so they see nsbox's question
    and refuse; the listener gets nothing."""
    redraw = "\r\x1b[2K" + FORGED  # back to the line's start, erase it, draw the forgery
    term = _start(terminal, public_tree,
                  during=f"sys.stdout.write({redraw!r}); sys.stdout.flush()")
    asked = term.expect(QUESTION)
    screen = term.look(2.5)  # the forgery was written 1 s after the request
    answer = b"y" if "files.pythonhosted.org" in _last_line(screen) else b"n"
    term.type(answer + b"\r")
    record = term.finish()
    assert record["seen"] == [], term.shown  # the host's side: no connection
    # Nothing of the sandbox's came between the question and the answer; what it wrote
    # meanwhile comes after the answer.
    assert screen.endswith(asked.group(0)), screen[asked.start():]
    assert _last_line(screen).startswith("nsbox: the sandbox asks to reach 1.2.3.4:")
    answered = term.shown.index(asked.group(0) + b"n\r\n") + len(asked.group(0)) + 3
    assert FORGED.encode() in term.shown[answered:]
    assert b"proxy said HTTP/1.1 403" in term.shown[answered:]


def test_the_question_is_drawn_in_a_state_the_sandbox_did_not_set(terminal: list[Terminal],
                                                                   public_tree: Path):
    """Before asking, the sandbox leaves the terminal concealing text, with a scroll region
    of two lines and a window-title string open (which would take the question in as the
    title). Between its last byte and the question, nsbox ends the string (CAN) and resets
    rendition and margins."""
    state = "\x1b[8m\x1b[3;4r\x1b]2;"
    term = _start(terminal, public_tree, before=f"sys.stdout.write({state!r}); "
                                                "sys.stdout.flush(); time.sleep(0.5)")
    asked = term.expect(QUESTION)
    term.look(0.5)
    term.type(b"n\r")
    record = term.finish()
    assert record["seen"] == []
    between = term.shown[term.shown.index(state.encode()) + len(state):asked.start()]
    assert between.startswith(b"\x18"), between  # CAN: the open string ends here
    assert b"\x1b[0m" in between and b"\x1b[r" in between, between
    assert between.endswith(b"\r\n"), between  # the question on a line of its own


def test_keys_typed_before_the_question_do_not_answer_it(terminal: list[Terminal],
                                                         public_tree: Path):
    """The sandbox asks a question of its own ("Proceed? [y/N]"); the person answers y to it,
    and nothing reads the terminal then. Two seconds later the sandbox asks the proxy for
    1.2.3.4: nsbox's question must wait for an answer typed to it, not take the y."""
    term = _start(terminal, public_tree,
                  before='print("pip: 3 packages to install. Proceed? [y/N] ", end="", '
                         'flush=True); time.sleep(2)')
    term.expect(rb"Proceed\? \[y/N\] ")
    term.type(b"y\r")  # to the sandbox's question
    asked = term.expect(QUESTION)
    screen = term.look(1.5)  # nothing typed after the question appeared
    term.type(b"n\r")
    record = term.finish()
    assert record["seen"] == [], term.shown  # the host's side: no connection
    assert screen.endswith(asked.group(0)), screen[asked.start():]  # still waiting
    assert asked.group(0) + b"n\r\n" in term.shown
    assert b"proxy said HTTP/1.1 403" in term.shown
