"""A Landlock launch, the helper's side: the clone strategy of a plan whose ``isolation`` is
``landlock`` (nsbox/plan/landlock.py).

The launch goes through the same steps as any (nsbox/helper/start.py): the run's cgroup with its
limits, the pipes, the clone, the watch, the deadline, the report. What differs is here:

- the sandbox's directories: a fresh workspace (unless the policy names one) and a private
  temporary directory, made for the sandbox's host uid in a directory of their own below /tmp,
  and removed once the sandbox has ended, before the caller hears;
- the clone has no namespace flag (on cgroup v2 it is still born in the run's cgroup with
  clone3, otherwise attached before it is released); there are no id maps to write, the child
  changes its uid itself (nsbox/sandbox/landlocked.py), to the one nsbox/policy/identity.py decides;
- a kill is ``TREE_SIGNAL`` to the sandbox's init, which ends every process of the sandbox and
  then itself: without a pid namespace, a SIGKILL of the init would leave the rest running.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import tempfile
from typing import TYPE_CHECKING, NoReturn

from nsbox import cgroups
from nsbox._sys import libc as _libc
from nsbox._sys.wire import WirePlan
from nsbox.helper.clone import Cloner
from nsbox.helper.launch import ChildFds, Launch
from nsbox.policy import identity
from nsbox.sandbox import child as _child
from nsbox.sandbox import landlocked as _sandbox

if TYPE_CHECKING:
    from nsbox.helper.loop import Helper

LANDLOCK = "landlock"


def is_landlock(plan: WirePlan) -> bool:
    return plan.get("isolation") == LANDLOCK


def cloner_for(helper: Helper, plan: WirePlan) -> Cloner:
    """The clone strategy of ``plan``: the helper's own, or the Landlock one (made once)."""
    if not is_landlock(plan):
        return helper.cloner
    if helper.landlock_cloner is None:
        helper.landlock_cloner = LandlockCloner(helper.cap_last, helper.identity)
    return helper.landlock_cloner


class LandlockCloner(Cloner):
    """Fork (clone3 into the run's cgroup on cgroup v2), then the Landlock child."""

    name = "fork (Landlock)"

    def __init__(self, cap_last: int, held: identity.Holdings) -> None:
        super().__init__(cap_last)
        self.held = held
        self.into_cgroup = cgroups.get_backend().kind == "v2"

    def cgroup_fd(self, launch: Launch) -> int | None:
        if not self.into_cgroup or launch.limits is None or launch.limits.cgroup is None:
            return None
        return launch.limits.cgroup.clone_fd()

    def clone(self, launch: Launch, plan: WirePlan, fds: ChildFds,
              cgroup_fd: int | None) -> int:
        launch.core = "python"
        launch.kill_signal = _sandbox.TREE_SIGNAL
        prepare(launch, plan, self.held)
        pid = -1
        if cgroup_fd is not None:
            try:
                pid = _libc.clone_into_cgroup(0, signal.SIGCHLD, cgroup_fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOSYS, errno.EPERM):
                    raise
                # A container's seccomp profile answers clone3 with ENOSYS: fork, then
                # attach the child before it is released (settle).
                cgroup_fd = None
        if pid < 0:
            pid = _libc.raw_clone(signal.SIGCHLD)
        if pid == 0:
            self.child(plan, fds, (launch.sync_fd, launch.err_fd))
        launch.pid = pid
        launch.born_in_cgroup = cgroup_fd is not None
        return pid

    def child(self, plan: WirePlan, fds: ChildFds, parent_fds: tuple[int, ...]) -> NoReturn:
        become_child(plan, fds, parent_fds, self.cap_last)


def prepare(launch: Launch, plan: WirePlan, held: identity.Holdings) -> None:
    """The sandbox's ids and directories, in ``plan["landlock"]``: ``ids`` [uid, gid, mapper],
    ``workspace`` (made fresh unless given), ``tmp``. Writable directories are pinned (their
    ACLs and modes put back at the end, nsbox/helper/sources.py). Raises HostError, OSError."""
    landlock = plan["landlock"]
    ids = identity.decide(held, plan["host_uid"], plan["host_gid"])
    landlock["ids"] = [ids.uid, ids.gid, ids.mapper]
    for path in [*landlock["write"], *([landlock["workspace"]] if landlock["workspace"] else [])]:
        launch.pins.append(identity.pin(path))
        if ids.mapper:  # a root caller's sandbox writes there as an unprivileged uid
            identity.writable_bind(path, path, ids, detached=False)
    # Its own directory: mode 0711 when the sandbox is another uid than the helper, so that
    # neither the name of the workspace nor of the temporary directory can be listed.
    base = tempfile.mkdtemp(prefix="nsbox-landlock-", dir="/tmp")
    launch.landlock_dirs = base
    launch.cleanup.callback(remove_dirs, launch)
    if ids.mapper:
        os.chmod(base, 0o711)
    made = ["tmp"] + ([] if landlock["workspace"] else ["workspace"])
    for name in made:
        path = os.path.join(base, name)
        os.mkdir(path, 0o700)
        if ids.mapper:
            os.chown(path, ids.uid, ids.gid)
        landlock[name] = path


def remove_dirs(launch: Launch) -> None:
    """Remove what ``prepare`` made, once the sandbox has ended (its init ends every process of
    it first). shutil.rmtree follows no symlink (it works through descriptors)."""
    base = launch.landlock_dirs
    if base is None:
        return
    launch.landlock_dirs = None
    shutil.rmtree(base, ignore_errors=True)


def become_child(plan: WirePlan, fds: ChildFds, parent_fds: tuple[int, ...],
                 cap_last: int) -> NoReturn:
    """In the forked child, as clone.become_child: the standard streams, then the Landlock
    child (or a session's init). Never returns."""
    try:
        for fd in parent_fds:
            os.close(fd)
        for target, fd in enumerate(fds.stdio):
            os.dup2(fd, target)
        ctx = _child.Context(plan, fds.sync_r, fds.err_w, {}, cap_last, fds.notify, None)
        if plan.get("session"):
            sys.modules["nsbox.sandbox.landlock_session"].main(ctx)
        _sandbox.main(ctx)
    finally:
        os._exit(127)
