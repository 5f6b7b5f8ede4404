"""--tty: a terminal of the sandbox's own, relayed to the caller's; without it, the caller's
terminal never reaches the sandbox.

Each test runs the CLI on a pseudo-terminal the test makes (its controlling terminal and its
stdin, stdout and stderr, as a person's terminal is), types into the master and reads what
the terminal shows, and checks the terminal's modes (termios) from the test's side of it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import re
import select
import signal
import socket
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PYTHON, require
from sessiontools import UserRunner, user_runner

from nsbox.api import run_cancellable
from nsbox.sandbox import native

PS1 = "sbx-prompt> "
PROMPT = re.escape(PS1.encode())
SHELL = ["--env", f"PS1={PS1}", "--", "bash", "--norc", "--noprofile", "-i"]


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


@pytest.fixture(params=["native", "python"])
def core(request: pytest.FixtureRequest) -> str:
    if request.param == "native":
        require(native.MISSING == "", native.MISSING or "the native core")
    return str(request.param)


class Terminal:
    """The CLI on a new pty of the test's, as on a person's terminal of ``rows`` x ``cols``."""

    def __init__(self, argv: list[str], env: dict[str, str], rows: int = 31,
                 cols: int = 97) -> None:
        self.master, self.slave = pty.openpty()
        self.resize(rows, cols)
        self.before = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen(
            argv, stdin=self.slave, stdout=self.slave, stderr=self.slave, env=env, cwd="/",
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        self.shown = b""
        self.seen = 0  # what expect() has matched up to

    def resize(self, rows: int, cols: int) -> None:
        # On the master: the kernel signals SIGWINCH to the terminal's foreground group.
        fcntl.ioctl(self.master, termios.TIOCSWINSZ,
                    (rows | cols << 16).to_bytes(8, "little"))

    def modes(self) -> list[Any]:
        return termios.tcgetattr(self.slave)

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def _read(self, timeout: float) -> bool:
        if not select.select([self.master], [], [], timeout)[0]:
            return False
        self.shown += os.read(self.master, 65536)
        return True

    def expect(self, pattern: bytes, timeout: float = 60) -> re.Match[bytes]:
        """The first match of ``pattern`` in what the terminal showed since the last one."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern).search(self.shown, self.seen)
            if found:
                self.seen = found.end()
                return found
            if time.monotonic() > deadline or (not self._read(0.2)
                                               and self.proc.poll() is not None):
                raise AssertionError(f"no {pattern!r} in {self.shown[self.seen:]!r}")

    def finish(self, timeout: float = 60) -> int:
        """The CLI's exit status, once it ended; everything it showed is read."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:  # read on: a full terminal would stop its writer
            if time.monotonic() > deadline:
                raise AssertionError(f"the CLI did not end: {self.shown[-2000:]!r}")
            self._read(0.2)
        while self._read(0.2):
            pass
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    made: list[Terminal] = []
    yield made
    for each in made:
        each.close()


def cli(terminals: list[Terminal], user: UserRunner, *args: str, core: str = "native",
        **kwargs: Any) -> Terminal:
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "PYTHONPATH": str(user.tree),
           "HOME": "/tmp", "TERM": "xterm"}
    if core == "python":
        env["NSBOX_NATIVE"] = "0"
    terminal = Terminal([*user.prefix(), PYTHON, "-m", "nsbox", *args], env, **kwargs)
    terminals.append(terminal)
    return terminal


def stty_size(term: Terminal) -> tuple[int, int]:
    term.send(b"stty size\r")
    # After the line typed, or after the shell redrew it on SIGWINCH once it was taken (seen
    # under load: "stty size\r\n\r   \rsbx-prompt> stty size40 120\r\n").
    found = term.expect(rb"(?:\r\n|stty size)(\d+) (\d+)\r\n")
    term.expect(PROMPT)
    return int(found[1]), int(found[2])


def test_a_shell_on_its_own_terminal(terminals: list[Terminal], as_user: UserRunner,
                                     core: str):
    term = cli(terminals, as_user, "run", "--tty", *SHELL, core=core)
    term.expect(PROMPT)
    # The caller's terminal is raw while the shell runs: the sandbox's pty echoes, not it.
    assert not term.modes()[3] & (termios.ECHO | termios.ICANON | termios.ISIG)
    term.send(b"tty\r")
    assert re.fullmatch(rb"/dev/pts/\d+", term.expect(rb"\r\n(\S+)\r\n")[1])
    term.expect(PROMPT)
    assert stty_size(term) == (31, 97)
    term.resize(40, 120)
    # SIGWINCH reaches nsbox, which sets the size on the sandbox's pty: the shell sees it by
    # its next command or the one after (the signal and the typing race).
    sizes = [stty_size(term) for _ in range(3)]
    assert sizes[-1] == (40, 120), sizes
    # Ctrl-C ends the foreground job, not the shell; Ctrl-Z stops one, as job control does.
    term.send(b"sh -c 'echo started; exec sleep 100'\r")
    term.expect(b"\r\nstarted\r\n")
    term.send(b"\x03")
    term.expect(PROMPT)
    term.send(b"echo status=$?\r")
    term.expect(b"status=130")
    term.expect(PROMPT)
    term.send(b"sh -c 'echo started; exec sleep 100'\r")
    term.expect(b"\r\nstarted\r\n")
    term.send(b"\x1a")
    term.expect(rb"\[1\]\+\s+Stopped")
    term.expect(PROMPT)
    term.send(b"kill -9 %1\r")
    mark = len(term.shown)
    for _ in range(10):  # bash tells of the job's end at a later prompt, once it reaped it
        term.expect(PROMPT)
        if re.search(rb"\[1\]\+\s+Killed", term.shown[mark:]):
            break
        term.send(b"sleep 0.2\r")
    assert re.search(rb"\[1\]\+\s+Killed\s+sh -c", term.shown[mark:])
    term.send(b"exit 7\r")
    assert term.finish() == 7
    assert term.modes() == term.before


def test_the_terminal_comes_back_after_a_kill_at_the_time_limit(terminals: list[Terminal],
                                                                as_user: UserRunner):
    term = cli(terminals, as_user, "run", "--tty", "--time", "2", "--", "sleep", "100")
    assert term.finish() == 124
    assert term.modes() == term.before
    assert b"nsbox: TO: wall-clock limit reached" in term.shown


def test_the_terminal_comes_back_when_nsbox_is_stopped(terminals: list[Terminal]):
    term = cli(terminals, UserRunner("caller", Path(__file__).parent.parent), "run", "--tty",
               *SHELL)
    term.expect(PROMPT)
    assert term.modes() != term.before
    term.proc.send_signal(signal.SIGTERM)
    assert term.finish() == 128 + signal.SIGTERM
    assert term.modes() == term.before
    assert b"nsbox: stopped by SIGTERM: the sandbox was killed" in term.shown


def test_a_command_that_ends_at_once(terminals: list[Terminal], as_user: UserRunner,
                                     core: str):
    # All its output arrives before nsbox ends, and its status is nsbox's.
    term = cli(terminals, as_user, "run", "--tty", "--", "sh", "-c",
               "seq 1 2000; test -t 0 && test -t 1 && test -t 2 && exit 3", core=core)
    assert term.finish() == 3
    assert b"\r\n2000\r\n" in term.shown
    assert term.modes() == term.before


def test_a_session_command_on_its_own_terminal(terminals: list[Terminal], as_user: UserRunner):
    # One environment for start and stop: HOME picks the directory of the session's socket
    # (nsbox/session/supervisor.py, runtime_dir), and a stop that looks elsewhere finds none.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(as_user.tree), "HOME": "/tmp"}
    started = subprocess.run(
        [*as_user.prefix(), PYTHON, "-m", "nsbox", "session", "start"], capture_output=True,
        cwd="/", timeout=120, env=env)
    assert started.returncode == 0, started.stderr
    session_id = started.stdout.decode().split()[-1]
    try:
        term = cli(terminals, as_user, "session", "exec", "--tty", "-e", f"PS1={PS1}",
                   session_id, "--", "bash", "--norc", "--noprofile", "-i")
        term.expect(PROMPT)
        term.send(b"tty; stty size\r")
        found = term.expect(rb"\r\n(/dev/pts/\d+)\r\n31 97\r\n")
        assert found[1].startswith(b"/dev/pts/")
        term.expect(PROMPT)
        term.send(b"exit 7\r")
        assert term.finish() == 7
        assert term.modes() == term.before
        # Without --tty the caller's terminal stays out of a session's command too.
        term = cli(terminals, as_user, "session", "exec", session_id, "--", "sh", "-c",
                   "stty -echo; test -t 0 || echo stdin-is-not-a-terminal")
        assert term.finish() == 0
        assert b"stdin-is-not-a-terminal" in term.shown
        assert term.modes() == term.before
    finally:
        stopped = subprocess.run([*as_user.prefix(), PYTHON, "-m", "nsbox", "session", "stop",
                                  session_id], capture_output=True, cwd="/", timeout=60, env=env)
    assert stopped.returncode == 0, stopped.stderr


def test_without_tty_the_callers_terminal_is_not_handed_in(terminals: list[Terminal],
                                                          as_user: UserRunner):
    # Before, `nsbox run -- stty -echo` left the user's own shell without echo.
    term = cli(terminals, as_user, "run", "--", "stty", "-echo")
    assert term.finish() != 0
    assert b"stty: 'standard input': Inappropriate ioctl for device" in term.shown
    assert term.modes() == term.before
    term = cli(terminals, as_user, "run", "--quiet", "--", "sh", "-c",
               "test -t 0 || echo stdin; test -t 1 || echo stdout; test -t 2 || echo stderr")
    assert term.finish() == 0
    assert term.shown.split() == [b"stdin", b"stdout", b"stderr"]


def test_tiocsti_is_refused_on_the_sandboxs_own_terminal(terminals: list[Terminal],
                                                          as_user: UserRunner, core: str):
    # The seccomp filter refuses TIOCSTI (and TIOCLINUX) even on the sandbox's own pty; the
    # caller's terminal is not in the sandbox at all. Nothing typed appears on either.
    probe = ("import fcntl, errno\n"
             "for request in (0x5412, 0x541C):\n"
             "    try:\n"
             "        fcntl.ioctl(0, request, b'x')\n"
             "        print('allowed', flush=True)\n"
             "    except OSError as exc:\n"
             "        print('refused', errno.errorcode[exc.errno], flush=True)\n")
    term = cli(terminals, as_user, "run", "--tty", "--", "python3", "-c", probe, core=core)
    assert term.finish() == 0
    assert term.shown.split(b"\r\n")[:2] == [b"refused EPERM", b"refused EPERM"]
    assert term.modes() == term.before


def test_tty_needs_a_terminal_and_no_json(as_user: UserRunner):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(as_user.tree), "HOME": "/tmp"}
    for args in (["run", "--tty", "--", "true"], ["session", "exec", "--tty", "0" * 12, "true"]):
        proc = subprocess.run([*as_user.prefix(), PYTHON, "-m", "nsbox", *args],
                              stdin=subprocess.DEVNULL, capture_output=True, env=env, cwd="/",
                              timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert b"--tty needs a terminal on stdin" in proc.stderr
        assert b"Traceback" not in proc.stderr
    proc = subprocess.run([*as_user.prefix(), PYTHON, "-m", "nsbox", "run", "--tty", "--json",
                           "--", "true"], capture_output=True, env=env, cwd="/", timeout=60)
    assert proc.returncode == 2
    assert b"--tty and --json do not go together" in proc.stderr


def test_tty_does_not_go_with_collect(terminals: list[Terminal], as_user: UserRunner):
    term = cli(terminals, as_user, "run", "--tty", "--collect", "*.txt", "--", "true")
    assert term.finish() == 2
    assert b"--tty does not go with --project, --ask, --collect or --audit" in term.shown
    assert term.modes() == term.before


def _launch_with_terminal(argv: list[str]) -> tuple[Any, bytes]:
    """nsbox.run (the door of --tty) with a pty of the sandbox's: the Result, and what the
    pty showed."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        result = run_cancellable(argv, stdin=theirs.fileno(), tty=(12, 34))
        message, fds, _flags, _addr = socket.recv_fds(ours, 64, 4)
    assert message == b"nsbox-tty" and len(fds) == 1
    shown = b""
    try:
        while True:
            shown += os.read(fds[0], 65536)
    except OSError as exc:
        assert exc.errno == errno.EIO  # no process holds the pty any more
    finally:
        os.close(fds[0])
    return result, shown


