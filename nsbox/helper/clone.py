"""Clone strategies: how the launch helper brings a sandbox's first process into being, in the
run's cgroup, and what that process runs.

A process moved into a cgroup after its birth (a write to ``cgroup.procs``) waits for an RCU
grace period, about 10 ms on this kind of host (nsbox/helper/spawner.py); one born there does
not. Each kind of host has its own way to have the child born in the run's cgroup:

  ``IntoCgroup``  cgroup v2: clone3(CLONE_INTO_CGROUP) into the run's cgroup (Linux 5.7);
  ``Spawned``     cgroup v1: a spawner waiting in a cgroup made ahead clones the child there
                  with CLONE_PARENT, so that the helper is its parent all the same;
  ``Cloner``      no cgroup, or no way to be born in it: clone here, then attach the child to
                  the run's cgroup before it is released. The other two fall back to it (no
                  cgroup descriptor; no spawner ready).

The helper chooses one strategy when it starts (``choose``); every launch goes through it, in
this order: ``make_cgroup`` (the run's cgroup, with its limits), ``cgroup_fd`` (a descriptor to
clone into, or None), ``clone`` (the child's pid; it sets ``Launch.born_in_cgroup``),
``settle`` (after the id maps: the cgroup holds the child alone, with the run's limits),
``abandon`` (a launch that failed before its release), ``ended`` (after the report); ``close``
when the helper ends.

A strategy owns the clone and what the child runs: ``Cloner.child``, which by default is
``become_child``, the Python child (nsbox/sandbox/child.py). Every strategy first asks
``native_plan`` whether the native core (nsbox/sandbox/native.py, the extension nsbox._native)
can run this launch; if so, the clone and the whole child are C (``_native_core.spawn``, or the
spawner's with the flat plan), and ``Launch.core`` says "native". A strategy whose clone and child
steps are not Python replaces ``clone`` (and, for spawners, ``child``); what the child receives
is ``ChildFds`` and the plan, and it reports failures on the error pipe as
``{step, errno, message}`` like the Python child.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING, NoReturn

from nsbox import cgroups
from nsbox._sys import libc as _libc
from nsbox._sys.wire import WirePlan
from nsbox.helper import spawner as _spawner
from nsbox.helper.launch import NAMESPACES, ChildFds
from nsbox.sandbox import child as _child
from nsbox.sandbox import native as _native_core

if TYPE_CHECKING:
    from nsbox.helper.launch import Launch
    from nsbox.helper.loop import Helper

def become_child(plan: WirePlan, fds: ChildFds, parent_fds: tuple[int, ...],
                 cap_last: int) -> NoReturn:
    """In the cloned child: drop the helper's ends (``parent_fds``), take the standard streams,
    and go on as the sandbox (nsbox/sandbox/child.py), or as a session's init. Never returns."""
    try:
        ctx = _child.Context(plan, fds.sync_r, fds.err_w, fds.sources, cap_last, fds.notify,
                             fds.net)
        try:
            # The helper's end of the sync pipe held here would keep the child waiting for the
            # id maps after the helper died, instead of seeing end-of-file.
            for fd in parent_fds:
                os.close(fd)
            _child.take_streams(fds.stdio)
        except OSError as exc:  # reported under the first step's name, as the native core does
            _child.fail(ctx, exc.errno or 0, exc.strerror or str(exc))
        if plan.get("pooled"):
            _child.keep_only({0, 1, 2, fds.sync_r, fds.err_w, fds.notify, *fds.sources.values(),
                              *([fds.net] if fds.net is not None else [])})
        if plan.get("session"):
            # Imported by the helper before the clone: nothing can be imported after pivot_root.
            sys.modules["nsbox.sandbox.sessioninit"].main(ctx)
        _child.main(ctx)
    finally:
        os._exit(127)


def native_plan(launch: Launch, plan: WirePlan, fds: ChildFds,
                cap_last: int) -> tuple[bytes, list[int]] | None:
    """The native core's flat plan and its descriptors, or None: the Python child runs this
    launch (nsbox/sandbox/native.py says when). Sets ``launch.core``."""
    launch.core = "python"
    try:
        flat = _native_core.flatten(plan, fds.stdio, fds.sync_r, fds.err_w, fds.sources,
                                    fds.notify, fds.net, cap_last, _native_core.own_name(),
                                    _child.ignored_signals)
    except (ValueError, OverflowError):
        # A kind of plan the native core does not run, or a name or a number it cannot carry:
        # the Python child takes it.
        return None
    launch.core = "native"
    return flat


