"""Spawners: processes waiting inside a run cgroup made ahead, to clone a sandbox there.

Moving a process into a cgroup by writing its pid to ``cgroup.procs`` takes the kernel's global
``cgroup_threadgroup_rwsem`` for writing, which waits for an RCU grace period unless another
migration happened just before: about 10 ms on this kind of host, more than all the rest of a
launch. A process cloned by a process that is in a cgroup is born there and moves nowhere. On
cgroup v2, clone3(CLONE_INTO_CGROUP) gives that directly (the helper uses it; see
``RunCgroup.clone_fd``); the v1 controllers have nothing like it, hence spawners.

A spawner is a fork of the launch helper. It makes no decision of its own:

1. the helper creates an empty run cgroup (no limits yet) and forks the spawner;
2. the spawner moves itself into that cgroup, off any launch's path, and says "ready";
3. a launch takes a ready spawner: the helper writes the run's limits into its cgroup and tells
   it to clone;
4. the spawner clones the sandbox with CLONE_PARENT, so that the helper is the sandbox's parent
   exactly as if it had cloned it itself (it writes the id maps, holds the sync pipe, reaps it;
   the sandbox's parent-death signal follows the helper), sends back the pid and exits;
5. the sandbox child receives its plan and descriptors from the helper on the spawner's socket,
   which it inherited; the helper waits for the spawner's exit, so that the cgroup holds the
   sandbox alone before it is released.

The spawner itself runs almost no Python: every object it touches is a page copied from the
helper (copy on write), at about 2 us a page, and its whole life is paid once per launch. So the
plan goes to the child, which needs it as objects anyway, not through the spawner.

Protocol (SOCK_SEQPACKET): spawner -> helper ``ready``; helper -> spawner ``clone``; spawner ->
helper ``pid N`` or ``error E MESSAGE``; helper -> sandbox child ``{"plan": {...}, "layout":
{...}}`` with the descriptors. End-of-file means the other side is gone.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from nsbox import cgroups
from nsbox._sys import libc as _libc
from nsbox._sys import wire as _wire
from nsbox._sys.wire import WirePlan
from nsbox.cgroups import naming
from nsbox.helper.launch import NAMESPACES, ChildFds
from nsbox.sandbox import native as _native_core

if TYPE_CHECKING:
    from nsbox.helper.loop import Helper

# What a sandbox child runs once it has its plan and descriptors: the clone strategy's
# ``child`` (nsbox/helper/clone.py), given no descriptor of the helper's to close.
ChildStart = Callable[[WirePlan, ChildFds, tuple[int, ...]], NoReturn]

# Spawners kept ready. Each is a sleeping fork of the helper (its memory shared with it) and one
# empty cgroup per hierarchy; two cover two concurrent launches, the benchmark's case.
READY = 2
# Made 2 ms after a launch's report, like a pool's refill: at once, the fork would compete with
# the report. A spawner costs about 2 ms of CPU (its fork, its pages, its exit); measured with
# and without them, launches back to back reached the same throughput (docs/performance.md).
REFILL_DELAY = 0.002
MAX_FDS = 253  # SCM_MAX_FD


class Spawner:
    """The helper's handle on one spawner process and its cgroup."""

    def __init__(self, pid: int, sock: socket.socket, cgroup: cgroups.RunCgroup) -> None:
        self.pid, self.sock, self.cgroup = pid, sock, cgroup
        self.ready = False
        self.request = cgroups.Request()  # the limits of the run that took it

    def prepare(self, request: cgroups.Request) -> None:
        """Write the run's limits into the spawner's cgroup. The spawner counts as one task
        there until it has exited (``leave``), so the pids limit is one more until then."""
        self.request = request
        pids = None if request.pids is None else request.pids + 1
        self.cgroup.set_limits(cgroups.Request(memory=request.memory, pids=pids,
                                               cpus=request.cpus))

    def clone(self, flat: tuple[bytes, list[int]] | None = None) -> int:
        """Have the spawner clone the sandbox; its pid (a child of the helper). With ``flat``
        (the native core's plan and descriptors), the spawner clones it with the native core."""
        try:
            if flat is None:
                os.write(self.sock.fileno(), b"clone")
            else:
                _wire.send_bytes(self.sock, flat[0], flat[1])  # begins with b"i"
            reply = os.read(self.sock.fileno(), 4096).decode()
        except OSError as exc:
            raise OSError(exc.errno or 0, f"the spawner went away: {exc}") from None
        kind, _, rest = reply.partition(" ")
        if kind == "pid":
            return int(rest)
        if kind == "error":
            raise OSError(int(rest.partition(" ")[0]), error_message(reply.encode()))
        raise OSError(0, "the spawner went away before it cloned the sandbox")

    def send_plan(self, plan: WirePlan, fds: ChildFds) -> None:
        """The plan and the descriptors, to the sandbox child the spawner cloned."""
        layout, fd_list = fds.pack()
        _wire.send(self.sock, {"plan": plan, "layout": layout}, fd_list)  # any size

    def end(self, kill: bool = False) -> None:
        """Wait for the spawner's exit (it exits by itself once it has cloned or failed)."""
        if kill:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.sock.close()
        os.waitpid(self.pid, 0)

    def leave(self, kill: bool = False) -> None:
        """Wait for the spawner's exit; its cgroup is then the run's alone, with the exact pids
        limit and the peak memory counted from now. (v1's pids.peak cannot be reset: a run
        that never forks reports 2, docs/limits.md.)"""
        self.end(kill)
        self.cgroup.set_limits(cgroups.Request(pids=self.request.pids))
        self.cgroup.reset_peak_memory()


