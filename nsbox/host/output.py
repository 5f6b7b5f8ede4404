"""The host's side of one run's output and control socket: the output copied under its cap,
the helper's messages followed until its report, the host's own kill past the deadline.

Used by ``nsbox.run`` and pools (nsbox/launch/launcher.py) and by sessions
(nsbox/session/session.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nsbox._sys import wire as _wire
from nsbox.errors import LaunchError
from nsbox.host.network import RunNetwork
from nsbox.host.terminal import CONTROL_STARTS

_READ_CHUNK = 65536


def out_of_descriptors(what: str, exc: OSError) -> LaunchError:
    """A LaunchError for a failed open or send; with a hint when descriptors ran out."""
    error = LaunchError(f"{what}: {exc.strerror or exc}")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        error.hint = ("this process has too many open descriptors (ulimit -n): close some, "
                      "raise the limit, or run fewer sandboxes at once")
    return error


@dataclass
class Stream:
    fd: int
    sink: int | None  # pass through to this fd as it arrives (CLI); None: keep in memory
    kept: bytearray = field(default_factory=bytearray)
    total: int = 0
    truncated: bool = False
    head_limit: int = 0  # with a sink: also keep this many first bytes (the audit record)


# After the deadline the helper kills the sandbox; should the helper not get to run then
# (stopped, starved of CPU), this process kills it this much later, by the pidfd the helper
# sent with the pid (pidfd_send_signal(2): no pid-reuse race).
HOST_GRACE = 0.3


def supervise(sock: socket.socket, streams: list[Stream], cap: int, net: RunNetwork,
               wall_time: float | None = None) -> tuple[dict[str, Any], int]:
    """Copy the run's output under the cap and follow the helper's messages until its report;
    returns the report and the sandbox's host pid."""
    try:
        selector = selectors.DefaultSelector()
    except OSError as exc:  # epoll_create1: EMFILE
        for each in streams:
            os.close(each.fd)
        raise out_of_descriptors("cannot watch the run", exc) from None
    for each in streams:
        selector.register(each.fd, selectors.EVENT_READ, each)
    selector.register(sock, selectors.EVENT_READ, None)
    watch = _Watch(sock, selector, cap, net, wall_time)
    try:
        while selector.get_map() and watch.wait():
            pass
    finally:
        selector.close()
        for stream in streams:
            os.close(stream.fd)
        if watch.pidfd >= 0:
            os.close(watch.pidfd)
    report = watch.report
    if report is None:
        raise LaunchError("the launch helper ended the run without a report")
    status = report.get("wait_status")
    if watch.host_killed and isinstance(status, int) and os.WIFSIGNALED(status) and (
            os.WTERMSIG(status) == signal.SIGKILL):
        report["timed_out"] = True  # the SIGKILL was this process's, at the deadline
    return report, watch.pid


@dataclass
class _Watch:
    """What the supervision of one run has seen so far (see supervise)."""

    sock: socket.socket
    selector: selectors.BaseSelector
    cap: int
    net: RunNetwork
    wall_time: float | None
    report: dict[str, Any] | None = None
    pid: int = 0
    pidfd: int = -1
    kill_signal: int = signal.SIGKILL  # a Landlock sandbox's init ends its tree on its own
    host_deadline: float | None = None
    host_killed: bool = False
    kept: int = 0
    drain_until: float | None = None

    def wait(self) -> bool:
        """One wait and what came of it; False once the run is over and its output drained."""
        until = self.drain_until if self.drain_until is not None else self.host_deadline
        # At most an hour per wait: epoll_wait(2) takes an int of milliseconds.
        timeout = None if until is None else min(max(0.0, until - time.monotonic()), 3600.0)
        events = self.selector.select(timeout)
        if not events and self.drain_until is not None:
            return False  # the sandbox is gone; whoever still holds a pipe is not ours to wait for
        if (self.host_deadline is not None and self.report is None
                and time.monotonic() >= self.host_deadline):
            self.host_killed = _kill_by_pidfd(self.pidfd, self.kill_signal)
            self.host_deadline = None
        for key, _mask in events:
            if key.data is None:
                self.on_helper()
            else:
                self.on_output(key.data)
        return True

    def on_helper(self) -> None:
        try:
            data, fds = _wire.receive_fds(self.sock, 65536, 1)
        except ConnectionResetError:
            # The peer closed with our "kill" unread. The kernel reports that before the
            # messages still queued (the report among them): read on.
            return
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # Its descriptor (the sandbox's pidfd) was lost: the run ends here, said so.
            raise out_of_descriptors("cannot receive the helper's message", exc) from None
        if not data:
            self.selector.unregister(self.sock)
            if self.report is None and self.pid == 0:
                # It never started the sandbox: the request was lost on the way in (the helper
                # out of descriptors), or the helper died.
                raise LaunchError("the launch helper could not take the request "
                                  "(out of descriptors, or it died)")
            if self.report is None:
                raise LaunchError("the launch helper died during the run")
            return
        self.on_message(json.loads(data), fds)

    def on_message(self, message: dict[str, Any], fds: list[int]) -> None:
        if message["event"] == "proxy":
            self.net.serve(fds)
            return
        if message["event"] == "pid" and fds and self.pidfd < 0:
            self.pidfd = fds.pop()
            self.kill_signal = int(message.get("kill_signal", signal.SIGKILL))
            if isinstance(self.wall_time, (int, float)):
                self.host_deadline = time.monotonic() + self.wall_time + HOST_GRACE
        for fd in fds:
            os.close(fd)
        if message["event"] == "pid":
            self.pid = message["pid"]
        elif message["event"] == "exit":
            self.report = message
            self.host_deadline = None
            self.drain_until = time.monotonic() + 2.0

    def on_output(self, stream: Stream) -> None:
        chunk = os.read(stream.fd, _READ_CHUNK)
        if not chunk:
            self.selector.unregister(stream.fd)
            return
        stream.total += len(chunk)
        room = max(0, self.cap - self.kept)
        if len(chunk) > room:
            chunk = chunk[:room]
            if not stream.truncated:
                stream.truncated = True
                send_kill(self.sock, "output")
        self.kept += len(chunk)
        if stream.sink is not None:
            TERMINAL_HOLD.write(stream.sink, chunk)
            if len(stream.kept) < stream.head_limit:
                stream.kept += chunk[:stream.head_limit - len(stream.kept)]
        else:
            stream.kept += chunk


