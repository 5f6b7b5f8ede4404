"""Inside the sandbox: the copy-on-write project workspace and the listing of its changes.

The project directory of the host is the lower layer of an overlayfs mounted by the sandbox
child in its own user namespace (allowed since Linux 5.11; ``userxattr`` keeps overlay's
bookkeeping in ``user.overlay.*`` xattrs, which tmpfs stores since 6.6). The upper and work
directories are on a size-capped tmpfs of the sandbox: the sandbox's writes never touch a host
disk, and the host never opens a path the sandbox could have written. overlayfs takes private
copies of its layers' mounts, so the lower bind is gone with the staging root; the tmpfs stays
visible read-only at ``UPPER`` for the file worker to list (the overlay writes through its own
copy of that mount, not through the read-only one).

Before the sandbox starts, and in this order (the host decides what, in
nsbox/host/projectmasks.py): the project's git directories are bound onto themselves
read-only (``read_only``), directories the sandbox is not to see are covered with an empty
read-only one (``covered``), and secret files with an empty read-only file (``masks``). A
command cannot unmount, unlink or write any of them (EBUSY, EROFS), and the lower files are
reached only through the overlay.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Callable
from typing import Any

from nsbox._sys import libc as _libc

UPPER = "/.nsbox-project"  # in the sandbox: the tmpfs holding upper/ and work/
LOWER_STAGE = "/project-lower"  # in the staging root (gone at pivot_root)
RW_STAGE = "/project-rw"
MASK_FILE = "/project-mask"
MASK_DIR = "/project-mask-dir"
_CHUNK = 65536
_MAX_DEPTH = 64
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def mount_project(root: int, op: dict[str, Any], tree: int, build: str,
                  open_dir: Any, attach: Any, move_into_place: Any) -> None:
    """Mount the overlay of op["source"] at op["target"] of the new root (``root``).

    ``tree`` is a detached copy of the source (the helper's, idmapped where it could be, or the
    child's own); the helpers of nsbox/sandbox/child.py are passed in to keep one way of mounting.
    """
    _libc.mount_setattr("", _libc.MOUNT_ATTR_RDONLY | _libc.MOUNT_ATTR_NOSUID
                        | _libc.MOUNT_ATTR_NODEV, recursive=True, dirfd=tree, empty_path=True)
    os.mkdir(LOWER_STAGE)
    attach(tree, os.open(LOWER_STAGE, _DIR))
    lower = os.stat(LOWER_STAGE)
    os.mkdir(RW_STAGE)
    _libc.mount("tmpfs", RW_STAGE, "tmpfs", _libc.MS_NOSUID | _libc.MS_NODEV,
                f"size={op['size']},mode=755")
    os.mkdir(RW_STAGE + "/upper", stat.S_IMODE(lower.st_mode))
    os.mkdir(RW_STAGE + "/work", 0o700)
    try:
        # The workspace's root keeps the owner the project has here (overlayfs takes the root
        # directory's attributes from the upper layer).
        os.chown(RW_STAGE + "/upper", lower.st_uid, lower.st_gid)
    except OSError:
        pass  # an owner not mapped here (shown as the overflow id): the directory stays ours
    _libc.mount("overlay", build, "overlay", _libc.MS_NOSUID | _libc.MS_NODEV,
                f"lowerdir={LOWER_STAGE},upperdir={RW_STAGE}/upper,workdir={RW_STAGE}/work,"
                "userxattr")
    merged_fd = os.open(build, _DIR)
    try:
        for rel in op.get("read_only", []):
            _cover(merged_fd, rel, None)
        for rel in op.get("covered", []):
            _cover(merged_fd, rel, _empty(MASK_DIR, is_dir=True))
        for rel in op.get("masks", []):
            _cover(merged_fd, rel, _empty(MASK_FILE, is_dir=False))
    finally:
        os.close(merged_fd)
    move_into_place(build, open_dir(root, op["target"]))
    # The sandbox may read its upper layer but not write it behind the overlay's back.
    _libc.mount_setattr(RW_STAGE, _libc.MOUNT_ATTR_RDONLY | _libc.MOUNT_ATTR_NOEXEC,
                        recursive=False)
    move_into_place(RW_STAGE, open_dir(root, UPPER))


def _empty(path: str, is_dir: bool) -> str:
    """An empty file or directory of the staging root, made on first use, to cover with."""
    if not os.path.lexists(path):
        if is_dir:
            os.mkdir(path, 0o555)
        else:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o444))
    return path


def _cover(merged_fd: int, rel: str, cover: str | None) -> None:
    """Mount ``cover`` read-only onto ``rel`` of the project, or (``cover`` None) ``rel``
    itself, with what is mounted below it: the same file, read-only."""
    # No symlink is followed on the way (openat2 RESOLVE_NO_SYMLINKS).
    target = _libc.try_openat2(merged_fd, rel, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
                               _libc.RESOLVE_NO_SYMLINKS | _libc.RESOLVE_BENEATH)
    if target < 0:
        raise OSError(errno.ELOOP, f"cannot cover {rel}: a symlink or a missing component on "
                                   "its path")
    try:
        mode = os.fstat(target).st_mode
        if cover is None:
            fits = stat.S_ISDIR(mode) or stat.S_ISREG(mode)
        else:
            fits = stat.S_ISDIR(mode) if cover == MASK_DIR else stat.S_ISREG(mode)
        if not fits:
            raise OSError(errno.EINVAL, f"cannot cover {rel}: it is no longer what it was")
        if cover is None:
            tree = _libc.open_tree("", _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC
                                   | _libc.AT_RECURSIVE | _libc.AT_EMPTY_PATH, dirfd=target)
        else:
            tree = _libc.open_tree(cover, _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC)
        try:
            _libc.mount_setattr("", _libc.MOUNT_ATTR_RDONLY | _libc.MOUNT_ATTR_NOSUID
                                | _libc.MOUNT_ATTR_NODEV | (0 if cover is None
                                                            else _libc.MOUNT_ATTR_NOEXEC),
                                recursive=True, dirfd=tree, empty_path=True)
            _libc.move_mount(tree, target)
        finally:
            os.close(tree)
    finally:
        os.close(target)


# --- the file worker's "changes" operation (no capabilities, the sandbox's uid) ---------------


def list_upper(op: dict[str, Any]) -> dict[str, Any]:
    """What the upper layer holds, entry by entry, with no symlink followed and no file opened
    that is not a regular file: each entry's kind, mode, size and SHA-256 (files up to
    op["max_size"]). overlayfs marks a deleted name with a 0/0 character device (a whiteout)
    and a directory that hides the lower one with the xattr user.overlay.opaque."""
    entries: list[dict[str, Any]] = []
    limit = int(op["max_entries"])
    top = os.open(f"{UPPER}/upper", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def walk(dir_fd: int, prefix: str, depth: int) -> None:
        for name in sorted(os.listdir(dir_fd)):
            if len(entries) >= limit:
                raise OSError(errno.E2BIG, f"more than {limit} changed entries")
            rel = prefix + name
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            entry: dict[str, Any] = {"path": rel, "mode": st.st_mode}
            entries.append(entry)
            if stat.S_ISDIR(st.st_mode):
                entry["kind"] = "dir"
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=dir_fd)
                try:
                    entry["opaque"] = _is_opaque(sub)
                    if depth >= _MAX_DEPTH:
                        entry["kind"], entry["reason"] = "refused", "too deep"
                    else:
                        walk(sub, rel + "/", depth + 1)
                finally:
                    os.close(sub)
            elif stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                entry["kind"] = "whiteout"
            elif stat.S_ISLNK(st.st_mode):
                entry["kind"], entry["target"] = "symlink", os.readlink(name, dir_fd=dir_fd)
            elif stat.S_ISREG(st.st_mode):
                entry.update(_describe_file(name, dir_fd, st, int(op["max_size"])))
            else:
                entry["kind"], entry["reason"] = "refused", "a FIFO, socket or device"

    try:
        walk(top, "", 0)
    finally:
        os.close(top)
    return {"entries": entries}


def _is_opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, "user.overlay.opaque") == b"y"
    except OSError:
        return False


def _describe_file(name: str, dir_fd: int, st: os.stat_result, max_size: int) -> dict[str, Any]:
    if st.st_nlink > 1:
        return {"kind": "refused", "size": st.st_size,
                "reason": f"a hard link ({st.st_nlink} names)"}
    if st.st_size > max_size:
        return {"kind": "refused", "size": st.st_size,
                "reason": f"too large: {st.st_size} bytes, the limit is {max_size}"}
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    try:
        again = os.fstat(fd)
        if not stat.S_ISREG(again.st_mode) or again.st_nlink > 1:
            return {"kind": "refused", "reason": "changed while it was listed"}
        return {"kind": "file", "size": again.st_size, "sha256": read_exactly(fd, again.st_size)}
    finally:
        os.close(fd)


def run_changes(op: dict[str, Any]) -> bytes:
    return json.dumps(list_upper(op)).encode()


def read_exactly(fd: int, size: int, sink: Callable[[bytes], object] | None = None) -> str:
    """Read at most ``size`` bytes (the size fstat saw: a file that grows meanwhile is not
    followed), give each chunk to ``sink``; their sha256. Also the session's file worker's."""
    digest = hashlib.sha256()
    left = size
    while left > 0:
        chunk = os.read(fd, min(_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
        if sink is not None:
            sink(chunk)
    return digest.hexdigest()
