"""A directory reached one component at a time, never through a symlink.

Used where a tree that a sandbox can write is read or written by path: a project workspace on
the host side (nsbox/host/project.py), the files a session copies out (nsbox/session/files.py)
and a session's file operations inside the sandbox (nsbox/sandbox/fileworker.py). Each
component is opened with O_NOFOLLOW relative to the one before (openat(2)), so a symlink
planted anywhere on the way fails with ELOOP instead of being followed out of the tree, and a
file in the way with ENOTDIR; the OSError's filename is the component that failed. ``walk`` is
the loop itself, which the Python child's mount targets (nsbox/sandbox/mounts.py) and a bind
source without openat2 (nsbox/_sys/libc.py) take too. ``replace_file`` is the one way the host
writes a file a sandbox made: a new inode, renamed over the name.
Imported by every side: nothing here may import more than the standard library.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable, Iterable

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def walk(start: int, parts: Iterable[str], open_next: Callable[[int, int, str], int], *,
         close_start: bool = False) -> int:
    """The descriptor of the last of ``parts``, each opened by ``open_next(fd, index, name)``
    relative to the one before, from ``start``: the one loop of every no-symlink walk (this
    module's, the Python child's mount targets in nsbox/sandbox/mounts.py, a bind source's in
    nsbox/_sys/libc.py). ``open_next`` opens one component (with O_NOFOLLOW and its own flags, made
    first if the caller makes what is missing) or raises. Each descriptor on the way is closed,
    also on failure; ``start`` only with ``close_start``. No parts: ``start`` itself."""
    fd = start
    try:
        for index, name in enumerate(parts):
            next_fd = open_next(fd, index, name)
            if fd != start or close_start:
                os.close(fd)
            fd = next_fd
    except BaseException:
        if fd != start or close_start:
            os.close(fd)
        raise
    return fd


def open_dir_beneath(root: str, parts: Iterable[str], *, create: bool = False) -> int:
    """A descriptor of the directory ``root/parts[0]/parts[1]/...`` (``root`` itself must not
    be a symlink either). With ``create``, a missing component is made (mode 0755) first."""
    return open_dir_below(os.open(root, _DIR_FLAGS), parts, create=create)


def open_dir_below(start: int, parts: Iterable[str], *, create: bool = False) -> int:
    """``open_dir_beneath`` from the directory descriptor ``start``, which it takes over (it
    is closed, also on failure)."""

    def open_next(fd: int, _index: int, part: str) -> int:
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
        except FileExistsError:
            pass  # made meanwhile: opened below like any other, no symlink followed
        return os.open(part, _DIR_FLAGS, dir_fd=fd)

    return walk(start, parts, open_next, close_start=True)


def replace_file(dir_fd: int, name: str, chunks: Iterable[bytes], mode: int) -> None:
    """Write ``chunks`` as the file ``name`` of the directory ``dir_fd``, atomically: a new file
    beside it (O_EXCL, O_NOFOLLOW), its mode set to exactly ``mode``, fsync, rename(2) over
    the name. Never into an existing file: writing in place would keep its inode, and with it a
    hard link elsewhere, a group or world write, or a set-id bit that a caller with CAP_FSETID
    (root) does not clear by writing (a sandbox's program written into a setuid file stays
    setuid). A name that is there and is not a regular file (a directory, a FIFO) is refused:
    IsADirectoryError, or OSError EEXIST."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", name)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise FileExistsError(17, "not a regular file", name)
    tmp = f".{_cut(name, 200)}.nsbox-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
        os.fchmod(fd, mode & 0o777)  # never a set-id bit
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces a symlink itself
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def _cut(name: str, limit: int) -> str:
    """The longest head of ``name`` whose bytes (os.fsencode) fit in ``limit``, cut between
    characters (NAME_MAX, 255, counts bytes: 80 CJK characters are 240 of them)."""
    size = 0
    for i, char in enumerate(name):
        size += len(os.fsencode(char))  # a byte kept as a surrogate (not UTF-8) is one
        if size > limit:
            return name[:i]
    return name


def caller_umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread):
    proc(5), the Umask line of /proc/self/status (Linux 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
