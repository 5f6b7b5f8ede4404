"""A directory reached one component at a time, never through a symlink.

Used where a tree that a sandbox can write is read or written by path: a project workspace on
the host side (nsbox/host/project.py) and a session's file operations inside the sandbox
(nsbox/sandbox/fileworker.py). Each component is opened with O_NOFOLLOW relative to the one
before (openat(2)), so a symlink planted anywhere on the way fails with ELOOP instead of being
followed out of the tree, and a file in the way with ENOTDIR; the OSError's filename is the
component that failed. Imported by both sides: nothing here may import more than the standard
library.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_beneath(root: str, parts: Iterable[str], *, create: bool = False) -> int:
    """A descriptor of the directory ``root/parts[0]/parts[1]/...`` (``root`` itself must not
    be a symlink either). With ``create``, a missing component is made (mode 0755) first."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: opened below like any other, no symlink followed
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd
