"""cgroup v1 controllers (a v1-only or hybrid host), plus the cgroup2 core where it is mounted.

One run has a directory in every hierarchy nsbox uses (co-mounted controllers such as
``cpu,cpuacct`` share one). v1 has no "no internal processes" rule, so run cgroups are plain
children of this process's own cgroup. The memory and cpu limits are written through cgroupspy's
controller objects; pids and freezer, which it does not model, as plain files. What a run used is
read from the files that ``usage_figures`` names, which the launch engine reads as well.

On a hybrid host the cgroup2 mount has no controllers, but it still gives what v1 lacks: a
race-free ``cgroup.kill`` (Linux 5.14) and an exact ``cgroup.events`` "populated" flag. Without it,
killing falls back to the v1 freezer (freeze, SIGKILL every pid, thaw), so nothing can fork while
the pids are collected.
"""

from __future__ import annotations

import importlib.util
import os
import sys
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
from nsbox.cgroups._host import THIS_HOST, Hierarchy, HostView

CFS_PERIOD_US = 100_000


def usage_figures(dirs: dict[str, str], unified: str | None) -> list[Figure]:
    """Where a run's usage is read, from its directory in each hierarchy (``dirs``, by
    controller) and in the cgroup2 mount (``unified``): V1Run.usage, the launch engine."""
    figures = []
    if "memory" in dirs:
        memory = dirs["memory"]
        figures.append(Figure("peak_memory", os.path.join(memory, "memory.max_usage_in_bytes")))
        # oom_kill in memory.oom_control counts OOM kills in this cgroup (Linux 4.13).
        figures.append(Figure("oom_kills", os.path.join(memory, "memory.oom_control"), "oom_kill"))
    if "cpuacct" in dirs:
        acct = dirs["cpuacct"]
        figures.append(Figure("cpu_user", os.path.join(acct, "cpuacct.usage_user"), scale=1e-9))
        figures.append(Figure("cpu_system", os.path.join(acct, "cpuacct.usage_sys"), scale=1e-9))
    elif unified:
        stat = os.path.join(unified, "cpu.stat")
        figures.append(Figure("cpu_user", stat, "user_usec", 1e-6))
        figures.append(Figure("cpu_system", stat, "system_usec", 1e-6))
    if "pids" in dirs:
        figures.append(Figure("peak_pids", os.path.join(dirs["pids"], "pids.peak")))
    return figures


def cpu_figure(dirs: dict[str, str], unified: str | None) -> Figure | None:
    """Where the CPU time of every process of a run is polled (None: nowhere)."""
    if "cpuacct" in dirs:
        return Figure("cpu", os.path.join(dirs["cpuacct"], "cpuacct.usage"), scale=1e-9)
    if unified:
        return Figure("cpu", os.path.join(unified, "cpu.stat"), "usage_usec", 1e-6)
    return None


class V1Run(RunCgroup):
    def __init__(self, name: str, dirs: dict[str, str], unified: str | None) -> None:
        self.name = name
        self.dirs = dirs  # controller -> this run's directory in that hierarchy
        self.unified = unified  # this run's directory in the cgroup2 mount, if any
        self._all = sorted(set(dirs.values()) | ({unified} if unified else set()))

    def _ctl(self, controller: str) -> Any:
        # Imported here: the launch helper starts with `python3 -I -S` and imports what it needs
        # on first use only.
        from cgroupspy.controllers import CpuController, MemoryController
        from cgroupspy.nodes import Node

        return {"memory": MemoryController, "cpu": CpuController}[controller](
            Node(os.fsencode(self.dirs[controller])))

    def set_limits(self, request: Request) -> None:
        if request.memory is not None and "memory" in self.dirs:
            memory = self._ctl("memory")
            memory.limit_in_bytes = request.memory
            # memsw caps memory plus swap: equal to the limit means "no swap" (cgroup-v1
            # memory.rst, 2.4). It only exists with swap accounting compiled in.
            if os.path.exists(os.path.join(self.dirs["memory"], "memory.memsw.limit_in_bytes")):
                memory.memsw_limit_in_bytes = request.memory
        if request.pids is not None and "pids" in self.dirs:
            _fs.write(os.path.join(self.dirs["pids"], "pids.max"), request.pids)
        if request.cpus is not None and "cpu" in self.dirs:
            cpu = self._ctl("cpu")
            cpu.cfs_period_us = CFS_PERIOD_US
            cpu.cfs_quota_us = max(1000, round(request.cpus * CFS_PERIOD_US))

    def reset_peak_memory(self) -> None:
        # Writing 0 resets max_usage_in_bytes to the current usage (cgroup-v1 memory.rst 5.4).
        if "memory" in self.dirs:
            _fs.write(os.path.join(self.dirs["memory"], "memory.max_usage_in_bytes"), 0)

    def procs_files(self) -> list[str]:
        return [os.path.join(directory, "cgroup.procs") for directory in self._all]

    def attach(self, pid: int) -> None:
        for directory in self._all:
            _fs.write(os.path.join(directory, "cgroup.procs"), pid)

    def cpu_seconds(self) -> float | None:
        return read_seconds(cpu_figure(self.dirs, self.unified))

    def usage(self) -> Usage:
        return read_usage(usage_figures(self.dirs, self.unified))

    def pids(self) -> list[int]:
        found: set[int] = set()
        for directory in self._all:
            found.update(_fs.procs(directory))
        return sorted(found)

    def _empty(self) -> bool:
        if self.unified and os.path.isdir(self.unified):
            return _fs.read_keyed(os.path.join(self.unified, "cgroup.events")).get("populated") == 0
        return not self.pids()

    def kill_all(self) -> None:
        if self.unified and os.path.exists(os.path.join(self.unified, "cgroup.kill")):
            _fs.write(os.path.join(self.unified, "cgroup.kill"), 1)
            return
        freezer = self.dirs.get("freezer")
        if freezer and os.path.isdir(freezer):
            # Frozen tasks cannot fork, so one pass over cgroup.procs finds them all; SIGKILL is
            # delivered once they are thawed (cgroup-v1 freezer-subsystem.rst).
            _fs.write(os.path.join(freezer, "freezer.state"), "FROZEN")
            _fs.kill_pids(_fs.procs(freezer))
            _fs.write(os.path.join(freezer, "freezer.state"), "THAWED")
        # Without freezer (or for tasks that raced in): repeat until nothing is left.
        for _ in range(100):
            pids = self.pids()
            if not pids:
                break
            _fs.kill_pids(pids)

    def destroy(self) -> None:
        present = [d for d in self._all if os.path.isdir(d)]
        if not present:
            return
        self.kill_all()
        if not _fs.wait_until(self._empty):
            raise OSError(16, f"cgroup {self.name}: processes {self.pids()} did not exit")
        for directory in present:
            _fs.rmdir(directory)


