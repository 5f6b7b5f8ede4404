"""A real, quick try of what a launch needs, run by ``nsbox doctor`` in a child process.

The child creates the namespaces, mounts a tmpfs root with a fresh /proc, pivots into it and
loads a seccomp filter that allows everything, then prints one JSON line: the steps it took and
the first that failed. Nothing outside the child's own namespaces changes; the process exits at
the end. Run as ``python3 -I -S -c "..."`` (see hostfacts.run_probe).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable
from typing import Any

from nsbox._sys import libc as _libc

NAMESPACES = (_libc.CLONE_NEWNS | _libc.CLONE_NEWPID | _libc.CLONE_NEWNET | _libc.CLONE_NEWIPC
              | _libc.CLONE_NEWUTS | _libc.CLONE_NEWCGROUP)
# One BPF instruction: return SECCOMP_RET_ALLOW (seccomp(2)).
ALLOW_ALL = struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _maps(uid: int, gid: int) -> None:
    # user_namespaces(7): an unprivileged process must deny setgroups before writing gid_map.
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")


def _mount_root() -> None:
    # Mounting over /tmp is seen only in this new mount namespace.
    _libc.mount("tmpfs", "/tmp", "tmpfs", _libc.MS_NOSUID | _libc.MS_NODEV, "size=1m,mode=0755")
    os.mkdir("/tmp/proc")
    os.mkdir("/tmp/old")


def _pivot() -> None:
    _libc.pivot_root("/tmp", "/tmp/old")
    os.chdir("/")


def _seccomp() -> None:
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    _libc.seccomp_set_filter(ALLOW_ALL)


def run_steps(steps: list[tuple[str, Callable[[], object]]], done: list[str]) -> dict[str, object]:
    """Run the steps in order until one fails; ``done`` collects the names of those that ran."""
    for name, action in steps:
        try:
            action()
        except OSError as exc:
            return {"done": done, "failed": name, "errno": exc.errno or 0, "error": str(exc)}
        done.append(name)
    return {"done": done, "failed": None}


def main() -> int:
    uid, gid = os.geteuid(), os.getegid()
    done: list[str] = []
    first = run_steps([
        ("user namespace", lambda: _libc.unshare(_libc.CLONE_NEWUSER)),
        ("uid/gid maps", lambda: _maps(uid, gid)),
        ("mount, pid, net, ipc, uts and cgroup namespaces", lambda: _libc.unshare(NAMESPACES)),
    ], done)
    if first["failed"]:
        print(json.dumps(first), flush=True)
        return 0
    read, write = os.pipe()
    pid = os.fork()  # the first child in the new PID namespace: its pid 1
    if pid == 0:
        os.close(read)
        inner = run_steps([
            ("private mounts", lambda: _libc.mount(None, "/", None,
                                                   _libc.MS_REC | _libc.MS_PRIVATE)),
            ("tmpfs root", _mount_root),
            ("mount /proc", lambda: _libc.mount("proc", "/tmp/proc", "proc", _libc.MS_NOSUID
                                                | _libc.MS_NODEV | _libc.MS_NOEXEC)),
            ("pivot_root", _pivot),
            ("detach the old root", lambda: _libc.umount2("/old", _libc.MNT_DETACH)),
            ("seccomp filter", _seccomp),
        ], [])
        os.write(write, json.dumps(inner).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    result: dict[str, Any] = json.loads(data) if data else {
        "done": [], "failed": "fork", "errno": 0, "error": "the child died"}
    result["done"] = done + result["done"]
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
