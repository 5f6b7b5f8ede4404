"""The caller's side of ``--tty``: its terminal relayed, in raw mode, to a pty of the sandbox.

The sandbox makes its own pty (nsbox/sandbox/terminal.py says why there) and sends the master
out over a unix socket that this side hands in as the launch's stdin. The caller's terminal
itself is never handed in: the sandbox cannot change its modes, read it or push input into it
(TIOCSTI is refused by the seccomp filter as well, docs/seccomp.md). What the sandbox writes
reaches the caller's terminal as it is, escape sequences included, as with ``docker run -it``
or ``ssh -t``: an editor or a shell needs them, which is why it is asked for with --tty.

``Relay`` is a context manager for one run:

- on entry it notes the caller's termios and window size and puts the terminal in raw mode
  (cfmakeraw(3)): every key, Ctrl-C and Ctrl-Z among them, goes to the sandbox's pty, whose
  own line discipline turns them into signals for its foreground process group;
- a thread copies the caller's input to the master and the master's output to the caller;
- SIGWINCH (the caller's window changed) is passed on as TIOCSWINSZ on the master, which
  signals the sandbox's foreground process group in turn (ioctl_tty(2));
- on exit, whatever happened (the command's end, an exception, SIGTERM, the sandbox killed at
  its limit), the caller's termios are put back as they were (``finally``), and what reached
  the terminal's input unrelayed is discarded: the terminal's answer to a query the sandbox
  wrote last is no line for the caller's shell; and where the sandbox's output held an escape
  sequence, the modes a program may leave set on the terminal itself (the alternate screen, a
  scroll region, a hidden cursor, mouse reports, a line-drawing character set, ...: see
  TERMINAL_DEFAULTS) are set back to the defaults the caller's shell had them in;
- a signal whose default would end this process unwound (SIGHUP, SIGQUIT; SIGTERM where
  nothing handles it) puts them back first, and once no process of the sandbox holds its pty
  they are put back while the run goes on, so that Ctrl-C reaches nsbox again;
- SIGTSTP (nsbox stopped from elsewhere: in raw mode no key sends it) puts them back while
  nsbox is stopped, and SIGCONT sets raw mode again and has the sandbox's program redraw its
  screen (a SIGWINCH).

Only SIGKILL of nsbox itself leaves the terminal raw (``stty sane`` or ``reset`` repairs it);
SIGSTOP leaves it raw until SIGCONT.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import select
import selectors
import signal
import socket
import termios
import threading
import time
import tty
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Any

from nsbox._sys import wire as _wire
from nsbox.sandbox.terminal import TAG

TIOCGPTN = 0x80045430  # _IOR('T', 0x30, unsigned int): only a pty master answers it
TIOCGSID = 0x5429  # asm-generic/ioctls.h (x86-64, arm64); not in the termios module
DEFAULT_SIZE = (24, 80)  # a terminal that does not know its size (TIOCGWINSZ says 0 x 0)
# Signals whose default action ends this process without unwinding it (signal(7)): while the
# terminal is raw, a handler puts it back first and then lets the signal do what it would
# have done. One that already has a handler (SIGTERM in `nsbox run`) is left to it.
_ENDING = (signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT)
_DRAIN = 2.0  # seconds for the last output of a run that has ended to arrive
_CHUNK = 65536
# Typed input held for a sandbox that does not read its pty: past this, the caller's terminal
# is not read (its own queue fills) rather than this process's memory.
_PENDING = 65536
# What a program may leave set on the terminal when it ends (killed at its limit, or on
# purpose, to hide what the caller's shell shows next): each put back to its default, which is
# how the caller's shell had it while it waited for nsbox, without clearing the screen (RIS
# would). The main screen (DECSET 1049, also left by 47 and 1047); no scroll region (DECSTBM
# homes the cursor, so it is saved and restored round it, DECSC/DECRC); plain colours (SGR 0);
# the ASCII set in G0, shifted in (a line-drawing set shows letters as boxes); replace mode
# (IRM); autowrap (DECAWM); a visible cursor (DECTCEM); normal cursor keys and keypad (DECCKM,
# DECKPNM); no mouse, focus or bracketed-paste reports (each would type sequences into the
# shell). The xterm control sequences: ctlseqs(ms), "XTerm Control Sequences".
TERMINAL_DEFAULTS = (
    b"\x1b[?1049l" b"\x1b7\x1b[r\x1b8" b"\x1b[0m" b"\x1b(B\x0f" b"\x1b[4l" b"\x1b[?7h"
    b"\x1b[?25h" b"\x1b[?1l\x1b>"
    b"\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1005l\x1b[?1006l\x1b[?1015l"
    b"\x1b[?1004l\x1b[?2004l")
# The bytes that begin what a terminal obeys beyond text: ESC, the C1 CSI, DCS and OSC (raw,
# or the second byte of their UTF-8 form), shift-out, and ENQ (which a terminal answers with
# its answerback string). Output without any of them changed no mode and asked nothing, and
# the terminal is left as it is.
CONTROL_STARTS = (b"\x1b", b"\x9b", b"\x90", b"\x9d", b"\x0e", b"\x05")
# Written before anything of nsbox's own after such output: CAN ends any escape, control or
# string sequence the sandbox left open (an OSC title would swallow what follows), ST for a
# terminal that waits for one, S7C1T for answers in 7-bit form.
CLOSE_OPEN = b"\x18\x1b\\\x1b F"
# After such output nsbox asks the terminal for its primary device attributes (DA1, ESC [ c),
# which every terminal of the VT100 line answers, and in order with its answers to what it
# was asked before (ctlseqs(ms), "XTerm Control Sequences"): once that answer has come and the
# input has been quiet a moment, every answer to the sandbox's queries has come too, and all
# of it is discarded. The sandbox may ask DA1 itself, so it is the last one that counts: the
# quiet moment covers answers that follow one of the sandbox's own.
DA1_QUERY = b"\x1b[c"
DA1_ANSWER_PATTERN = re.compile(rb"(?:\x1b\[|\x9b)\?[0-9;]*c")
_ANSWERS_WAIT = 1.0  # seconds, at most: a terminal that does not answer DA1 is not waited for
_ANSWERS_QUIET = 0.05  # seconds of no input after the DA1 answer


def is_terminal(fd: int) -> bool:
    """Whether ``fd`` is a terminal (isatty(3)); False for a descriptor that is not open."""
    try:
        return os.isatty(fd)
    except OSError:
        return False


def window_size(fd: int) -> tuple[int, int]:
    """The rows and columns of the terminal ``fd``; DEFAULT_SIZE where it does not say."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return DEFAULT_SIZE
    if size.lines <= 0 or size.columns <= 0:
        return DEFAULT_SIZE
    return min(size.lines, 65535), min(size.columns, 65535)


