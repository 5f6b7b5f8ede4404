"""Who the sandbox is on the host, the helper's side: the sandbox's id maps, and the user
namespaces that idmapped mounts take their mapping from.

The decision itself (which host uid, who opens bind sources) is nsbox/policy/identity.py's; here it
is written into /proc (user_namespaces(7)).
"""

from __future__ import annotations

import os

from nsbox._sys import libc as _libc
from nsbox._sys.wire import WirePlan
from nsbox.errors import HostError
from nsbox.policy import identity


def write_id_maps(held: identity.Holdings, pid: int, plan: WirePlan) -> None:
    """Map the sandbox's user and group (``plan``'s uid and gid inside) to the host ids decided
    from what the helper holds (``held``). Raises OSError."""
    # Decided again from the same holdings: open_sources refused already if there is none.
    try:
        ids = identity.decide(held, plan["host_uid"], plan["host_gid"])
    except HostError as exc:
        raise OSError(1, str(exc.args[0])) from None
    if not ids.mapper:
        # Unprivileged writers must give up setgroups first (user_namespaces(7)).
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(f"{plan['uid']} {ids.uid} 1\n")
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(f"{plan['gid']} {ids.gid} 1\n")


class MountNamespaces:
    """User namespaces for idmapped mounts, one per mapping, made once and kept by the helper
    (mount_setattr(2), MOUNT_ATTR_IDMAP takes the mapping of a user namespace)."""

    def __init__(self) -> None:
        self.by_mapping: dict[tuple[int, int, int, int], int] = {}

    def userns_for(self, disk_uid: int, disk_gid: int, host_uid: int, host_gid: int,
                   lower_layer: bool = False) -> int:
        """A user namespace descriptor mapping ``disk_uid``/``disk_gid`` to the host ids."""
        # Defense in depth: whatever the caller, an idmap never makes files root's on the host.
        # A project's lower layer is the exception for its owner on disk: that mount is
        # read-only and hidden from the sandbox (overlayfs writes only its upper tmpfs), so
        # nothing is ever written through it; the sandbox's side is never 0.
        if 0 in (host_uid, host_gid) or (0 in (disk_uid, disk_gid) and not lower_layer):
            raise OSError(1, "an idmapped mount never maps to or from id 0")
        key = (disk_uid, disk_gid, host_uid, host_gid)
        if key not in self.by_mapping:
            self.by_mapping[key] = make_userns(disk_uid, disk_gid, host_uid, host_gid)
        return self.by_mapping[key]


def make_userns(disk_uid: int, disk_gid: int, host_uid: int, host_gid: int) -> int:
    """A new user namespace mapping one uid and one gid, held by a descriptor: a child
    unshares it and waits while the helper writes its maps, then exits."""
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(hold_w)
            _libc.unshare(_libc.CLONE_NEWUSER)
            os.write(ready_w, b"1")
            os.read(hold_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError(0, "could not create the user namespace for an idmapped mount")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"{disk_uid} {host_uid} 1\n")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"{disk_gid} {host_gid} 1\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(hold_w)
        os.waitpid(pid, 0)
