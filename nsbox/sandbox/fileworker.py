"""A session's file operations (get, put, list), each run by the session's init in a forked
child (nsbox/sandbox/sessioninit.py).

File operations (``op``) run in a forked child with no capabilities at all, as the sandbox's
uid, inside the sandbox's root: they can only reach what a command could. They never follow a
symlink (each path component is opened with O_NOFOLLOW), open with O_NONBLOCK and check with
fstat that what they opened is a regular file before reading, and read at most st_size bytes.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import signal
import stat
from typing import Any

from nsbox._sys import libc as _libc
from nsbox._sys.paths import open_dir_beneath
from nsbox._sys.wire import write_all
from nsbox.sandbox import child as _child
from nsbox.sandbox import projectfs

WORKSPACE = "/workspace"
ROOT = "/"  # where every walk starts (the Landlock mode's: the workspace, WORKSPACE "")
_CHUNK = 65536
_MAX_DEPTH = 64


# --- file operations, run in a forked child without capabilities -------------------------------


class FileOpError(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path, self.reason = path, reason


def run_file_op(ctx: _child.Context, op: dict[str, Any]) -> int:
    """Run one file operation; its data goes to stdout, a JSON error to stderr (exit 1)."""
    ctx.step = "drop capabilities"
    _libc.close_range(3)
    _libc.drop_all_capabilities(ctx.cap_last)
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    return perform(ctx, op)


def perform(ctx: _child.Context, op: dict[str, Any]) -> int:
    """The operation itself, in a process that holds nothing more than the sandbox."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    ctx.step = f"file {op.get('kind')}"
    try:
        if op["kind"] == "get":
            get_file(op["path"], op["max_size"])
        elif op["kind"] == "put":
            put_file(op["path"], op["mode"])
        elif op["kind"] == "list":
            list_files(op)
        elif op["kind"] == "changes":
            write_all(1, projectfs.run_changes(op))
        elif op["kind"] == "getmany":
            for path in op["paths"]:  # one after the other; the host splits by the sizes
                get_file(path, op["max_size"])
        else:
            raise FileOpError("", f"unknown file operation {op['kind']!r}")
    except FileOpError as exc:
        write_all(2, json.dumps({"path": exc.path, "reason": exc.reason}).encode())
        return 1
    except OSError as exc:
        # Its own message where it has one ("more than 20000 changed entries": the listing's
        # limit, which E2BIG alone would say as "Argument list too long").
        reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
        write_all(2, json.dumps({"path": op.get("path", ""), "reason": reason,
                                  "errno": exc.errno or 0}).encode())
        return 1
    return 0


