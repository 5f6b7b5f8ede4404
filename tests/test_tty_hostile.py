"""The --tty relay and the caller's terminal, attacked from inside real sandboxes.

What the sandbox controls on a --tty run: the bytes its pty shows, how fast it reads what is
typed, its own pty's modes and size, and how long it lives. What must hold on the host: the
caller's terminal comes back as it was, nothing the sandbox made is typed into the caller's
shell, the output limit holds, the relay ends with the run, and no host descriptor reaches
the sandbox (nor the master any other host process).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import select
import signal
import socket
import subprocess
import termios
import threading
import tty
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, require
from ptytools import DA1_ANSWER, DA1_QUERY, AnsweringPty
from sessiontools import UserRunner, sleepers, user_runner, wait_until
from test_tty import PROMPT, SHELL, Terminal, cli

from nsbox.api import run_cancellable
from nsbox.host import terminal as host_terminal
from nsbox.host.terminal import Relay
from nsbox.sandbox import native

__all__ = ["Terminal"]  # the fixture's type, from test_tty


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    made: list[Terminal] = []
    yield made
    for each in made:
        each.close()


@pytest.fixture(params=["caller", "unprivileged"])
def as_user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


@pytest.fixture(params=["native", "python"])
def core(request: pytest.FixtureRequest) -> str:
    if request.param == "native":
        require(native.MISSING == "", native.MISSING or "the native core")
    return str(request.param)


def _env(user: UserRunner) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(user.tree), "HOME": "/tmp"}


def _session(user: UserRunner) -> str:
    started = subprocess.run([*user.prefix(), PYTHON, "-m", "nsbox", "session", "start"],
                             capture_output=True, cwd="/", timeout=120, env=_env(user))
    assert started.returncode == 0, started.stderr
    return started.stdout.decode().split()[-1]


def _stop(user: UserRunner, session_id: str) -> None:
    subprocess.run([*user.prefix(), PYTHON, "-m", "nsbox", "session", "stop", session_id],
                   capture_output=True, cwd="/", timeout=60, env=_env(user))


@pytest.fixture
def caller_pty() -> Iterator[AnsweringPty]:
    """A pty of the test's own as the caller's terminal of an in-process Relay, read all along
    and answering DA1 (which the relay asks once the sandbox's output held a control)."""
    with AnsweringPty({DA1_QUERY: DA1_ANSWER}) as made:
        yield made


# --- what the relay receives ------------------------------------------------------------------


def test_the_command_holds_no_way_back_to_the_relay(terminals: list[Terminal],
                                                     as_user: UserRunner):
    # The master leaves before the command exists; the socket it left by is gone from every
    # process the command can see, and pid 1's descriptors are out of its reach (not
    # dumpable: /proc/1/fd, pidfd_getfd(2) and ptrace(2) are refused).
    probe = (
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n"
        "        names = os.listdir(f'/proc/{pid}/fd')\n"
        "    except OSError as exc:\n"
        "        print('fds of', pid, errno.errorcode[exc.errno]); continue\n"
        "    for n in names:\n"
        "        try:\n"
        "            print('fd', pid, n, os.readlink(f'/proc/{pid}/fd/{n}'))\n"
        "        except OSError:\n"
        "            pass  # the listing's own descriptor, closed already\n"
        "pidfd = os.pidfd_open(1)\n"
        "for n in range(8):\n"
        "    got = libc.syscall(438, pidfd, n, 0)\n"
        "    print('getfd', n, got, errno.errorcode.get(ctypes.get_errno()))\n"
        "print('attach', libc.syscall(101, 16, 1, 0, 0), "
        "errno.errorcode.get(ctypes.get_errno()))\n")
    term = cli(terminals, as_user, "run", "--tty", "--", "python3", "-c", probe)
    assert term.finish() == 0
    lines = term.shown.decode().split("\r\n")
    assert "fds of 1 EACCES" in lines
    seen = {line.split()[3] for line in lines if line.startswith("fd ")}
    assert seen == {"/dev/pts/0"}, lines
    assert [line for line in lines if line.startswith("getfd")] == [
        f"getfd {n} -1 EPERM" for n in range(8)]
    assert "attach -1 EPERM" in lines
    assert term.modes() == term.before


def test_a_terminal_the_caller_holds_on_other_descriptors_is_not_passed_in(public_tree: Path):
    # The caller's shell keeps its terminal open on more than 0, 1 and 2 (bash: 255). None
    # of them reaches the command, with or without --tty.
    as_user = UserRunner("caller", public_tree)
    master, slave = pty.openpty()
    held: list[int] = []
    try:
        # Free numbers at or above 300 (9 may be pytest's own), inheritable.
        held = [fcntl.fcntl(slave, fcntl.F_DUPFD, low) for low in (300, 400)]
        for fd in held:
            os.set_inheritable(fd, True)
        probe = ("ls /proc/self/fd; for fd in " + " ".join(map(str, held)) + "; do "
                 "echo injected > /proc/self/fd/$fd || echo not-there; done")
        for tty_args in ([], ["--tty"]):
            ran = subprocess.run(
                [*as_user.prefix(), PYTHON, "-m", "nsbox", "run", "--quiet", *tty_args, "--",
                 "sh", "-c", probe], stdin=slave if tty_args else subprocess.DEVNULL,
                stdout=subprocess.PIPE if not tty_args else slave, stderr=subprocess.STDOUT,
                pass_fds=tuple(held), env=_env(as_user), cwd="/", timeout=120)
            assert ran.returncode == 0
            if not tty_args:
                assert ran.stdout.split()[:4] == [b"0", b"1", b"2", b"3"], ran.stdout
                assert ran.stdout.count(b"not-there") == 2, ran.stdout
        shown = b""
        while select.select([master], [], [], 0.2)[0]:
            shown += os.read(master, 65536)
        assert b"injected" not in shown
        assert shown.count(b"not-there") == 2, shown  # the --tty run's, on its own pty
    finally:
        for fd in (*held, master, slave):
            os.close(fd)


def test_the_relay_keeps_only_one_pty_master_sent_with_the_tag(caller_pty: AnsweringPty):
    # The socket the master arrives on is the only door in; whatever else comes by it is
    # closed and the relay shows nothing (the run goes on without a terminal).
    fifo_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    cases = []
    other_master, other_slave = pty.openpty()  # a pty of another devpts: the host's
    read_end, write_end = os.pipe()
    memfd = os.memfd_create("not-a-pty")
    left, right = socket.socketpair()
    fifo = fifo_dir / f"nsbox-test-fifo-{os.getpid()}"
    os.mkfifo(fifo)
    fifo_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        cases = [([b"nsbox-tty"], [read_end]), ([b"nsbox-tty"], [memfd]),
                 ([b"nsbox-tty"], [left.fileno()]), ([b"nsbox-tty"], [fifo_fd]),
                 ([b"not-the-tag"], [other_master]), ([b"nsbox-tty"], []),
                 ([b"nsbox-tty" * 1000], [other_master]),
                 ([b"nsbox-tty"], [read_end, other_master]),
                 ([b"nsbox-tty"], [memfd] * 200)]
        for buffers, fds in cases:
            before = set(os.listdir("/proc/self/fd"))
            relay = Relay(fd_in=caller_pty.slave, fd_out=caller_pty.slave)
            with relay:
                with socket.socket(fileno=relay.sandbox_end) as theirs:
                    try:
                        socket.send_fds(theirs, buffers, fds)
                    except OSError as exc:
                        assert exc.errno in (errno.EMSGSIZE, errno.ETOOMANYREFS), exc
                    theirs.detach()
                assert relay._done.wait(10)
                assert relay.master == -1, (buffers[0][:20], fds)
            assert set(os.listdir("/proc/self/fd")) <= before  # nothing received stays open
            assert termios.tcgetattr(caller_pty.slave) == caller_pty.before
    finally:
        for fd in (other_master, other_slave, read_end, write_end, memfd, fifo_fd):
            os.close(fd)
        left.close()
        right.close()
        fifo.unlink()


def test_the_master_is_not_inherited_by_what_the_host_starts(caller_pty: AnsweringPty):
    with Relay(fd_in=caller_pty.slave, fd_out=caller_pty.slave) as relay:
        seen: list[int] = []

        def look() -> None:
            while relay.master < 0 and not relay._done.is_set():
                relay._done.wait(0.05)
            if relay.master >= 0:
                seen.append(fcntl.fcntl(relay.master, fcntl.F_GETFD))

        watcher = threading.Thread(target=look)
        watcher.start()
        result = run_cancellable(["sh", "-c", "sleep 1"], stdin=relay.sandbox_end,
                                 tty=relay.size)
        watcher.join()
    assert result.exit_code == 0
    assert seen and seen[0] & fcntl.FD_CLOEXEC


def test_a_run_that_sends_no_master_or_fails_after_gives_the_terminal_back(
        terminals: list[Terminal], as_user: UserRunner, core: str):
    # A setup step before the terminal's fails: nothing arrives on the socket. The command
    # does not exist: the master arrived, the exec failed. Either way the modes come back.
    for args, code, said in (
            (["--cwd", "/nonexistent-dir", "--", "true"], 125, b"nsbox: working directory: "),
            (["--", "/nonexistent-command"], 127,
             b"nsbox: exec: /nonexistent-command: No such file")):
        term = cli(terminals, as_user, "run", "--tty", "--quiet", *args, core=core)
        assert term.finish() == code
        assert said in term.shown
        assert term.modes() == term.before


# --- what the sandbox does with its pty ------------------------------------------------------


def test_a_terminal_answer_after_the_run_is_not_typed_into_the_shell(caller_pty: AnsweringPty):
    # The sandbox's last output asks the terminal a question (ESC [ 21 t: report the title,
    # which it set to a command line). The answer comes after the run: it must not wait in
    # the terminal's input for the caller's shell to read as typed.
    with Relay(fd_in=caller_pty.slave, fd_out=caller_pty.slave) as relay:
        result = run_cancellable(["sh", "-c", r"printf '\033]2;id>/tmp/p\a\033[21t'"],
                                 stdin=relay.sandbox_end, tty=relay.size)
        assert relay._done.wait(30)  # the pty has ended: the relay reads no more input
        os.write(caller_pty.master, b"\x1b]lid>/tmp/p\r\x1b\\")  # the terminal's answer
    assert result.exit_code == 0
    assert termios.tcgetattr(caller_pty.slave) == caller_pty.before
    # What the shell would read next: nothing.
    tty.setraw(caller_pty.slave, termios.TCSANOW)  # TCSAFLUSH, its default, would flush
    os.set_blocking(caller_pty.slave, False)
    with pytest.raises(BlockingIOError):
        os.read(caller_pty.slave, 1024)


# What a program sets on the terminal (on, off): each left set by the sandbox must be set off
# after its last output reached the terminal.
_LEFT_SET = [(b"\x1b[?1049h", b"\x1b[?1049l"), (b"\x1b[2;3r", b"\x1b[r"),
             (b"\x1b[?25l", b"\x1b[?25h"), (b"\x1b[?1003h", b"\x1b[?1003l"),
             (b"\x1b[?1006h", b"\x1b[?1006l"), (b"\x1b[?1004h", b"\x1b[?1004l"),
             (b"\x1b[?2004h", b"\x1b[?2004l"), (b"\x1b(0", b"\x1b(B"), (b"\x0e", b"\x0f"),
             (b"\x1b[8m", b"\x1b[0m"), (b"\x1b[?7l", b"\x1b[?7h"), (b"\x1b[4h", b"\x1b[4l"),
             (b"\x1b[?1h", b"\x1b[?1l"), (b"\x1b=", b"\x1b>")]


@pytest.mark.parametrize("how", ["exits", "killed at its limit"])
def test_modes_a_sandbox_leaves_set_on_the_terminal_are_set_back(caller_pty: AnsweringPty,
                                                                  how: str):
    # A program that hides what the caller's shell shows next: the alternate screen, a scroll
    # region of one line, a hidden cursor, invisible text (SGR 8), the line-drawing set, mouse
    # and paste reports that would type into the shell; then it ends, or is killed.
    script = "printf '" + "".join(on.decode().replace("\x1b", "\\033")
                                  .replace("\x0e", "\\016") for on, _ in _LEFT_SET) + "'"
    if how != "exits":
        script += "; sleep 60"
    with Relay(fd_in=caller_pty.slave, fd_out=caller_pty.slave) as relay:
        result = run_cancellable(["sh", "-c", script], stdin=relay.sandbox_end, tty=relay.size,
                                 timeout=None if how == "exits" else 2)
    assert result.status == ("OK" if how == "exits" else "TO")
    caller_pty.wait_seen(host_terminal.TERMINAL_DEFAULTS + DA1_QUERY)
    seen = bytes(caller_pty.seen)
    for on, off in _LEFT_SET:
        assert on in seen, on
        assert seen.rindex(off) > seen.rindex(on), (on, off)
    assert termios.tcgetattr(caller_pty.slave) == caller_pty.before


def test_output_without_an_escape_leaves_the_terminal_as_it_is(caller_pty: AnsweringPty):
    with Relay(fd_in=caller_pty.slave, fd_out=caller_pty.slave) as relay:
        result = run_cancellable(["echo", "plain"], stdin=relay.sandbox_end, tty=relay.size)
    assert result.exit_code == 0
    caller_pty.wait_seen(b"plain\r\n")
    assert b"\x1b" not in caller_pty.seen


def test_typed_input_a_sandbox_does_not_read_is_not_held_without_bound(caller_pty: AnsweringPty):
    # The sandbox never reads its pty while the caller's side sends 8 MiB (a paste, or a
    # terminal answering a flood of queries): the relay holds at most its buffer, the rest
    # waits in the caller's terminal.
    sent = [0]
    largest = [0]
    with Relay(fd_in=caller_pty.slave, fd_out=caller_pty.slave) as relay:
        stop = threading.Event()

        def paste() -> None:
            os.set_blocking(caller_pty.master, False)
            while not stop.is_set() and sent[0] < 8 << 20:
                largest[0] = max(largest[0], len(relay._pending))
                if select.select([], [caller_pty.master], [], 0.05)[1]:
                    try:
                        sent[0] += os.write(caller_pty.master, b"x" * 4096)
                    except BlockingIOError:
                        pass

        typist = threading.Thread(target=paste)
        typist.start()
        result = run_cancellable(["sleep", "3"], stdin=relay.sandbox_end, tty=relay.size)
        stop.set()
        typist.join()
    assert result.exit_code == 0
    assert largest[0] <= host_terminal._PENDING + host_terminal._CHUNK
    assert sent[0] > largest[0]  # more was typed than the relay held


def test_the_relay_ends_with_a_run_that_floods_to_its_limit(caller_pty: AnsweringPty):
    # A writer that never stops, in the background: the run's end (its time limit) ends
    # the relay too; no thread goes on writing to the caller's terminal.
    with Relay(fd_in=caller_pty.slave, fd_out=caller_pty.slave) as relay:
        result = run_cancellable(["sh", "-c", "trap '' HUP; (yes &); exec sleep 100"],
                                 stdin=relay.sandbox_end, tty=relay.size, timeout=2)
    assert result.timed_out
    assert not relay._thread.is_alive()
    assert relay.master == -1
    assert termios.tcgetattr(caller_pty.slave) == caller_pty.before


def test_the_sandbox_sizes_and_modes_only_its_own_pty(terminals: list[Terminal],
                                                       as_user: UserRunner):
    term = cli(terminals, as_user, "run", "--tty", *SHELL)
    term.expect(PROMPT)
    term.send(b"stty rows 65535 cols 65535 -echo -icanon; stty size\r")
    term.expect(rb"65535 65535\r\n")
    term.send(b"exit\r")
    assert term.finish() == 0
    assert term.modes() == term.before
    assert os.get_terminal_size(term.slave) == os.terminal_size((97, 31))


def test_tiocsti_with_high_bits_in_the_request_is_refused(terminals: list[Terminal],
                                                          as_user: UserRunner):
    # ioctl(2) takes the request as an unsigned int: a filter that compared 64 bits would
    # let 0x1_0000_5412 through as TIOCSTI (CVE-2019-10063 in flatpak).
    probe = ("import ctypes, errno\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "for request in (0x5412, 0x100005412, 0xffffffff00005412, 0x10000541c):\n"
             "    c = ctypes.c_char(b'x')\n"
             "    got = libc.syscall(16, 0, ctypes.c_ulong(request), ctypes.byref(c))\n"
             "    print(hex(request), got, errno.errorcode.get(ctypes.get_errno()))\n")
    term = cli(terminals, as_user, "run", "--tty", "--quiet", "--", "python3", "-c", probe)
    assert term.finish() == 0
    # Exactly these lines: no injected "x" read back, echoed, or left for the caller.
    assert term.shown.split(b"\r\n") == [
        b"0x5412 -1 EPERM", b"0x100005412 -1 EPERM", b"0xffffffff00005412 -1 EPERM",
        b"0x10000541c -1 EPERM", b""]
    assert term.modes() == term.before


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT])
@pytest.mark.parametrize("where", ["run", "session"])
def test_a_signal_that_ends_nsbox_puts_the_terminal_back(terminals: list[Terminal],
                                                        public_tree: Path, signum: int,
                                                        where: str):
    # Before, SIGHUP and SIGQUIT (and SIGTERM of `session exec`) ended nsbox by their default
    # action, without unwinding: the caller's terminal stayed raw. nsbox still ends by the
    # signal, and the sandbox with it.
    user = UserRunner("caller", public_tree)
    marker = f"{4200 + signum}.{os.getpid()}"
    session_id = _session(user) if where == "session" else ""
    try:
        args = ["session", "exec", "--tty", session_id] if session_id else ["run", "--tty"]
        term = cli(terminals, user, *args, "--", "sh", "-c",
                   f"echo READY; sleep {marker}; echo not-reached")
        term.expect(b"READY")
        assert wait_until(lambda: sleepers(marker) != [])
        assert term.modes() != term.before
        term.proc.send_signal(signum)
        code = term.finish()
        assert code in (-signum, 128 + signum)  # `nsbox run` reports SIGTERM itself
        assert term.modes() == term.before
        assert wait_until(lambda: sleepers(marker) == [])
    finally:
        if session_id:
            _stop(user, session_id)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_nsbox_stopped_from_elsewhere_gives_the_terminal_back_until_it_goes_on(
        terminals: list[Terminal], public_tree: Path):
    # In raw mode no key stops nsbox; `kill -TSTP` does. bash, the caller's shell with job
    # control, has its terminal back in its own modes while nsbox is stopped; `fg` continues
    # it, and then the run must have raw mode again (bash puts back no job's modes): typed
    # keys reach the sandbox's pty one by one, Ctrl-C is no signal for nsbox. And the
    # sandbox's program is told to draw its screen again (SIGWINCH): the shell drew there.
    user = UserRunner("caller", public_tree)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(user.tree), "HOME": "/tmp",
           "TERM": "xterm", "PS1": "PROMPT> "}
    term = Terminal(["bash", "--norc", "--noprofile", "-i"], env)
    terminals.append(term)
    term.expect(b"PROMPT> ")
    program = ("import signal; signal.signal(signal.SIGWINCH, lambda *_: print('redraw', "
               "flush=True)); print('READY', flush=True); print('got:' + input())")
    term.send(f'{PYTHON} -m nsbox run --tty -- python3 -c "{program}"\r'.encode())
    term.expect(b"READY\r\n")  # the line the command wrote, not the one typed
    raw = term.modes()
    assert raw != term.before
    with open(f"/proc/{term.proc.pid}/task/{term.proc.pid}/children") as f:
        (nsbox_pid,) = [int(pid) for pid in f.read().split()]
    os.kill(nsbox_pid, signal.SIGTSTP)
    assert wait_until(lambda: _state(nsbox_pid) == "T")
    term.expect(b"Stopped")
    assert term.modes() != raw
    term.send(b"fg\r")
    assert wait_until(lambda: term.modes() == raw)
    term.expect(b"redraw\r\n")
    term.send(b"typed\r")
    term.expect(b"got:typed\r\n")
    term.expect(b"PROMPT> ")
    term.send(b"exit\r")
    assert term.finish() == 0


