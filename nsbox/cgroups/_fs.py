"""Small file helpers shared by the backends: cgroupfs is read and written as text files."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time

from nsbox.cgroups._host import THIS_HOST, HostView


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def read_int(path: str) -> int | None:
    """An integer file; None when it is missing or says ``max``."""
    try:
        text = read(path)
    except FileNotFoundError:
        return None
    return None if text == "max" else int(text)


def read_keyed(path: str) -> dict[str, int]:
    """A flat keyed file (``key value`` per line: cpu.stat, memory.events, ...)."""
    try:
        text = read(path)
    except FileNotFoundError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def write(path: str, value: object) -> None:
    """Write one value; the kernel's error (EINVAL, EBUSY, ...) comes back as OSError naming the
    file and the value."""
    try:
        # Plain os calls: a spawner (nsbox/helper/spawner.py) attaches itself with this, and every
        # Python object it touches is a page copied from the helper.
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)
    except OSError as exc:
        reason = os.strerror(exc.errno or 0)
        raise OSError(exc.errno, f"write {value!r} to {path}: {reason}") from None


def read_only(path: str) -> bool:
    """Whether ``path`` lies on a read-only mount (a container's cgroupfs; statvfs(3) ST_RDONLY):
    then no uid may write it, whatever the modes say."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def procs(directory: str) -> list[int]:
    try:
        text = read(os.path.join(directory, "cgroup.procs"))
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_until(condition, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``condition`` with a short backoff: processes leave a cgroup only once the kernel has
    finished killing them, a few milliseconds after SIGKILL."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def rmdir(directory: str) -> None:
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise OSError(exc.errno, f"rmdir {directory}: {os.strerror(exc.errno or 0)}") from None


def writable(directory: str, view: HostView = THIS_HOST) -> bool:
    """Can this process (or the uid of a simulated ``view``) create children here and move
    processes in? (cgroups(7), "Cgroups delegation": the directory and its cgroup.procs must be
    writable.)"""
    return view.can_write(directory) and view.can_write(os.path.join(directory, "cgroup.procs"))