class Spawners:
    """The helper's ready spawners, refilled after each launch that took one."""

    def __init__(self, helper: Helper, backend: cgroups.Backend, child: ChildStart) -> None:
        self.helper, self.backend, self.child = helper, backend, child
        self.idle: list[Spawner] = []
        self.broken = ""  # why spawners cannot work here; launches then attach instead
        self.refill_pending = False

    def fill(self) -> None:
        while not self.broken and len(self.idle) < READY:
            try:
                self.idle.append(self.spawn())
            except OSError as exc:
                self.broken = str(exc)

    def refill_later(self) -> None:
        """After a launch's report."""
        if not self.refill_pending:
            self.refill_pending = True
            self.helper.call_later(REFILL_DELAY, self._refill)

    def _refill(self) -> None:
        self.refill_pending = False
        self.fill()

    def take(self) -> Spawner | None:
        """A ready spawner, or None (not ready yet: the launch attaches its child instead)."""
        for spawner in self.idle:
            if spawner.ready:
                self.idle.remove(spawner)
                self.helper.selector.unregister(spawner.sock)
                return spawner
        return None

    def spawn(self) -> Spawner:
        cgroup = self.backend.create(cgroups.Request(), naming.spare_name())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if native_spawners():
                pid = spawn_native(theirs, cgroup)
                if pid == 0:  # a sandbox child for the Python child, cloned by the C spawner
                    become_sandbox(self.child, theirs)
            else:
                # Not os.fork(): its at-fork handlers would touch (and copy) pages for nothing
                # in a process that has no threads and runs almost no Python.
                pid = _libc.raw_clone(signal.SIGCHLD)
        except OSError:
            ours.close()
            theirs.close()
            cgroup.destroy()
            raise
        if pid == 0:
            serve(self.child, theirs, cgroup)
        theirs.close()
        spawner = Spawner(pid, ours, cgroup)
        self.helper.selector.register(ours, selectors.EVENT_READ,
                                      lambda _f: self.on_message(spawner))
        return spawner

    def on_message(self, spawner: Spawner) -> None:
        try:
            data = spawner.sock.recv(4096)
        except OSError:
            data = b""
        if data == b"ready" and not spawner.ready:
            spawner.ready = True
            return
        # It could not move into its cgroup (``error E MESSAGE``), or it died.
        if data:
            self.broken = error_message(data)
        self.idle.remove(spawner)
        self.helper.selector.unregister(spawner.sock)
        self.discard(spawner)

    def discard(self, spawner: Spawner) -> None:
        spawner.end(kill=True)
        try:
            spawner.cgroup.destroy()
        except OSError:
            pass  # left for the next helper to reclaim (nsbox/cgroups)

    def close(self) -> None:
        for spawner in self.idle:
            self.helper.selector.unregister(spawner.sock)
            self.discard(spawner)
        self.idle = []


