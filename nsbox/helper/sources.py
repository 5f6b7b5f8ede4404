"""The bind sources of a launch, on the helper's side: each writable bind's directory pinned
(its ACLs and mode restored when the sandbox ends), and, where the helper may, every source
copied as a detached mount (idmapped for a writable bind as root) that the child moves into
place.

Without CAP_SYS_ADMIN of the initial user namespace (a regular user, root in a container) the
child binds each source by path with its own identity instead (nsbox/policy/identity.py).
"""

from __future__ import annotations

import os

from nsbox._sys import libc as _libc
from nsbox._sys.wire import WirePlan
from nsbox.helper.ids import MountNamespaces
from nsbox.helper.launch import Launch, StepFailed
from nsbox.policy import identity

TREE_FLAGS = _libc.OPEN_TREE_CLONE | _libc.OPEN_TREE_CLOEXEC | _libc.AT_RECURSIVE


class Sources:
    """Opens the bind sources of each launch from what the helper holds."""

    def __init__(self, held: identity.Holdings) -> None:
        self.held = held
        self.userns = MountNamespaces()

    def open(self, launch: Launch, plan: WirePlan) -> dict[int, int]:
        """Decide the sandbox's identity (or refuse, HostError), pin each writable bind's
        directory (``launch.pins``, released by its cleanup) and, with CAP_SYS_ADMIN of the
        initial user namespace, copy every bind source here as a detached mount the child
        moves in: mount index -> descriptor. Raises StepFailed("bind TARGET")."""
        ids = identity.decide(self.held, plan["host_uid"], plan["host_gid"])
        launch.cleanup.callback(release_pins, launch)
        fds: dict[int, int] = {}
        try:
            for index, op in enumerate(plan["mounts"]):
                if op["op"] == "overlay" and self.held.detached_binds:
                    fds[index] = self.project_tree(op["source"], ids)
                if op["op"] != "bind":
                    continue
                if op["writable"]:
                    launch.pins.append(identity.pin(op["source"]))
                    how = identity.writable_bind(op["source"], op["target"], ids,
                                                 self.held.detached_binds)
                if not self.held.detached_binds:
                    continue
                if op["writable"] and how == "idmap":
                    fds[index] = self.idmapped_tree(op["source"], ids)
                else:
                    fds[index] = _libc.open_tree_nofollow(op["source"], TREE_FLAGS)
        except BaseException as exc:
            for fd in fds.values():
                os.close(fd)
            if isinstance(exc, OSError):
                raise StepFailed(f"bind {op['target']}", exc.errno or 0,
                                  exc.strerror or str(exc)) from None
            raise
        return fds

    def project_tree(self, source: str, ids: identity.SandboxIds) -> int:
        """The lower layer of a project workspace: idmapped so that its owner (root's too: see
        MountNamespaces.userns_for) appears as the sandbox's user, who may then change its
        files in the upper layer; files of other owners stay read-only to the sandbox."""
        st = os.stat(source)
        if (st.st_uid, st.st_gid) != (ids.parent_uid, ids.parent_gid):
            return self.idmapped_tree(source, ids, lower_layer=True)
        return _libc.open_tree_nofollow(source, TREE_FLAGS)

    def idmapped_tree(self, source: str, ids: identity.SandboxIds,
                      lower_layer: bool = False) -> int:
        """A detached copy of ``source`` whose owner appears as the sandbox's host uid.

        As root, the sandbox runs as an unprivileged host uid; an idmapped mount lets it write
        to a host directory without changing anything on disk, and files it creates there are
        owned by the directory's owner (mount_setattr(2), MOUNT_ATTR_IDMAP). Never for an owner
        uid or gid 0 (identity.writable_bind): those files would be root's.
        """
        fd = _libc.open_tree_nofollow(source, TREE_FLAGS)
        try:
            st = os.fstat(fd)  # the tree opened, not whatever the path names by now
            userns = self.userns.userns_for(st.st_uid, st.st_gid, ids.uid, ids.gid,
                                            lower_layer)
            _libc.mount_setattr("", _libc.MOUNT_ATTR_IDMAP, recursive=True, userns_fd=userns,
                                dirfd=fd, empty_path=True)
        except OSError:
            os.close(fd)
            raise
        return fd


def release_pins(launch: Launch) -> None:
    """The sandbox is gone (or never ran): its writable binds' directories get their ACLs and
    modes back (it may own them through the bind, chmod them to 0777 or give them a default
    ACL that every file made there later would follow). The one place for every launch: the
    helper's, the launch engine's (nsbox/host/engine.py) and a Landlock sandbox's."""
    pins, launch.pins = launch.pins, []
    for held in pins:
        try:
            identity.restore(held)
        finally:
            os.close(held.fd)