@pytest.mark.parametrize("where", ["run", "session"])
def test_a_command_that_drops_its_terminal_gives_the_callers_back(terminals: list[Terminal],
                                                                  public_tree: Path,
                                                                  where: str):
    # It closes its pty, ignores SIGINT and sleeps: before, the caller's terminal stayed raw
    # (Ctrl-C went nowhere) until the time limit. Once no process holds the pty the terminal
    # is the caller's again, and Ctrl-C ends nsbox and the sandbox.
    user = UserRunner("caller", public_tree)
    marker = f"4300.{os.getpid()}"
    session_id = _session(user) if where == "session" else ""
    try:
        args = ["session", "exec", "--tty", "-t", "600", session_id] if session_id else [
            "run", "--tty", "--time", "600"]
        term = cli(terminals, user, *args, "--", "sh", "-c",
                   f"trap '' INT; echo READY; exec </dev/null >/dev/null 2>&1; sleep {marker}")
        term.expect(b"READY")
        assert wait_until(lambda: term.modes() == term.before, 30)
        # The shell drops the pty before it forks the sleeper: the terminal may come back first.
        assert wait_until(lambda: sleepers(marker) != [], 30)
        term.send(b"\x03")
        code = term.finish()
        assert code == (130 if where == "run" else 1)
        assert wait_until(lambda: sleepers(marker) == [])
        if where == "run":
            assert b"nsbox: stopped by SIGINT: the sandbox was killed" in term.shown
    finally:
        if session_id:
            _stop(user, session_id)