class TerminalHold:
    """Output passed through (the CLI's stdout and stderr), held while nsbox asks a person on
    the terminal (``nsbox run --ask``, nsbox/cli/oneshot.py) and sent on after the answer.

    The sandbox's output goes raw to the terminal the question is drawn on; let through while
    the question waits, it could redraw the question to name another host (CR, erase-line)
    and the answer would go to the host asked for, not the one shown. Held, it cannot: what
    the person answers is nsbox's question alone. One for the process, as its terminal is;
    what it holds is what ``on_output`` let through, so no more than the run's output cap.
    Questions come one at a time (the proxy's ask lock), so hold and release do not nest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[int, bytes]] | None = None  # None: not holding
        # The descriptors that were passed a control (ESC, a C1 control, ENQ, ...): where a
        # terminal may have been set or asked something (nsbox/host/terminal.py,
        # settle_after_output, once the run has ended).
        self._controlled: set[int] = set()

    def write(self, fd: int, chunk: bytes) -> None:
        with self._lock:  # taken while writing too: a hold begins after the write in progress
            if fd not in self._controlled and any(b in chunk for b in CONTROL_STARTS):
                self._controlled.add(fd)
            if self._held is not None:
                self._held.append((fd, chunk))
            else:
                _pass_on(fd, chunk)

    def take_controlled(self, fds: Iterable[int]) -> list[int]:
        """Which of ``fds`` were passed a control since the last call that named them."""
        with self._lock:
            found = [fd for fd in fds if fd in self._controlled]
            self._controlled.difference_update(found)
            return found

    def hold(self) -> None:
        with self._lock:
            if self._held is None:
                self._held = []

    def release(self) -> None:
        """Send on what was held, in order, and pass output through again."""
        with self._lock:
            held, self._held = self._held or [], None
            for fd, chunk in held:
                _pass_on(fd, chunk)


def _pass_on(fd: int, chunk: bytes) -> None:
    with contextlib.suppress(BrokenPipeError):
        # The reader of passthrough went away: the run goes on, capped as before.
        _wire.write_all(fd, chunk)


TERMINAL_HOLD = TerminalHold()


def _kill_by_pidfd(pidfd: int, signum: int = signal.SIGKILL) -> bool:
    """SIGKILL to the sandbox's pid 1 (its whole pid namespace dies with it); to a Landlock
    sandbox's init, the signal on which it ends every process of the sandbox."""
    if pidfd < 0:
        return False
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        return False  # it has ended already
    except OSError:
        return False  # not ours to signal: the helper's own deadline stays the guard
    return True


class Cancel:
    """Kills one run from another thread (the asyncio API's cancellation). The run attaches
    its launch socket once its request is sent; a kill asked for before that is sent then.
    The helper kills the sandbox, and the run still ends as usual: its cgroup removed, its
    report read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.cancelled = False

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.cancelled:
                send_kill(sock, "cancelled")

    def detach(self) -> None:
        with self._lock:
            self._sock = None

    def __call__(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._sock is not None:
                send_kill(self._sock, "cancelled")


def send_kill(sock: socket.socket, reason: str) -> None:
    try:
        sock.send(json.dumps({"cmd": "kill", "reason": reason}).encode())
    except OSError:
        pass