def set_window_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, (rows | cols << 16).to_bytes(8, "little"))


def settle_after_output(fds: Collection[int]) -> None:
    """After a run whose output went through to ``fds`` with a control in it (nsbox/host/output.py,
    TerminalHold): on each terminal among them the modes a program may leave set are put back,
    and on the controlling terminal, while nsbox has it in the foreground, the terminal's
    answers to the sandbox's queries are waited for and discarded (keys typed meanwhile with
    them), so that none is left for the caller's shell to read as a typed line. The --tty
    relay does the same for its terminal (``Relay``)."""
    if os.environ.get("TERM") == "dumb":
        return  # it obeys no control and answers no query
    shown: dict[int, int] = {}  # one descriptor for each terminal: st_rdev -> fd
    for fd in fds:
        if is_terminal(fd):
            shown.setdefault(os.fstat(fd).st_rdev, fd)
    for fd in shown.values():
        with contextlib.suppress(OSError):
            _wire.write_all(fd, CLOSE_OPEN + TERMINAL_DEFAULTS)
    # An output terminal that is not the controlling one has another reader: not this one's.
    if not any(_is_controlling(fd) for fd in shown.values()):
        return
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        # In the background the shell has the terminal (and a read would stop nsbox, SIGTTIN).
        if os.tcgetpgrp(fd) != os.getpgrp():
            return
        saved = termios.tcgetattr(fd)
        quiet = [*saved[:6], list(saved[6])]
        quiet[3] &= ~(termios.ICANON | termios.ECHO)  # answers readable at once, not shown
        quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 0, 0
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
        try:
            discard_answers(fd, fd)
            termios.tcflush(fd, termios.TCIFLUSH)
        finally:
            termios.tcsetattr(fd, termios.TCSANOW, saved)
    except (OSError, termios.error):
        pass  # the terminal hung up: nothing on it is left for a shell
    finally:
        os.close(fd)


