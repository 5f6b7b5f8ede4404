"""Reading the host's cgroup layout: which hierarchies are mounted where, and where we are.

Only /proc/self/mountinfo and /proc/self/cgroup are read (proc(5)), so a test can point this at
fake copies of both to simulate another kind of host; ``HostView`` carries such a host (a tree
standing for "/" and the uid whose write access counts) into the backends' detection, which is
how `nsbox doctor` judges a simulated host with the code a run uses.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from nsbox._sys import mountinfo as _mountinfo

# The v1 controllers nsbox uses. cpu and cpuacct are often co-mounted ("cpu,cpuacct").
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
# The v2 controllers a run cgroup needs enabled in its parent's cgroup.subtree_control.
V2_CONTROLLERS = ("memory", "pids", "cpu")


@dataclass(frozen=True)
class HostView:
    """Where the detection reads the host, and whose write access it judges.

    The default is this host as this process. A simulated host (`nsbox doctor`'s tests) is a
    tree that stands for "/" and an imagined uid.
    """

    root: str = "/"
    uid: int | None = None  # None: this process, asked through access(2) (groups, ACLs count)

    @property
    def euid(self) -> int:
        return os.geteuid() if self.uid is None else self.uid

    def path(self, name: str) -> str:
        """Where the host's file ``name`` lies in this view."""
        return os.path.join(self.root, name.lstrip("/"))

    def can_write(self, path: str) -> bool:
        """Whether the viewed uid may write the file, or create entries in the directory."""
        if self.uid is None:
            return os.access(path, os.W_OK)
        try:
            info = os.stat(path)
        except OSError:
            return False
        # A simulated host carries the owner and the mode bits that matter: no groups, no ACLs.
        return self.uid == 0 or bool(
            (info.st_uid == self.uid and info.st_mode & stat.S_IWUSR)
            or info.st_mode & stat.S_IWOTH
        )


THIS_HOST = HostView()


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy and this process's own cgroup in it."""

    version: int  # 1 or 2
    controllers: tuple[str, ...]  # v1: from the mount options; v2: empty (read cgroup.controllers)
    mount_point: str
    own_path: str  # /proc/self/cgroup's path, relative to the hierarchy's root

    @property
    def own_dir(self) -> str:
        """This process's own cgroup directory (where nsbox may create children)."""
        return os.path.normpath(os.path.join(self.mount_point, self.own_path.lstrip("/")))


@dataclass(frozen=True)
class Layout:
    """The cgroup hierarchies of this host as this process sees them."""

    unified: Hierarchy | None = None  # the cgroup2 mount, if any
    v1: dict[str, Hierarchy] = field(default_factory=dict)  # controller name -> hierarchy

    @property
    def kind(self) -> str:
        """``v2`` (unified only), ``hybrid`` (v1 controllers plus a cgroup2 mount), ``v1``, or
        ``none``."""
        if self.v1:
            return "hybrid" if self.unified else "v1"
        return "v2" if self.unified else "none"


def _own_paths(proc_cgroup: str) -> tuple[str | None, dict[str, str]]:
    """Parse /proc/self/cgroup: (v2 path, {v1 controller: path})."""
    v2: str | None = None
    v1: dict[str, str] = {}
    with open(proc_cgroup) as f:
        for line in f:
            hier_id, controllers, path = line.rstrip("\n").split(":", 2)
            if hier_id == "0" and controllers == "":
                v2 = path
            else:
                for name in controllers.split(","):
                    if name:
                        v1[name] = path
    return v2, v1


def _relative(own_path: str, mount_root: str) -> str | None:
    """Our path as seen below a mount whose root is ``mount_root`` (a container may mount only a
    subtree). None when our cgroup is not visible in that mount."""
    if mount_root in ("", "/"):
        return own_path
    if own_path == mount_root:
        return "/"
    if own_path.startswith(mount_root.rstrip("/") + "/"):
        return own_path[len(mount_root.rstrip("/")):]
    return None


def read_layout(
    mountinfo: str = "/proc/self/mountinfo",
    proc_cgroup: str = "/proc/self/cgroup",
    view: HostView = THIS_HOST,
) -> Layout:
    """Inspect the host once. Unreadable files mean "no cgroups" (a layout of kind ``none``).
    ``view``: a simulated host; its files are read there and its mount points lie below it."""
    if view.root != "/":
        mountinfo, proc_cgroup = view.path(mountinfo), view.path(proc_cgroup)
    try:
        v2_path, v1_paths = _own_paths(proc_cgroup)
        with open(mountinfo) as f:
            mounts = _mountinfo.parse(f.read())
    except OSError:
        return Layout()
    unified: Hierarchy | None = None
    v1: dict[str, Hierarchy] = {}
    for mount in mounts:
        fstype, options, root = mount.fstype, mount.options, mount.root
        mount_point = view.path(mount.point)
        if fstype == "cgroup2" and v2_path is not None and unified is None:
            rel = _relative(v2_path, root)
            if rel is not None:
                unified = Hierarchy(2, (), mount_point, rel)
        elif fstype == "cgroup":
            names = tuple(o for o in options if o in V1_CONTROLLERS)
            for name in names:
                if name in v1 or name not in v1_paths:
                    continue
                rel = _relative(v1_paths[name], root)
                if rel is not None:
                    v1[name] = Hierarchy(1, names, mount_point, rel)
    return Layout(unified=unified, v1=v1)
