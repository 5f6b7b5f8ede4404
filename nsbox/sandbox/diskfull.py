"""The writable places of a sandbox that are full: named with the command's status by its
init, for the one line that says a failure may come from there (docs/limits.md, "Disk").

Plain os calls only: the sandbox's init (nsbox/sandbox/child.py) and a session's init
(nsbox/sandbox/sessioninit.py) run them inside, the launch helper reads the status line.
"""

from __future__ import annotations

import json
import os

# The places a sandbox writes to, each of a size of its own; one with less than FULL_BELOW bytes
# (or no inode) free when the command ends is named with its status, for the one line that
# says a failure may come from there (docs/limits.md, "Disk").
WRITABLE = ("/tmp", "/workspace", "/dev/shm")
FULL_BELOW = 1 << 20


def full_places() -> list[str]:
    """The places of WRITABLE that are full now (statvfs(3): free blocks for an unprivileged
    writer, free inodes)."""
    full = []
    for place in WRITABLE:
        try:
            st = os.statvfs(place)
        except OSError:
            continue
        if st.f_blocks and (st.f_bavail * st.f_frsize < FULL_BELOW
                            or (st.f_files and not st.f_favail)):
            full.append(place)
    return full


def disk_full(data: bytes) -> list[str]:
    """The places pid 1's status line names as full (read_report's data), WRITABLE's only."""
    for line in data.split(b"\n"):
        if line.startswith(b'{"status"'):
            try:
                places = json.loads(line).get("full") or []
            except (ValueError, AttributeError):
                return []
            return [p for p in WRITABLE if p in places]
    return []
