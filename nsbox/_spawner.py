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
3. a launch takes a ready spawner: the helper writes the run's limits into its cgroup and sends
   it the plan and the child's descriptors (SCM_RIGHTS);
4. the spawner clones the sandbox with CLONE_PARENT, so that the helper is the sandbox's parent
   exactly as if it had cloned it itself (it writes the id maps, holds the sync pipe, reaps it;
   the sandbox's parent-death signal follows the helper), sends back the pid and exits;
5. the helper waits for that exit, so the cgroup holds the sandbox alone before it is released.

Protocol (SOCK_SEQPACKET): spawner -> helper ``ready``; helper -> spawner
``{"plan": {...}, "layout": {...}}`` with the descriptors; spawner -> helper ``{"pid": N}`` or
``{"errno": E, "message": M}``. End-of-file either way means the other side is gone.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
from typing import TYPE_CHECKING, Any, NoReturn

from nsbox import _child, _libc, cgroups
from nsbox.cgroups import _names

if TYPE_CHECKING:
    from nsbox._helper import Helper

# Spawners kept ready. Each is a sleeping fork of the helper (its memory shared with it) and one
# empty cgroup per hierarchy; two cover two concurrent launches, the benchmark's case.
READY = 2
MAX_MESSAGE = 4 * 1024 * 1024
MAX_FDS = 253  # SCM_MAX_FD


class ChildFds:
    """The descriptors a sandbox child starts with (see ``Helper.become_child``)."""

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


class Spawner:
    """The helper's handle on one spawner process and its cgroup."""

    def __init__(self, pid: int, sock: socket.socket, cgroup: cgroups.RunCgroup) -> None:
        self.pid, self.sock, self.cgroup = pid, sock, cgroup
        self.ready = False

    def clone(self, plan: dict[str, Any], fds: ChildFds) -> int:
        """Have the spawner clone the sandbox; its pid (a child of the helper)."""
        layout, fd_list = fds.pack()
        message = json.dumps({"plan": plan, "layout": layout}).encode()
        try:
            socket.send_fds(self.sock, [message], fd_list)
            reply = self.sock.recv(4096)
        except OSError as exc:
            raise OSError(exc.errno or 0, f"the spawner went away: {exc}") from None
        if not reply:
            raise OSError(0, "the spawner went away before it cloned the sandbox")
        answer = json.loads(reply)
        if "pid" not in answer:
            raise OSError(answer["errno"], answer["message"])
        return int(answer["pid"])

    def end(self, kill: bool = False) -> None:
        """Wait for the spawner's exit (it exits by itself once it has cloned or failed)."""
        if kill:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.sock.close()
        os.waitpid(self.pid, 0)


class Spawners:
    """The helper's ready spawners, refilled after each launch that took one."""

    def __init__(self, helper: Helper, backend: cgroups.Backend) -> None:
        self.helper, self.backend = helper, backend
        self.idle: list[Spawner] = []
        self.broken = ""  # why spawners cannot work here; launches then attach instead

    @classmethod
    def for_host(cls, helper: Helper) -> Spawners | None:
        """Spawners where the run cgroups are v1 ones; None where they are not needed (cgroup
        v2 clones into the cgroup) or there is no cgroup to make."""
        backend = cgroups.get_backend()
        return cls(helper, backend) if backend.kind == "v1" else None

    def fill(self) -> None:
        while not self.broken and len(self.idle) < READY:
            try:
                self.idle.append(self.spawn())
            except OSError as exc:
                self.broken = str(exc)

    def take(self) -> Spawner | None:
        """A ready spawner, or None (not ready yet: the launch attaches its child instead)."""
        for spawner in self.idle:
            if spawner.ready:
                self.idle.remove(spawner)
                self.helper.selector.unregister(spawner.sock)
                # A spawner is made after the report of the launch that took the last one,
                # like a pool's refill: at the hand-over it would compete with that launch.
                return spawner
        return None

    def spawn(self) -> Spawner:
        cgroup = self.backend.create(cgroups.Request(), _names.spare_name())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            cgroup.destroy()
            raise
        if pid == 0:
            serve(self.helper, theirs, cgroup)
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
        # It could not move into its cgroup (the reason is the message), or it died.
        if data:
            self.broken = json.loads(data).get("message", "the spawner failed")
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


def with_spawner(request: cgroups.Request) -> cgroups.Request:
    """The limits to write while the spawner is still in the cgroup: it counts as one task
    until it has exited (``Spawner.end``), then the exact pids limit is written."""
    if request.pids is None:
        return request
    return cgroups.Request(memory=request.memory, pids=request.pids + 1, cpus=request.cpus)


def set_name(name: str) -> None:
    with open("/proc/self/comm", "w") as f:
        f.write(name)


def serve(helper: Helper, sock: socket.socket, cgroup: cgroups.RunCgroup) -> NoReturn:
    """The spawner process: move into the cgroup, wait for one plan, clone, report, exit."""
    try:
        # Only its own socket: the descriptors of other launches (their pipes and sockets)
        # must not be held here, nor reach a sandbox cloned from here.
        _child.keep_only({sock.fileno()})
        _libc.prctl(_libc.PR_SET_PDEATHSIG, signal.SIGKILL)
        with open("/proc/self/comm") as f:
            helper_name = f.read().rstrip("\n")
        set_name(_names.SPAWNER_NAME)  # ps shows it; tools tell idle spares by it
        cgroup.attach(os.getpid())
        sock.send(b"ready")
        message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS,
                                                         socket.MSG_CMSG_CLOEXEC)
        if message:
            request = json.loads(message)
            plan = request["plan"]
            child = ChildFds.unpack(request["layout"], fds)
            if plan.get("session"):
                import nsbox._sessioninit  # noqa: F401  (see Helper.start)
            from nsbox._helper import NAMESPACES

            pid = _libc.raw_clone(NAMESPACES | _libc.CLONE_PARENT | signal.SIGCHLD)
            if pid == 0:
                sock.close()
                set_name(helper_name)  # a sandbox is no spawner, also before its exec
                helper.become_child(plan, child.stdio, child.sync_r, child.err_w,
                                    child.sources, (), child.notify, child.net)
            sock.send(json.dumps({"pid": pid}).encode())
    except OSError as exc:
        try:
            sock.send(json.dumps({"errno": exc.errno or 0, "message": str(exc)}).encode())
        except OSError:
            pass
    finally:
        os._exit(0)
