"""cgroup v2: the unified hierarchy with the memory, pids and cpu controllers.

Run cgroups are children of a base cgroup B: this process's own cgroup. The "no internal
processes" rule (cgroup-v2.rst, "No Internal Process Constraint") says that controllers can be
enabled in B's cgroup.subtree_control only while B holds no processes (the root cgroup is
exempt). So, on the first run, when B does not have the controllers enabled yet:

- if B's only processes are this helper and its parent (the launcher that started it), both are
  moved into a leaf child of B, ``nsbox-<owner>-leaf``, and then the controllers are enabled in B.
  (A launcher does it first, before a run through its launch engine or its helper, for
  itself, its engine and its helper: nsbox/host/launchprocess.py, enable_cgroups.)
  A helper that starts in such a leaf (its launcher was moved there) uses the leaf's parent as
  its base: several launchers in one delegated cgroup share it.
  The launcher is ours (it asked for the sandbox) and stays inside its own cgroup's subtree, so
  nothing outside it changes. This is the situation of a service started with ``Delegate=yes``,
  or of ``systemd-run --user --scope -p Delegate=yes nsbox ...`` for an unprivileged user.
- if B holds any other process, nothing is moved (it is not ours) and the backend reports why
  it cannot limit anything; the caller falls back to rlimits or, when cgroups are required,
  fails with that reason.

Leaves are only ever removed when empty, never killed: they hold the launcher. So a leaf outlives
its launch: rmdir(2) of a cgroup with live processes fails (EBUSY), and the launcher cannot leave
it for B (no internal processes once the controllers are enabled). The next helper with the same
base removes it (``reclaim``), or the cgroup's manager when the scope ends (docs/hosts.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from typing import Any

from nsbox.cgroups import _fs, naming
from nsbox.cgroups._base import (
    CPU_ACCOUNTING,
    CPUS,
    KILL,
    MEMORY,
    PIDS,
    Backend,
    Figure,
    Request,
    RunCgroup,
    Usage,
    read_seconds,
    read_usage,
)
from nsbox.cgroups._host import THIS_HOST, V2_CONTROLLERS, Hierarchy, HostView

CPU_PERIOD_US = 100_000
_FEATURE = {"memory": MEMORY, "pids": PIDS, "cpu": CPUS}


def delegate_command(uid: int | None = None) -> str:
    """The command that starts a program in a cgroup of its own, delegated to ``uid`` (default
    this process's; systemd-run(1), systemd.resource-control(5) Delegate=): a user asks its
    own manager, root the system's."""
    uid = os.geteuid() if uid is None else uid
    user = "" if uid == 0 else " --user"
    return f"systemd-run{user} --scope -p Delegate=yes nsbox ..."


def limit_writes(request: Request) -> list[tuple[str, str, bool]]:
    """The files of a run's directory that its limits are written to, with the values, and
    whether the file may be missing (then nothing is written): V2Run.set_limits here, the launch
    engine's request (nsbox/host/engine.py)."""
    writes = []
    if request.memory is not None:
        writes.append(("memory.max", str(request.memory), False))
        # No swap: a sandbox that is over its memory must be killed, not slowed to a crawl.
        # memory.swap.max exists only with swap accounting (cgroup-v2.rst, "Memory Interface").
        writes.append(("memory.swap.max", "0", True))
        # An OOM kill takes the whole run down, not one process of it (cgroup-v2.rst,
        # memory.oom.group): a half-killed sandbox is not a useful result.
        writes.append(("memory.oom.group", "1", False))
    if request.pids is not None:
        writes.append(("pids.max", str(request.pids), False))
    if request.cpus is not None:
        quota = max(1000, round(request.cpus * CPU_PERIOD_US))
        writes.append(("cpu.max", f"{quota} {CPU_PERIOD_US}", False))
    return writes


def usage_figures(run: str) -> list[Figure]:
    """Where the usage of the run whose directory is ``run`` is read: V2Run.usage, the launch
    engine."""
    stat = os.path.join(run, "cpu.stat")
    return [
        Figure("peak_memory", os.path.join(run, "memory.peak")),  # Linux 5.19; before, none
        Figure("cpu_user", stat, "user_usec", 1e-6),
        Figure("cpu_system", stat, "system_usec", 1e-6),
        Figure("peak_pids", os.path.join(run, "pids.peak")),  # Linux 6.1
        Figure("oom_kills", os.path.join(run, "memory.events"), "oom_kill"),
    ]


def cpu_figure(run: str) -> Figure:
    """Where the CPU time of every process of the run is polled."""
    return Figure("cpu", os.path.join(run, "cpu.stat"), "usage_usec", 1e-6)


class V2Run(RunCgroup):
    def __init__(self, path: str) -> None:
        self.path = path
        self.name = os.path.basename(path)

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def set_limits(self, request: Request) -> None:
        for name, value, optional in limit_writes(request):
            if not optional or os.path.exists(self._file(name)):
                _fs.write(self._file(name), value)

    def reset_peak_memory(self) -> None:
        # Never needed: a v2 run's first process is cloned into the cgroup, no spawner shares
        # it. (memory.peak can only be reset per open file, Linux 6.12.)
        pass

    def clone_fd(self) -> int | None:
        # A process moved in by a write to cgroup.procs waits for an RCU grace period (the
        # write takes cgroup_threadgroup_rwsem), about 10 ms here; one born in the cgroup does
        # not (clone3(2), CLONE_INTO_CGROUP, Linux 5.7).
        return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def attach(self, pid: int) -> None:
        _fs.write(self._file("cgroup.procs"), pid)

    def cpu_seconds(self) -> float | None:
        return read_seconds(cpu_figure(self.path))

    def usage(self) -> Usage:
        return read_usage(usage_figures(self.path))

    def pids(self) -> list[int]:
        return _fs.procs(self.path)

    def _empty(self) -> bool:
        return _fs.read_keyed(self._file("cgroup.events")).get("populated") == 0

    def kill_all(self) -> None:
        if os.path.exists(self._file("cgroup.kill")):  # Linux 5.14
            _fs.write(self._file("cgroup.kill"), 1)
            return
        # Older kernels: frozen tasks cannot fork, so one pass finds them all.
        _fs.write(self._file("cgroup.freeze"), 1)
        _fs.kill_pids(self.pids())
        _fs.write(self._file("cgroup.freeze"), 0)

    def destroy(self) -> None:
        if not os.path.isdir(self.path):
            return
        self.kill_all()
        if not _fs.wait_until(self._empty):
            raise OSError(errno.EBUSY, f"cgroup {self.path}: processes {self.pids()} did not exit")
        _fs.rmdir(self.path)


class V2Backend(Backend):
    kind = "v2"

    def __init__(self, hierarchy: Hierarchy, view: HostView = THIS_HOST) -> None:
        self.view = view
        self.base = hierarchy.own_dir
        if naming.is_leaf(os.path.basename(self.base)):
            # Started from a process that an earlier helper moved into its leaf: the base is
            # the same as that helper's, where the controllers are enabled already.
            self.base = os.path.dirname(self.base)
        self.reason = ""
        self._prepared = False
        try:
            available = _fs.read(os.path.join(self.base, "cgroup.controllers")).split()
        except OSError:
            available = []
        self.controllers = [c for c in V2_CONTROLLERS if c in available]
        if not self.controllers:
            self.reason = (
                f"the cgroup2 hierarchy offers none of {', '.join(V2_CONTROLLERS)} "
                f"in {self.base}"
            )
        elif _fs.read_only(self.base):
            # A container's cgroupfs is mounted read-only (Docker and podman do so unless
            # privileged): no uid can write it, delegation does not help.
            self.reason = f"the cgroup filesystem holding {self.base} is mounted read-only"
            self.controllers = []
        elif not self._writable():
            self.reason = (
                f"cgroup {self.base} is not writable by uid {view.euid} (no delegation); "
                f"run under a delegated cgroup, e.g. `{delegate_command(view.euid)}`"
            )
            self.controllers = []

    def _writable(self) -> bool:
        return _fs.writable(self.base, self.view) and self.view.can_write(
            os.path.join(self.base, "cgroup.subtree_control")
        )

    def supports(self) -> frozenset[str]:
        if not self.controllers:
            return frozenset()
        found = {_FEATURE[c] for c in self.controllers}
        # cpu.stat and cgroup.kill/cgroup.freeze belong to the core: no controller needed.
        return frozenset(found | {CPU_ACCOUNTING, KILL})

    def _enabled(self) -> set[str]:
        return set(_fs.read(os.path.join(self.base, "cgroup.subtree_control")).split())

    def prepare(self, ours: Callable[[], set[int]] | None = None) -> None:
        """Enable the controllers in the base's cgroup.subtree_control, moving the processes
        ``ours()`` names into a leaf first when the no-internal-processes rule requires it: by
        default this helper and its launcher; the host process names itself and its launch
        processes (nsbox/host/launchprocess.py). Asked only then, not at every run."""
        if self._prepared:
            return
        missing = [c for c in self.controllers if c not in self._enabled()]
        if missing:
            control = os.path.join(self.base, "cgroup.subtree_control")
            change = " ".join(f"+{c}" for c in missing)
            try:
                _fs.write(control, change)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                self._move_into_leaf(ours() if ours is not None else {os.getpid(), os.getppid()})
                _fs.write(control, change)
        self._prepared = True

    def blocking(self, ours: set[int]) -> list[int]:
        """The processes in the base, other than ``ours``, that stop the controllers from being
        enabled for the run cgroups (cgroup v2's no-internal-processes rule; the root cgroup
        is exempt). Empty when the controllers are enabled already."""
        if not os.path.exists(os.path.join(self.base, "cgroup.events")):
            # The true root cgroup, exempt from the rule, alone has no cgroup.events; the root
            # of a cgroup namespace has one, and is not exempt.
            return []
        if set(self.controllers) <= self._enabled():
            return []
        return sorted(set(_fs.procs(self.base)) - ours)

    def blocking_reason(self, others: list[int]) -> str:
        return (
            f"cgroup {self.base} also holds processes {others[:5]} that are not nsbox's, so "
            "no controller can be enabled below it (cgroup v2's no-internal-processes rule); "
            f"start nsbox in a cgroup of its own, e.g. `{delegate_command()}`"
        )

    def _move_into_leaf(self, ours: set[int]) -> None:
        inside = set(_fs.procs(self.base))
        others = sorted(inside - ours)
        if others:
            raise OSError(errno.EBUSY, self.blocking_reason(others))
        leaf = os.path.join(self.base, naming.leaf_name())
        os.makedirs(leaf, exist_ok=True)
        for pid in sorted(inside):
            _fs.write(os.path.join(leaf, "cgroup.procs"), pid)

    def create(self, request: Request, name: str | None = None) -> RunCgroup:
        self.prepare()
        run = V2Run(os.path.join(self.base, name or naming.run_name()))
        os.mkdir(run.path, 0o755)
        try:
            run.set_limits(request)
        except BaseException:
            _fs.rmdir(run.path)
            raise
        return run

    def reclaim(self) -> list[str]:
        try:
            entries = os.listdir(self.base)
        except OSError:
            return []
        removed = []
        for name in sorted(entries):
            if not naming.owner_is_dead(name):
                continue
            path = os.path.join(self.base, name)
            if naming.is_leaf(name):
                # A leaf may still hold the launcher that outlived its helper: never kill it.
                if not _fs.procs(path):
                    with contextlib.suppress(OSError):
                        _fs.rmdir(path)
                        removed.append(name)
                continue
            try:
                V2Run(path).destroy()
            except OSError:
                continue  # tried again by the next process
            removed.append(name)
        return removed

    def describe(self) -> dict[str, Any]:
        enabled: list[str] = []
        others: list[int] = []
        try:
            enabled = sorted(self._enabled())
            # This process stands for the launcher (its helper will be its child); anything
            # else here would stop the controllers from being enabled (see _move_into_leaf).
            others = self.blocking({os.getpid()}) if self.controllers else []
        except OSError:
            pass
        return {
            "cgroup": self.base,
            "controllers": self.controllers,
            "subtree_control": enabled,
            "blocking_processes": others,
        }