def _is_controlling(fd: int) -> bool:
    """Whether the terminal ``fd`` is this process's controlling terminal: TIOCGSID answers
    only for that one (ioctl_tty(2))."""
    try:
        fcntl.ioctl(fd, TIOCGSID, b"\0" * 4)
    except OSError:
        return False
    return True


def discard_answers(fd_in: int, fd_out: int) -> None:
    """Ask the terminal for DA1 on ``fd_out`` and read ``fd_in`` (raw, or at least not canonical
    and without echo), dropping what comes, until its answer and a quiet moment, at most
    ``_ANSWERS_WAIT``. The caller then discards whatever else reached the input (tcflush(3)),
    as it does anyway. Raises OSError for a terminal that is gone."""
    _wire.write_all(fd_out, DA1_QUERY)
    deadline = time.monotonic() + _ANSWERS_WAIT
    seen, answered = b"", False
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd_in], [], [], min(left, _ANSWERS_QUIET) if answered else left)[0]:
            break
        data = os.read(fd_in, _CHUNK)
        if not data:
            break  # hung up
        seen = (seen + data)[-256:]
        answered = answered or DA1_ANSWER_PATTERN.search(seen) is not None


def _is_pty_master(fd: int) -> bool:
    try:
        fcntl.ioctl(fd, TIOCGPTN, b"\0" * 4)
    except OSError:
        return False
    return True