class Cloner:
    """Clone here, then attach the child to the run's cgroup (when there is one) before it is
    released. The base of the other strategies, and their fallback."""

    name = "clone, then attach"

    def __init__(self, cap_last: int) -> None:
        self.cap_last = cap_last  # read once by the helper: the child drops every capability

    def make_cgroup(self, launch: Launch, request: cgroups.Request) -> cgroups.RunCgroup:
        """The run's cgroup with the limits of ``request`` (RunLimits calls it)."""
        return cgroups.get_backend().create(request)

    def cgroup_fd(self, launch: Launch) -> int | None:
        """A descriptor of the run's cgroup to clone the child into, or None (attach it)."""
        return None

    def clone(self, launch: Launch, plan: WirePlan, fds: ChildFds,
              cgroup_fd: int | None) -> int:
        """Clone the child with every namespace (into ``cgroup_fd`` when given); in the child,
        go on as the sandbox (``child``). Sets ``launch.pid`` and ``launch.born_in_cgroup``.
        Raises OSError when there is no child."""
        flat = native_plan(launch, plan, fds, self.cap_last)
        if flat is not None:
            pid = _native_core.spawn(*flat, (launch.sync_fd, launch.err_fd),
                                     NAMESPACES | signal.SIGCHLD,
                                     -1 if cgroup_fd is None else cgroup_fd)
        elif cgroup_fd is not None:
            pid = _libc.clone_into_cgroup(NAMESPACES, signal.SIGCHLD, cgroup_fd)
        else:
            pid = _libc.raw_clone(NAMESPACES | signal.SIGCHLD)
        if pid == 0:
            self.child(plan, fds, (launch.sync_fd, launch.err_fd))
        launch.pid = pid
        launch.born_in_cgroup = cgroup_fd is not None
        return pid

    def child(self, plan: WirePlan, fds: ChildFds, parent_fds: tuple[int, ...]) -> NoReturn:
        """What the cloned child runs; never returns."""
        become_child(plan, fds, parent_fds, self.cap_last)

    def settle(self, launch: Launch) -> None:
        """After the id maps, before the child runs anything of its own: the run's cgroup holds
        the child, with the run's limits. Raises OSError."""
        if launch.born_in_cgroup:
            return
        launch.mark("helper: attach to cgroup")
        if launch.limits is not None:
            launch.limits.attach(launch.pid)

    def abandon(self, launch: Launch) -> None:
        """The launch failed before its release: drop what the strategy holds for it."""

    def ended(self) -> None:
        """A launch's report went out (a good time to prepare for the next one)."""

    def close(self) -> None:
        """The helper ends."""


class IntoCgroup(Cloner):
    """cgroup v2: the child is born in the run's cgroup (clone3 with CLONE_INTO_CGROUP)."""

    name = "clone3 into the cgroup"

    def cgroup_fd(self, launch: Launch) -> int | None:
        if launch.limits is None or launch.limits.cgroup is None:
            return None
        return launch.limits.cgroup.clone_fd()


class Spawned(Cloner):
    """cgroup v1: a spawner waiting in a cgroup made ahead clones the child there
    (nsbox/helper/spawner.py); with no spawner ready, clone here and attach."""

    name = "spawner"

    def __init__(self, cap_last: int, helper: Helper, backend: cgroups.Backend) -> None:
        super().__init__(cap_last)
        self.spawners = _spawner.Spawners(helper, backend, self.child)
        helper.call_later(0, self.spawners.fill)

    def make_cgroup(self, launch: Launch, request: cgroups.Request) -> cgroups.RunCgroup:
        """A ready spawner's cgroup (then ``launch.spawner`` is set), or a new one."""
        spawner = self.spawners.take()
        if spawner is None:
            return super().make_cgroup(launch, request)
        try:
            spawner.prepare(request)
        except OSError:
            # A broken spare (removed from outside, say) must not cost the run its cgroup.
            self.spawners.discard(spawner)
            return super().make_cgroup(launch, request)
        launch.spawner = spawner
        return spawner.cgroup

    def clone(self, launch: Launch, plan: WirePlan, fds: ChildFds,
              cgroup_fd: int | None) -> int:
        if launch.spawner is None:
            return super().clone(launch, plan, fds, cgroup_fd)
        flat = native_plan(launch, plan, fds, self.cap_last)
        try:
            pid = launch.spawner.clone(flat)
        except OSError:
            # It died before it cloned (killed from outside, say): clone here and attach
            # instead; its cgroup, with the run's limits, stays the run's.
            dead, launch.spawner = launch.spawner, None  # ended here, whatever happens
            dead.leave(kill=True)
            return super().clone(launch, plan, fds, cgroup_fd)
        try:
            # The child waits for its plan first, then for the id maps like any other; the
            # native core's had its flat plan before the clone.
            if flat is None:
                launch.spawner.send_plan(plan, fds)
        except OSError:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        launch.pid = pid
        launch.born_in_cgroup = True
        return pid

    def settle(self, launch: Launch) -> None:
        spawner, launch.spawner = launch.spawner, None  # ended here, whatever happens next
        if spawner is None:
            super().settle(launch)
            return
        launch.mark("helper: spawner exits")
        spawner.leave()  # it exits once it has cloned

    def abandon(self, launch: Launch) -> None:
        spawner, launch.spawner = launch.spawner, None
        if spawner is not None:
            spawner.end(kill=True)

    def ended(self) -> None:
        self.spawners.refill_later()

    def close(self) -> None:
        self.spawners.close()


def choose(helper: Helper, cap_last: int) -> Cloner:
    """The strategy for this host's run cgroups, chosen once per helper."""
    backend = cgroups.get_backend()
    if backend.kind == "v1":
        return Spawned(cap_last, helper, backend)
    if backend.kind == "v2":
        return IntoCgroup(cap_last)
    return Cloner(cap_last)
