"""A process this host process starts once and talks to over one socket: the Python launch
helper (nsbox/launch/launcher.py) and the launch engine (nsbox/host/engine.py). What each
starts and sends is its own; how it is forgotten in a fork, found alive and ended is this, and
the cgroup v2 setup that a run of either needs from this host process first."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from nsbox import cgroups
from nsbox.policy import limits


class LaunchProcess:
    _every: list[LaunchProcess] = []  # of this host process: the helper's and the engine's

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.pid = 0
        os.register_at_fork(after_in_child=self._forget)
        LaunchProcess._every.append(self)

    @classmethod
    def started(cls) -> set[int]:
        """The pids of this host process's live launch processes: what it may move into a
        cgroup leaf along with itself (nsbox/cgroups/_v2.py, prepare). Each is asked whether it
        is still its live child (waitpid), so a pid the kernel may have given another process
        since (it died, it was reaped) is never named."""
        pids = set()
        for process in cls._every:
            with process._lock:
                if process._alive():
                    pids.add(process.pid)
        return pids

    def _forget(self) -> None:
        # A forked child must not share its parent's process: it would keep it alive.
        if self._sock is not None:
            self._sock.close()
        self._sock, self.pid = None, 0
        self._lock = threading.Lock()

    def _start(self) -> socket.socket:
        raise NotImplementedError  # each process starts its own way

    def _running(self) -> socket.socket:
        """The socket of a live process, started anew if there is none or it died; called with
        the lock held. A failed start leaves no socket behind (the next call starts again)."""
        if self._sock is None or not self._alive():
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._sock = self._start()
        return self._sock

    def _alive(self) -> bool:
        if not self.pid:
            return False
        try:
            pid, _status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return pid == 0

    def stop(self) -> None:
        """End the process and reap it: every sandbox it still runs is killed first (it reads
        end-of-file on its socket)."""
        with self._lock:
            sock, pid = self._sock, self.pid
            self._sock, self.pid = None, 0
        if sock is not None:
            sock.close()
        if pid:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def enable_cgroups(spec: dict[str, Any]) -> str:
    """Before a run whose limits want a cgroup (``spec``: its plan's "cgroup"), on cgroup v2:
    enable the controllers below this process's cgroup, moving this process and its live launch
    processes into a leaf where the no-internal-processes rule requires it (nsbox/cgroups/_v2.py,
    prepare). The host does it before the engine's runs and the helper's alike: the helper,
    which would move only itself and this process, would meet the engine in that cgroup as a
    stranger and limit nothing. Returns why it cannot ("": done, or nothing to do)."""
    wanted = limits.wanted_features(spec)
    if not wanted:
        return ""
    backend = cgroups.get_backend()
    if not cgroups.is_unified(backend) or not wanted & backend.supports():
        return ""
    try:
        backend.prepare(ours=lambda: {os.getpid(), *LaunchProcess.started()})
    except OSError as exc:  # another process in this cgroup: nothing can be limited
        return str(exc)
    return ""