class Relay:
    """The caller's terminal relayed to the sandbox's pty for one run (see the module's
    docstring). ``sandbox_end`` is the launch's stdin; ``size`` the plan's window size."""

    def __init__(self, fd_in: int = 0, fd_out: int = 1, cap: int | None = None,
                 on_cap: Callable[[], None] | None = None) -> None:
        self.fd_in, self.fd_out = fd_in, fd_out
        # The output limit holds on a terminal too: past ``cap`` bytes nothing more is shown,
        # ``on_cap`` is called (it kills the run) and ``cut`` says so.
        self.cap, self.on_cap, self.cut, self.shown = cap, on_cap, False, 0
        self.size = window_size(fd_in)
        self.master = -1
        self._pending, self._stdin_done = b"", False  # typed, not yet taken by the pty
        self._modes_changed = False  # the sandbox's output may have changed a terminal mode
        self._saved: list[Any] | None = None
        self._previous_winch: Any = None
        self._previous_handlers: dict[int, Any] = {}  # of the signals the relay handles
        self._raw = False  # the caller's terminal is in raw mode for the sandbox's pty
        self._channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sandbox_end = theirs.detach()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="nsbox-tty", daemon=True)
        self._done = threading.Event()

    def __enter__(self) -> Relay:
        try:
            self._saved = termios.tcgetattr(self.fd_in)
            if threading.current_thread() is threading.main_thread():
                self._previous_winch = signal.signal(signal.SIGWINCH, self._on_winch)
                for signum in _ENDING:
                    if signal.getsignal(signum) == signal.SIG_DFL:
                        self._previous_handlers[signum] = signal.signal(signum, self._on_ending)
                if signal.getsignal(signal.SIGTSTP) == signal.SIG_DFL:
                    self._previous_handlers[signal.SIGTSTP] = signal.signal(signal.SIGTSTP,
                                                                            self._on_stop)
            tty.setraw(self.fd_in, termios.TCSANOW)
            self._raw = True
            self._thread.start()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        try:
            # The run is over: its last output is on the way (end-of-file, EIO, ends the
            # copy); past the drain time whatever still holds the pty is not waited for.
            if self.master >= 0:
                self._done.wait(_DRAIN)
            os.write(self._wake_w, b"x")
            self._thread.join(_DRAIN)
        finally:
            self._restore()

    def _restore(self) -> None:
        self._raw = False  # first: a SIGCONT from here on sets no raw mode again (_on_stop)
        # TCSADRAIN: what was written reaches the terminal in the modes it was for.
        self._put_back_modes(termios.TCSADRAIN, settle=not self._thread.is_alive())
        self._saved = None
        if self._previous_winch is not None:
            signal.signal(signal.SIGWINCH, self._previous_winch)
            self._previous_winch = None
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        self._previous_handlers = {}
        for fd in (self.sandbox_end, self._wake_r, self._wake_w):
            _close(fd)
        self.sandbox_end = self._wake_r = self._wake_w = -1
        self._channel.close()
        if not self._thread.is_alive() and self.master >= 0:
            _close(self.master)
            self.master = -1

    def _put_back_modes(self, when: int, settle: bool = False) -> None:
        """The caller's modes back; where the sandbox's output held a control, the terminal's
        own modes too, and with ``settle`` (no thread reads the terminal but this one, and no
        signal waits) its answers to the sandbox's queries are waited for and discarded
        (``discard_answers``), so that a slow one is not left for the caller's shell either."""
        saved = self._saved  # once: the relay's thread, a signal handler and exit may race
        if saved is None:
            return
        if self._modes_changed:
            self._modes_changed = False
            try:
                _wire.write_all(self.fd_out, CLOSE_OPEN + TERMINAL_DEFAULTS)
                if settle:
                    discard_answers(self.fd_in, self.fd_out)  # the tcflush below ends it
            except OSError:
                pass  # the terminal is gone (hung up), or will not take more
        try:
            # What reached the terminal's input since the relay stopped reading is no
            # keystroke for the caller's shell: it may be the terminal's own answer to a
            # query the sandbox wrote last (a title report, ESC [ 21 t; DECRQSS), which the
            # shell would read as a typed command line (tcflush(3)).
            termios.tcflush(self.fd_in, termios.TCIFLUSH)
            termios.tcsetattr(self.fd_in, when, saved)
        except termios.error:
            pass  # the terminal is gone (hung up): nothing to restore

    def _on_ending(self, signum: int, _frame: Any) -> None:
        # TCSANOW: the process ends at once, nothing is left to drain for.
        self._put_back_modes(termios.TCSANOW)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _on_stop(self, signum: int, _frame: Any) -> None:
        # SIGTSTP from elsewhere (`kill -TSTP`; the keys of a raw terminal send none): the
        # caller's shell gets its terminal back in its own modes while nsbox is stopped, and
        # raw mode comes back with SIGCONT, as a full-screen program does it (the sandbox's
        # pty itself is not stopped: its program goes on, its output waits).
        self._put_back_modes(termios.TCSANOW)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # stops here, until SIGCONT
        signal.signal(signum, self._on_stop)
        if self._raw:  # False once the relay ended, or the sandbox dropped its pty
            try:
                tty.setraw(self.fd_in, termios.TCSANOW)
            except termios.error:
                pass  # the terminal is gone
            if self.master >= 0:
                self._copy_size(redraw=True)

    def _on_winch(self, _signum: int, _frame: Any) -> None:
        if self.master >= 0:
            self._copy_size()

    def _copy_size(self, redraw: bool = False) -> None:
        """The caller's window size onto the sandbox's pty. ``redraw`` (nsbox goes on after it
        was stopped): the screen was the caller's shell's meanwhile, so a full-screen program
        must draw it again, which it does on SIGWINCH. The kernel sends that only when the size
        changes (ioctl_tty(2), TIOCSWINSZ), and a pty master can send the foreground group
        SIGINT, SIGQUIT and SIGTSTP alone (TIOCSIG): so the size is set one column narrower
        first, then as it is."""
        try:
            rows, cols = window_size(self.fd_in)
            if redraw and cols > 1:
                set_window_size(self.master, rows, cols - 1)
            set_window_size(self.master, rows, cols)
        except OSError:
            pass  # the pty has gone with the sandbox

    # --- the thread ---------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            if self._receive_master():
                self._copy_size()  # the window may have changed since the plan was made
                if self._copy():
                    # No process of the sandbox holds its pty any more, and the run may go on
                    # (a command that closed it): the caller's terminal is theirs again, so
                    # that Ctrl-C reaches nsbox, which ends the run, and does not wait for
                    # the time limit in raw mode.
                    self._raw = False
                    self._put_back_modes(termios.TCSADRAIN, settle=True)
        except OSError:
            pass  # the caller's terminal is gone: the run goes on to its end without it
        finally:
            self._done.set()

    def _receive_master(self) -> bool:
        """Wait for the master the sandbox child sends (or the run's end); keep it only if
        it is one message of ours with one pty master."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._channel, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            ready = {key.fd for key, _mask in selector.select()}
        if self._channel.fileno() not in ready:
            return False
        # Close-on-exec (not socket.recv_fds, which drops its flags): no process this one
        # starts meanwhile inherits the master. One message, one descriptor, or nothing kept.
        try:
            message, fds = _wire.receive_fds(self._channel, 64, 1)
        except (ValueError, OSError):
            return False
        if message != TAG or not fds or not _is_pty_master(fds[0]):
            if fds:
                os.close(fds[0])
            return False
        os.set_blocking(fds[0], False)
        self.master = fds[0]
        return True

    def _copy(self) -> bool:
        """Caller -> master and master -> caller until the pty has no writer left (EIO: True),
        or the drain time after the run's end has passed (False)."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.fd_in, selectors.EVENT_READ)
            selector.register(self.master, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            ends: float | None = None  # once the run is over: the end of its drain time
            while True:
                timeout = None if ends is None else max(0.0, ends - time.monotonic())
                events = selector.select(timeout)
                # Past the drain time the relay ends, however much is still being written.
                if ends is not None and (not events or timeout == 0.0):
                    return False
                for key, mask in events:
                    if key.fd == self._wake_r:
                        # The run is over: what is typed from now on is for the caller's shell.
                        selector.unregister(self._wake_r)
                        if self.fd_in in selector.get_map():
                            selector.unregister(self.fd_in)
                        self._pending, self._stdin_done = b"", True
                        ends = time.monotonic() + _DRAIN
                        break
                    if key.fd == self.fd_in:
                        self._take_input(selector)
                    elif mask & selectors.EVENT_READ and not self._take_output():
                        return True  # EIO: every process of the sandbox closed the pty
                    if key.fd == self.master and mask & selectors.EVENT_WRITE:
                        self._give_input(selector)
                wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._pending else 0)
                selector.modify(self.master, wanted)

    def _take_input(self, selector: selectors.BaseSelector) -> None:
        data = _read(self.fd_in)
        if not data:  # the caller's stdin ended: the sandbox keeps its pty
            self._stdin_done = True
        self._pending += data or b""
        if not data or len(self._pending) >= _PENDING:
            selector.unregister(self.fd_in)  # full: read on once the sandbox took some

    def _give_input(self, selector: selectors.BaseSelector) -> None:
        self._pending = self._pending[_write_some(self.master, self._pending):]
        if (len(self._pending) < _PENDING and not self._stdin_done
                and self.fd_in not in selector.get_map()):
            selector.register(self.fd_in, selectors.EVENT_READ)

    def _take_output(self) -> bool:
        """Show what the master has; False once it has no writer left (EIO)."""
        data = _read(self.master)
        if data is None:
            return False
        self._show(data)
        return True

    def _show(self, data: bytes) -> None:
        if self.cap is not None and self.shown + len(data) > self.cap:
            data = data[:max(0, self.cap - self.shown)]
            if not self.cut:
                self.cut = True
                if self.on_cap is not None:
                    self.on_cap()
        self.shown += len(data)
        if not self._modes_changed and any(b in data for b in CONTROL_STARTS):
            self._modes_changed = True
        _wire.write_all(self.fd_out, data)


def _read(fd: int) -> bytes | None:
    """What ``fd`` has (b"" at end-of-file or when nothing is there); None for EIO, a pty
    master whose slave no process holds any more."""
    try:
        return os.read(fd, _CHUNK)
    except BlockingIOError:
        return b""
    except OSError as exc:
        if exc.errno == errno.EIO:
            return None
        raise


def _write_some(fd: int, data: bytes) -> int:
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0


def _close(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