def test_both_cores_take_the_terminal_in_the_same_steps(monkeypatch: pytest.MonkeyPatch):
    require(native.MISSING == "", native.MISSING or "the native core")
    monkeypatch.setenv("NSBOX_TRACE", "1")
    steps = {}
    for core_name in ("native", "python"):
        monkeypatch.setenv("NSBOX_NATIVE", "0" if core_name == "python" else "1")
        result, shown = _launch_with_terminal(["sh", "-c", "tty; stty size"])
        assert result.extra["core"] == core_name
        assert (result.exit_code, shown) == (0, b"/dev/pts/0\r\n12 34\r\n")
        steps[core_name] = [entry["step"] for entry in result.extra["trace"]
                            if not entry["step"].startswith(("host:", "helper:"))]
    assert steps["native"] == steps["python"]
    at = steps["native"].index("terminal")
    assert steps["native"][at - 1:at + 2] == ["working directory", "terminal",
                                              "close file descriptors"]


def test_a_terminal_in_the_landlock_mode(terminals: list[Terminal], as_user: UserRunner):
    from nsbox._sys import landlock as _landlock

    abi = _landlock.abi_version()
    require(abi >= _landlock.MIN_ABI, f"the kernel has Landlock ABI {abi}, the mode needs 4")
    # No mount namespace there: the pty is a new one of the host's devpts, still nobody
    # else's, and made before the Landlock layer, as the streams are.
    term = cli(terminals, as_user, "run", "--isolation", "landlock", "--tty", "--quiet", "--",
               "sh", "-c", "tty; stty size; test -t 0 && exit 3")
    assert term.finish() == 3
    assert re.match(rb"/dev/pts/\d+\r\n31 97\r\n", term.shown), term.shown
    assert term.modes() == term.before


def test_the_output_limit_holds_on_a_terminal(terminals: list[Terminal]):
    term = cli(terminals, UserRunner("caller", Path(__file__).parent.parent), "run", "--tty",
               "--output-limit", "64K", "--quiet", "--", "sh", "-c", "yes | head -c 10M; sleep 100")
    assert term.finish() == 123
    shown = term.shown.split(b"nsbox:")[0]
    assert 64 * 1024 - 1024 <= len(shown) <= 64 * 1024, len(shown)
    assert b"nsbox: OL: output limit reached; raise it with --output-limit" in term.shown
    assert term.modes() == term.before