# --- sessions ---------------------------------------------------------------------------------


def test_a_session_command_on_a_terminal_holds_the_output_limit(terminals: list[Terminal],
                                                                 as_user: UserRunner):
    session_id = _session(as_user)
    try:
        term = cli(terminals, as_user, "session", "exec", "--tty", "--output-limit", "64K",
                   session_id, "--", "sh", "-c", "yes | head -c 10M; sleep 100")
        assert term.finish() == 123
        shown = term.shown.split(b"nsbox:")[0]
        assert len(shown) <= 64 * 1024, len(shown)
        assert b"nsbox: OL: output limit reached" in term.shown
        assert term.modes() == term.before
        # The session's own limit holds where the command names none; the session goes on.
        term = cli(terminals, as_user, "session", "exec", "--tty", session_id, "--",
                   "sh", "-c", "tty; echo on-its-terminal")
        assert term.finish() == 0
        assert b"on-its-terminal" in term.shown
    finally:
        _stop(as_user, session_id)


def test_without_tty_no_stream_or_dev_tty_is_the_callers_terminal(terminals: list[Terminal],
                                                                   as_user: UserRunner):
    probe = ("import errno, os\n"
             "print([os.isatty(fd) for fd in (0, 1, 2)])\n"
             "try:\n"
             "    os.open('/dev/tty', os.O_RDWR)\n"
             "    print('/dev/tty opened')\n"
             "except OSError as exc:\n"
             "    print('/dev/tty', errno.errorcode[exc.errno])\n")
    session_id = _session(as_user)
    try:
        for args in (("run", "--quiet"), ("session", "exec", session_id)):
            term = cli(terminals, as_user, *args, "--", "python3", "-c", probe)
            assert term.finish() == 0
            assert term.shown.split(b"\r\n")[:2] == [b"[False, False, False]",
                                                     b"/dev/tty ENXIO"], args
            assert term.modes() == term.before
    finally:
        _stop(as_user, session_id)


