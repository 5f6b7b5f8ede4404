"""One launch as the helper holds it, from clone to reap: its state (``Launch``), the
namespaces every sandbox gets, the descriptors its child starts with (``ChildFds``), and how a
failure of the helper's side is told to the host.

Shared by the event loop (nsbox/helper/loop.py), the pool (pool.py) and the spawners
(spawner.py), which all hold launches; none of them imports the others for these.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nsbox._sys import libc as _libc
from nsbox._sys.wire import ExitReport, SetupErrorInfo
from nsbox.errors import HostError

if TYPE_CHECKING:
    from nsbox.helper import pool as _helper_pool
    from nsbox.helper import spawner as _spawner
    from nsbox.helper.seccomp_notify import DeniedSyscalls
    from nsbox.policy import identity as _identity
    from nsbox.policy import limits as _limits

NAMESPACES = (
    _libc.CLONE_NEWUSER | _libc.CLONE_NEWNS | _libc.CLONE_NEWPID | _libc.CLONE_NEWNET
    | _libc.CLONE_NEWIPC | _libc.CLONE_NEWUTS | _libc.CLONE_NEWCGROUP
)


class StepFailed(Exception):
    """A host-side step of the launch failed before the sandbox existed."""

    def __init__(self, step: str, errno: int, message: str) -> None:
        super().__init__(message)
        self.step, self.errno, self.message = step, errno, message


class ChildFds:
    """The descriptors a sandbox child starts with: its standard streams, its ends of the sync
    and error pipes, the bind sources opened by the helper (mount index -> descriptor), and
    learning mode's and network allow mode's sockets (-1 and None when not used)."""

    def __init__(self, stdio: list[int], sync_r: int, err_w: int, sources: dict[int, int],
                 notify: int, net: int | None) -> None:
        self.stdio, self.sync_r, self.err_w = stdio, sync_r, err_w
        self.sources, self.notify, self.net = sources, notify, net

    def pack(self) -> tuple[dict[str, Any], list[int]]:
        extra = ([self.notify] if self.notify >= 0 else []) + (
            [self.net] if self.net is not None else [])
        layout = {"notify": self.notify >= 0, "net": self.net is not None,
                  "sources": list(self.sources)}
        return layout, [*self.stdio, self.sync_r, self.err_w, *extra, *self.sources.values()]

    @classmethod
    def unpack(cls, layout: dict[str, Any], fds: list[int]) -> ChildFds:
        rest = fds[5:]
        notify = rest.pop(0) if layout["notify"] else -1
        net = rest.pop(0) if layout["net"] else None
        sources = dict(zip(layout["sources"], rest, strict=True))
        return cls(fds[:3], fds[3], fds[4], sources, notify, net)


class Launch:
    """One sandbox, from clone to reap."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock
        self.pid = 0
        self.pidfd = -1
        self.err_fd = -1
        self.sync_fd = -1
        self.err_data = b""
        self.started = 0.0
        self.deadline: float | None = None
        self.timed_out = False
        self.kill_reason: str | None = None
        self.notify_sock: socket.socket | None = None  # learning mode: the listener comes here
        self.denied: DeniedSyscalls | None = None
        self.notify_table: dict[str, Any] | None = None
        self.net_sock: socket.socket | None = None  # allow mode, until the listener is passed
        self.limits: _limits.RunLimits | None = None  # the run's cgroup and rlimits
        self.pool: _helper_pool.HelperPool | None = None  # set for a pooled sandbox
        self.trace: list[tuple[str, int]] | None = None  # NSBOX_TRACE: helper-side steps
        self.mnt_ns = -1  # held until the report is out (hold_namespace)
        self.spawner: _spawner.Spawner | None = None  # the clone's spawner (helper/spawner.py)
        self.reaped = False
        self.pins: list[_identity.Pin] = []  # writable binds' directories (helper/sources.py)
        # Set by the clone (nsbox/helper/clone.py): the child was born in the run's cgroup
        # (clone3 into it, or a spawner's), so nothing is attached afterwards.
        self.born_in_cgroup = False
        self.internal_error: SetupErrorInfo | None = None  # Launch.fail
        self.core = "python"  # or "native": which ran the sandbox child (nsbox/sandbox/native.py)
        # What ends the sandbox: SIGKILL of its pid 1 ends its pid namespace; a Landlock
        # sandbox's init ends its processes on its own signal (nsbox/helper/landlocked.py).
        self.kill_signal: int = signal.SIGKILL
        self.landlock_dirs: str | None = None  # its workspace and temporary directory's
        # The one owner of what the launch opened (pipes, descriptors, cgroup, spawner, the
        # child itself until reaped): closed at the reap, or when the launch fails before.
        self.cleanup = contextlib.ExitStack()

    def mark(self, step: str) -> None:
        """NSBOX_TRACE: the helper-side ``step`` starts now."""
        if self.trace is not None:
            self.trace.append((step, time.monotonic_ns()))

    def send(self, message: Mapping[str, Any]) -> None:
        if self.sock is None:
            return  # a pooled sandbox that has no command (and no caller) yet
        try:
            self.sock.send(json.dumps(message).encode())
        except OSError:
            pass  # the caller went away; the sandbox is killed all the same

    def send_fd(self, message: dict[str, Any], fd: int) -> None:
        if self.sock is None:
            return
        try:
            socket.send_fds(self.sock, [json.dumps(message).encode()], [fd])
        except OSError:
            pass

    def kill(self, reason: str) -> None:
        if self.pid and self.kill_reason is None and not self.reaped:
            self.kill_reason = reason
            # SIGKILL to the pid namespace's init kills every process in it (pid_namespaces(7)).
            try:
                os.kill(self.pid, self.kill_signal)
            except ProcessLookupError:
                pass

    def fail(self, step: str, exc: BaseException) -> None:
        """A helper-side failure of this launch after its clone: the sandbox is killed and its
        report carries this error (the first one) instead of an exit status."""
        if self.internal_error is None:
            self.internal_error = failure_info(step, exc)
        self.kill("setup failed")


def failure_info(step: str, exc: BaseException) -> SetupErrorInfo:
    """``{step, errno, message}`` for any exception, as the launch's SetupError."""
    if isinstance(exc, StepFailed):
        return {"step": exc.step, "errno": exc.errno, "message": exc.message}
    if isinstance(exc, OSError):
        return {"step": step, "errno": exc.errno or 0, "message": exc.strerror or str(exc)}
    text = f"{type(exc).__name__}: {exc}"
    return {"step": step, "errno": 0,
            "message": "the launch helper could not carry out this launch: " + text[:300]}


def failure_report(exc: BaseException) -> ExitReport:
    """The exit report of a launch that failed before its sandbox existed."""
    if isinstance(exc, HostError):
        return {"event": "exit", "host_error": {
            "feature": exc.feature, "message": str(exc.args[0]), "hint": exc.hint}}
    return {"event": "exit", "setup_error": failure_info("helper", exc)}