class V1Backend(Backend):
    kind = "v1"

    def __init__(
        self, v1: dict[str, Hierarchy], unified: Hierarchy | None, view: HostView = THIS_HOST
    ) -> None:
        self.bases = {
            name: h.own_dir for name, h in v1.items() if _fs.writable(h.own_dir, view)
        }
        self.unified_base = (
            unified.own_dir
            if unified is not None and _fs.writable(unified.own_dir, view)
            else None
        )
        self.reason = ""
        if not self.supports():
            read_only = sorted(n for n, h in v1.items() if _fs.read_only(h.own_dir))
            if read_only:
                # A container's cgroupfs: no uid may write it, whatever the modes say.
                self.reason = (
                    f"the v1 cgroups of this process ({', '.join(read_only)}) are on read-only "
                    "mounts"
                )
            else:
                self.reason = (
                    f"the v1 cgroups of this process ({', '.join(sorted(v1))}) are not "
                    f"writable by uid {view.euid}"
                )
        elif importlib.util.find_spec("cgroupspy") is None:
            # The launcher puts cgroupspy on the helper's path; an interpreter without it
            # cannot drive v1 here, and says so instead of limiting less in silence.
            self.bases, self.unified_base = {}, None
            self.reason = f"cgroupspy (for cgroup v1) cannot be imported by {sys.executable}"

    def supports(self) -> frozenset[str]:
        found = set()
        if "memory" in self.bases:
            found.add(MEMORY)
        if "pids" in self.bases:
            found.add(PIDS)
        if "cpu" in self.bases:
            found.add(CPUS)
        if "cpuacct" in self.bases or self.unified_base:
            found.add(CPU_ACCOUNTING)
        if not found:
            return frozenset()
        if self.unified_base or "freezer" in self.bases or "pids" in self.bases:
            found.add(KILL)
        return frozenset(found)

    def _open(self, name: str) -> V1Run:
        dirs = {c: os.path.join(base, name) for c, base in self.bases.items()}
        unified = os.path.join(self.unified_base, name) if self.unified_base else None
        return V1Run(name, dirs, unified)

    def create(self, request: Request, name: str | None = None) -> RunCgroup:
        run = self._open(name or naming.run_name())
        made = []
        try:
            for directory in run._all:
                os.mkdir(directory, 0o755)
                made.append(directory)
            run.set_limits(request)
        except BaseException:
            for directory in reversed(made):
                _fs.rmdir(directory)
            raise
        return run

    def reclaim(self) -> list[str]:
        names: set[str] = set()
        for base in [*self.bases.values(), self.unified_base]:
            if base is None:
                continue
            try:
                entries = os.listdir(base)
            except OSError:
                continue
            names.update(n for n in entries if naming.owner_is_dead(n))
        removed = []
        for name in sorted(names):
            try:
                self._open(name).destroy()
            except OSError:
                continue  # tried again by the next process
            removed.append(name)
        return removed

    def describe(self) -> dict[str, Any]:
        return {
            "cgroups": {c: base for c, base in sorted(self.bases.items())},
            "unified": self.unified_base,
        }
