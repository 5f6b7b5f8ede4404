"""The socket scan: a unix socket or FIFO at or below a bound tree (rule host-socket).

``find_host_socket`` walks a tree without following symlinks and remembers the directories it
found clean, by their stat (below). ``find_watched`` does the same for a tree that no sandbox
writes and that every default launch binds (rules.SCANNED_INSIDE: /usr/local), and keeps an
inotify(7) watch on each of its directories, so that a later launch in the same process looks
at one descriptor instead of every directory: a name created, moved in, or a mode changed in
any of them (IN_CREATE, IN_MOVED_TO, IN_ATTRIB), a watch lost (IN_IGNORED, IN_Q_OVERFLOW), or
another process or mount namespace, and the tree is walked again. A mount made over a part of
the tree sends no event: the caller asks again when the mount table changed (the host view).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from typing import Any

# Directories found clean: path -> (identity and change times, names of its subdirectories).
# Creating, renaming or linking an entry changes a directory's ctime, which no one can set
# back (utimensat(2) sets only atime and mtime); a mount over a subdirectory changes its
# device and inode. So a directory whose stat is unchanged holds what it held. A directory
# changed within the last seconds is not remembered: its ctime could still change within the
# same clock tick after it was read (the timestamps use a coarse clock).
_Key = tuple[int, int, int, int]
_clean: dict[str, tuple[_Key, tuple[str, ...]]] = {}
_clean_lock = threading.Lock()
_CLEAN_MAX = 500_000
SETTLED_NS = 2_000_000_000


def _kind(mode: int) -> str | None:
    if stat.S_ISSOCK(mode):
        return "a unix socket"
    return "a FIFO" if stat.S_ISFIFO(mode) else None


def find_host_socket(root: str) -> tuple[str, str] | None:
    """The first unix socket or FIFO at or below ``root`` (not following symlinks) and what
    it is, or None.

    scandir's d_type tells directories, files and symlinks apart without a stat; only the
    remaining entries are stat'ed. Directories that cannot be listed but can be entered are
    reported, since a socket in them could still be reached by its name."""
    try:
        mode = os.lstat(root).st_mode
    except OSError:
        return None
    if _kind(mode):
        return root, str(_kind(mode))
    if not stat.S_ISDIR(mode):
        return None
    stack = [root]
    while stack:
        directory = stack.pop()
        found = _scan_dir(directory, stack)
        if found:
            return found
    return None


def _scan_dir(directory: str, stack: list[str]) -> tuple[str, str] | None:
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns)
    with _clean_lock:
        cached = _clean.get(directory)
    if cached is not None and cached[0] == key:
        stack.extend(directory + "/" + name for name in cached[1])
        return None
    subdirs: list[str] = []
    try:
        entries = os.scandir(directory)
    except PermissionError:
        if os.access(directory, os.X_OK):
            return directory, "a directory that can be entered but not listed"
        return None
    except OSError:
        return None
    with entries:
        for entry in entries:
            # Most entries are files: asked first, one call each (d_type, no stat).
            if entry.is_file(follow_symlinks=False):
                continue
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
            elif not entry.is_symlink():
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                except OSError:
                    continue
                if _kind(mode):
                    return entry.path, str(_kind(mode))
    stack.extend(directory + "/" + name for name in subdirs)
    if time.time_ns() - st.st_ctime_ns > SETTLED_NS:
        with _clean_lock:
            if len(_clean) >= _CLEAN_MAX:
                _clean.clear()
            _clean[directory] = (key, tuple(subdirs))
    return None


# --- watched trees -------------------------------------------------------------------------------

_IN_NONBLOCK_CLOEXEC = 0o4000 | 0o2000000
_EVENTS = 0x100 | 0x80 | 0x4 | 0x400 | 0x800 | 0x2000  # CREATE MOVED_TO ATTRIB DELETE_SELF
# MOVE_SELF UNMOUNT (IN_IGNORED and IN_Q_OVERFLOW come unasked)
_MAX_WATCHED = 4096  # directories of one watched tree; a larger one is only walked


def _inotify() -> tuple[Any, Any]:
    """libc's inotify calls, loaded on the first watch (ctypes costs a one-shot CLI run)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc, ctypes.get_errno


class _Watch:
    """One tree found clean, and the inotify descriptor that says whether it still is."""

    def __init__(self, owner: tuple[int, str]) -> None:
        self.owner = owner
        self.libc, self.errno = _inotify()
        self.fd = self.libc.inotify_init1(_IN_NONBLOCK_CLOEXEC)
        if self.fd < 0:
            raise OSError(self.errno(), "inotify_init1")

    def add(self, directory: str) -> None:
        if self.libc.inotify_add_watch(self.fd, os.fsencode(directory), _EVENTS) < 0:
            raise OSError(self.errno(), "inotify_add_watch", directory)

    def quiet(self) -> bool:
        """No event since the watches were added (a read that would block)."""
        try:
            return not os.read(self.fd, 65536)
        except BlockingIOError:
            return True

    def close(self) -> None:
        os.close(self.fd)


_watches: dict[str, _Watch] = {}
_walked: set[tuple[int, str]] = set()  # (pid, tree) walked once without a watch
_watch_lock = threading.Lock()


def find_watched(root: str, mounts: str) -> tuple[str, str] | None:
    """``find_host_socket(root)``, answered from a watch when ``root`` was found clean
    before in this process, with the same mount table (``mounts``)."""
    owner = (os.getpid(), mounts)
    with _watch_lock:
        watch = _watches.get(root)
        if watch is not None and watch.owner[0] != owner[0]:
            del _watches[root]  # a forked process: the parent's descriptor is not ours to read
            watch = None
        if watch is not None and watch.owner == owner and watch.quiet():
            return None
        if watch is not None:
            del _watches[root]
            watch.close()
        if (owner[0], root) not in _walked:
            # A process that launches once (the command line) is not worth the watches: the
            # first walk only walks; a second launch in this process sets the watches up.
            _walked.add((owner[0], root))
            return find_host_socket(root)
        try:
            watch = _Watch(owner)
        except OSError:
            return find_host_socket(root)  # no inotify here: walked every time
        found, watched = _walk_watched(root, watch)
        if found is None and watched:
            _watches[root] = watch
        else:
            watch.close()
        return found


def forget(watches: bool = False) -> None:
    """Forget the trees found clean (and, with ``watches``, close their watches): the next
    scan walks as a first one does (the bench measures both, nsbox/bench/rules.py)."""
    _clean.clear()
    if watches:
        with _watch_lock:
            for watch in _watches.values():
                watch.close()
            _watches.clear()


def _walk_watched(root: str, watch: _Watch) -> tuple[tuple[str, str] | None, bool]:
    """The walk of find_host_socket, each directory watched before it is read (so nothing
    made after its reading goes unseen); whether every directory is watched."""
    try:
        mode = os.lstat(root).st_mode
    except OSError:
        return None, False
    if not stat.S_ISDIR(mode):
        return (root, str(_kind(mode))) if _kind(mode) else None, False
    stack, watched, count = [root], True, 0
    while stack:
        directory = stack.pop()
        if watched:
            count += 1
            try:
                if count > _MAX_WATCHED:
                    raise OSError(errno.ENOSPC, "too many directories")
                watch.add(directory)
            except OSError:
                watched = False  # watch limit (ENOSPC), gone meanwhile: only walked
        found = _scan_dir(directory, stack)
        if found:
            return found, False
    return None, watched