@pytest.mark.parametrize("with_tty", [False, True])
def test_in_the_landlock_mode_the_callers_terminal_is_out_of_reach(terminals: list[Terminal],
                                                                   as_user: UserRunner,
                                                                   with_tty: bool):
    # No mount namespace there: the host's devpts is the sandbox's. The caller's terminal
    # is a node of it, of the same user, and the Landlock layer still refuses it by name.
    from nsbox._sys import landlock as _landlock

    abi = _landlock.abi_version()
    require(abi >= _landlock.MIN_ABI, f"the kernel has Landlock ABI {abi}, the mode needs 4")
    other_master, other_slave = pty.openpty()  # another terminal of the caller's
    try:
        names = [os.ttyname(other_slave)]
        probe = ("import errno, os, sys\n"
                 f"for name in {names!r} + ['/dev/ptmx', '/dev/console']:\n"
                 "    try:\n"
                 "        os.close(os.open(name, os.O_RDWR | os.O_NOCTTY))\n"
                 "        print(name, 'opened')\n"
                 "    except OSError as exc:\n"
                 "        print(name, errno.errorcode[exc.errno])\n")
        term = cli(terminals, as_user, "run", "--isolation", "landlock", "--quiet",
                   *(["--tty"] if with_tty else []), "--", "python3", "-c", probe)
        assert term.finish() == 0
        said = term.shown.decode().split("\r\n")
        assert said[:3] == [f"{names[0]} EACCES", "/dev/ptmx EACCES", "/dev/console EACCES"], said
        assert not select.select([other_master], [], [], 0)[0]  # nothing reached it
        assert term.modes() == term.before
    finally:
        os.close(other_master)
        os.close(other_slave)