def _components(path: str) -> list[str]:
    """The components of a sandbox path; relative paths are relative to the workspace."""
    if "\0" in path:
        raise FileOpError(path, "the path contains a NUL byte")
    full = path if path.startswith("/") else f"{WORKSPACE}/{path}"
    parts = [p for p in full.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileOpError(path, "'..' is not allowed in a path")
    return parts


def _open_dir(parts: list[str], path: str, create: bool = False) -> int:
    """Walk from / to the directory ``parts`` without following any symlink."""
    try:
        return open_dir_beneath(ROOT, parts, create=create)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise FileOpError(path, f"{exc.filename} is a symlink or not a directory") from None
        raise


def _open_regular(name: str, dir_fd: int, path: str) -> tuple[int, os.stat_result]:
    """Open ``name`` for reading only if it is a regular file, never following a symlink and
    never blocking on a FIFO (open(2): O_NOFOLLOW, O_NONBLOCK)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileOpError(path, "a symlink (not followed)") from None
        if exc.errno in (errno.ENXIO, errno.EACCES, errno.EPERM, errno.EOPNOTSUPP):
            raise FileOpError(path, f"cannot be opened: {os.strerror(exc.errno)}") from None
        raise
    st = os.fstat(fd)
    reason = _not_copyable(st)
    if reason:
        os.close(fd)
        raise FileOpError(path, reason)
    return fd, st


def _not_copyable(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (not followed)"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO, not a regular file"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return "a device node, not a regular file"
    if stat.S_ISSOCK(st.st_mode):
        return "a socket, not a regular file"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink > 1:
        return f"a hard link ({st.st_nlink} names)"
    return None


def get_file(path: str, max_size: int) -> None:
    parts = _components(path)
    if not parts:
        raise FileOpError(path, "not a file")
    dir_fd = _open_dir(parts[:-1], path)
    try:
        fd, st = _open_regular(parts[-1], dir_fd, path)
    finally:
        os.close(dir_fd)
    try:
        if st.st_size > max_size:
            raise FileOpError(path, f"too large: {st.st_size} bytes, the limit is {max_size}")
        os.set_blocking(fd, True)
        projectfs.read_exactly(fd, st.st_size, lambda chunk: write_all(1, chunk))
    finally:
        os.close(fd)


def put_file(path: str, mode: int) -> None:
    parts = _components(path)
    if not parts:
        raise FileOpError(path, "not a file")
    dir_fd = _open_dir(parts[:-1], path, create=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        try:
            fd = os.open(parts[-1], flags, mode & 0o777, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FileOpError(path, "a symlink is in the way (not followed)") from None
            if exc.errno == errno.ENXIO:
                raise FileOpError(path, "a FIFO is in the way") from None
            raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileOpError(path, "something other than a regular file is in the way")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        os.fchmod(fd, mode & 0o777)
        while chunk := os.read(0, _CHUNK):
            write_all(fd, chunk)
    finally:
        os.close(fd)


def list_files(op: dict[str, Any]) -> None:
    """List the regular files below ``root`` matching ``patterns``, with size and SHA-256.

    Output: one JSON object {"files": [...], "skipped": [...]}, paths relative to the root,
    in the walk's order (each directory's entries sorted by name). A listing that would pass
    LISTING_BYTES stops at the entry that does not fit and says so: "truncated": true and
    "max_bytes" (the key is absent from a whole listing).
    """
    root = op["path"]
    patterns = op.get("patterns") or ["*"]
    limits = {"files": op["max_files"], "size": op["max_size"], "total": op["max_total"]}
    state = {"count": 0, "total": 0}
    listing = _Listing(2 * op["max_files"], LISTING_BYTES)
    root_fd = _open_dir(_components(root), root)

    def want(rel: str) -> bool:
        return any(fnmatch.fnmatchcase(rel, p) for p in patterns)

    def walk(dir_fd: int, prefix: str, depth: int) -> None:
        with os.scandir(dir_fd) as entries:
            names = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in entries)
        for name, is_dir in names:
            rel = f"{prefix}{name}"
            if is_dir:
                if depth >= _MAX_DEPTH:
                    listing.skip({"path": rel, "reason": "too deep"})
                    continue
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, dir_fd=dir_fd)
                except OSError as exc:
                    listing.skip({"path": rel + "/", "reason": os.strerror(exc.errno or 0)})
                    continue
                try:
                    walk(sub, rel + "/", depth + 1)
                finally:
                    os.close(sub)
                continue
            if not want(rel):
                continue
            try:
                fd, st = _open_regular(name, dir_fd, rel)
            except FileOpError as exc:
                listing.skip({"path": rel, "reason": exc.reason})
                continue
            except OSError as exc:
                listing.skip({"path": rel, "reason": os.strerror(exc.errno or 0)})
                continue
            try:
                reason = None
                if st.st_size > limits["size"]:
                    reason = f"too large: {st.st_size} bytes, the limit is {limits['size']}"
                elif state["count"] >= limits["files"]:
                    reason = f"over the limit of {limits['files']} files"
                elif state["total"] + st.st_size > limits["total"]:
                    reason = f"over the limit of {limits['total']} bytes in all"
                if reason:
                    listing.skip({"path": rel, "reason": reason})
                    continue
                os.set_blocking(fd, True)
                digest = projectfs.read_exactly(fd, st.st_size)
            finally:
                os.close(fd)
            listing.add({"path": rel, "size": st.st_size, "sha256": digest,
                         "mode": stat.S_IMODE(st.st_mode), "mtime": st.st_mtime})
            state["count"] += 1
            state["total"] += st.st_size

    try:
        walk(root_fd, "", 0)
    except _ListingFull:
        listing.truncated = True  # the walk stops at the first entry that does not fit
    finally:
        os.close(root_fd)
    write_all(1, listing.dump())


# The bytes of one listing's JSON. The host reads at most 16 MiB of a file operation's output
# (nsbox/session/files.py) and fails the whole listing past it; names can be long (4096 bytes
# of path) and JSON writes a control character in six, so 1000 files alone could pass it.
LISTING_BYTES = 8 * 1024 * 1024


class _ListingFull(Exception):
    """The next entry would take the listing past its bytes."""


class _Listing:
    """The files and the skipped entries of a listing, bounded in bytes, and the skipped ones
    in number too: a workspace of a million FIFOs gives one line for the rest."""

    def __init__(self, max_skipped: int, max_bytes: int) -> None:
        self.files: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.max_skipped, self.max_bytes = max_skipped, max_bytes
        self.more = 0  # skipped entries not listed
        self.size = 64  # the JSON around the entries
        self.truncated = False

    def _room(self, item: dict[str, Any]) -> None:
        size = len(json.dumps(item)) + 2  # and its ", "
        if self.size + size > self.max_bytes:
            raise _ListingFull
        self.size += size

    def add(self, item: dict[str, Any]) -> None:
        self._room(item)
        self.files.append(item)

    def skip(self, item: dict[str, Any]) -> None:
        if len(self.skipped) < self.max_skipped:
            self._room(item)
            self.skipped.append(item)
            return
        self.more += 1
        if self.more == 1:
            item = {"path": "...", "reason": "more files skipped, not listed"}
            self._room(item)
            self.skipped.append(item)

    def dump(self) -> bytes:
        listing: dict[str, Any] = {"files": self.files, "skipped": self.skipped}
        if self.truncated:
            listing.update(truncated=True, max_bytes=self.max_bytes)
        return json.dumps(listing).encode()