def native_spawners() -> bool:
    """Spawners as C loops (nsbox/native/spawner.c) where the native core is built and not
    switched off (the helper gets the caller's NSBOX_NATIVE when it starts)."""
    return _native_core.MISSING == "" and not _native_core.disabled_by_caller()


def spawn_native(sock: socket.socket, cgroup: cgroups.RunCgroup) -> int:
    """Start a C spawner for ``cgroup``: its pid (0 in a sandbox child, see Spawners.spawn)."""
    procs = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in cgroup.procs_files()]
    pid = -1
    try:
        pid = _native_core.start_spawner(
            sock.fileno(), procs, NAMESPACES | _libc.CLONE_PARENT | signal.SIGCHLD,
            naming.SPAWNER_NAME)
    finally:
        if pid != 0:  # a sandbox child has none of them: the spawner kept only its socket
            for fd in procs:
                os.close(fd)
    return pid


def error_message(reply: bytes) -> str:
    """The MESSAGE of a spawner's ``error E MESSAGE``."""
    kind, _, rest = reply.decode(errors="replace").partition(" ")
    message = rest.partition(" ")[2] if kind == "error" else ""
    return message or f"the spawner failed: {reply[:200]!r}"


def serve(child: ChildStart, sock: socket.socket, cgroup: cgroups.RunCgroup) -> NoReturn:
    """The spawner process: move into the cgroup, wait for the word, clone, report, exit.

    Plain os calls only, for the reason in the module's docstring.
    """
    fd = sock.fileno()
    try:
        # Only its own socket (and /dev/null as 0-2): the descriptors of other launches (their
        # pipes and sockets) must not be held here, nor reach a sandbox cloned from here.
        _libc.close_range(3, fd - 1)
        _libc.close_range(fd + 1)
        _libc.prctl(_libc.PR_SET_PDEATHSIG, signal.SIGKILL)
        comm = os.open("/proc/self/comm", os.O_RDWR)
        helper_name = os.read(comm, 64).rstrip(b"\n")
        os.write(comm, naming.SPAWNER_NAME.encode())  # ps shows it; tools tell idle spares by it
        cgroup.attach(os.getpid())
        os.write(fd, b"ready")
        word, fds = _wire.receive(sock, MAX_FDS)
        if word.startswith(b"i"):
            # The native core: its flat plan (nsbox/sandbox/native.py) came first; the child
            # runs it in C.
            pid = _native_core.spawn(word, fds, (fd, comm),
                                     NAMESPACES | _libc.CLONE_PARENT | signal.SIGCHLD, -1)
            os.write(fd, f"pid {pid}".encode())
        elif word == b"clone":
            pid = _libc.raw_clone(NAMESPACES | _libc.CLONE_PARENT | signal.SIGCHLD)
            if pid == 0:
                os.close(comm)  # the spawner's own
                comm = os.open("/proc/self/comm", os.O_WRONLY)
                os.write(comm, helper_name)  # a sandbox is no spawner, also before its exec
                os.close(comm)
                become_sandbox(child, sock)
            os.write(fd, f"pid {pid}".encode())
    except (OSError, ValueError) as exc:  # ValueError: a flat plan the native core refused
        try:
            os.write(fd, f"error {getattr(exc, 'errno', 0) or 0} {exc}".encode())
        except OSError:
            pass
    os._exit(0)


def become_sandbox(child_start: ChildStart, sock: socket.socket) -> NoReturn:
    """In the sandbox child: receive the plan and the descriptors, then go on as any child."""
    try:
        message, fds = _wire.receive(sock, MAX_FDS)
        sock.close()
        if message:
            request = json.loads(message)
            plan = request["plan"]
            child = ChildFds.unpack(request["layout"], fds)
            if plan.get("session"):
                import nsbox.sandbox.sessioninit  # noqa: F401  (see start.import_session_init)
            child_start(plan, child, ())
    finally:
        os._exit(127)  # no plan: the helper gave up on this launch
