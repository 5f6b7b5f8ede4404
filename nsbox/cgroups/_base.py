"""The interface of the cgroup backends: what a run asks for (Request), what it used (Usage),
the cgroup of one run (RunCgroup) and a backend (Backend). The package (nsbox/cgroups/__init__.py)
chooses the backend; each backend (_v2, _v1, _null) implements this interface.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nsbox.cgroups import _fs

# What a backend can enforce or measure; ``supports`` returns a subset of these.
MEMORY = "memory"  # a hard memory limit without swap, with an OOM-kill count
PIDS = "pids"  # a limit on tasks (processes and threads)
CPUS = "cpus"  # a bandwidth limit: a share of cores
CPU_ACCOUNTING = "cpu_accounting"  # cpu time of every process of the run, also while it runs
KILL = "kill"  # kill every process of the run, also those that left the pid namespace's tree
ALL_FEATURES = frozenset({MEMORY, PIDS, CPUS, CPU_ACCOUNTING, KILL})


@dataclass(frozen=True)
class Request:
    """The limits of one run; None means unlimited."""

    memory: int | None = None  # bytes
    pids: int | None = None
    cpus: float | None = None  # share of cores, e.g. 0.5

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Request:
        return cls(memory=data.get("memory"), pids=data.get("pids"), cpus=data.get("cpus"))


@dataclass
class Usage:
    """What a run used, read from its cgroup. None: this backend cannot tell."""

    peak_memory: int | None = None  # bytes
    cpu_user: float | None = None  # seconds
    cpu_system: float | None = None
    peak_pids: int | None = None
    oom_kills: int = 0


@dataclass(frozen=True)
class Figure:
    """Where one figure of a run's usage is read: a file of its cgroup, the key of a flat keyed
    file (cpu.stat, memory.events; "" for a file that holds one number), and the factor from the
    file's unit to Usage's (seconds, bytes, counts). The backends read them (``read_usage``);
    the launch engine reads the same files and hands back the raw numbers (``usage_from``)."""

    field: str  # a field of Usage ("cpu" for the CPU time that is polled while a run lasts)
    path: str
    key: str = ""
    scale: float = 1

    def read(self) -> int | None:
        """The raw number; None where the file or the key is missing (older kernels)."""
        return _fs.read_keyed(self.path).get(self.key) if self.key else _fs.read_int(self.path)


def usage_from(figures: list[Figure], values: Mapping[str, int | None]) -> Usage:
    """A run's Usage from the raw numbers of ``figures``, by field (None: not there)."""
    found: dict[str, Any] = {f.field: v if f.scale == 1 else v * f.scale
                             for f in figures if (v := values.get(f.field)) is not None}
    return Usage(**found)


def read_usage(figures: list[Figure]) -> Usage:
    """The figures read now; a keyed file that holds several (cpu.stat) is read once."""
    keyed = {f.path: _fs.read_keyed(f.path) for f in figures if f.key}
    return usage_from(figures, {f.field: keyed[f.path].get(f.key) if f.key
                                else _fs.read_int(f.path) for f in figures})


def read_seconds(figure: Figure | None) -> float | None:
    """The CPU time of ``figure`` in seconds; None without one."""
    if figure is None:
        return None
    value = figure.read()
    return None if value is None else value * figure.scale


class RunCgroup(abc.ABC):
    """The cgroup (one per hierarchy) of one run."""

    name: str

    @abc.abstractmethod
    def set_limits(self, request: Request) -> None:
        """Write the limits of ``request`` that are set (None: leave that limit as it is)."""

    @abc.abstractmethod
    def attach(self, pid: int) -> None:
        """Move ``pid`` (not yet running untrusted code) into the run's cgroup."""

    @abc.abstractmethod
    def reset_peak_memory(self) -> None:
        """Count the peak memory from now on (after a spawner has left, nsbox/helper/spawner.py)."""

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` file of each hierarchy: a process that writes its own pid into
        each moves itself in (the native spawner, nsbox/native/spawner.c); [] for none."""
        return []

    def clone_fd(self) -> int | None:
        """A directory descriptor to clone the run's first process into the cgroup at once
        (clone3 with CLONE_INTO_CGROUP; cgroup v2 only), or None: ``attach`` it instead."""
        return None

    @abc.abstractmethod
    def cpu_seconds(self) -> float | None:
        """CPU time used so far by every process of the run (cheap; polled while it runs)."""

    @abc.abstractmethod
    def usage(self) -> Usage:
        """Peak memory, CPU time, peak task count and OOM kills of the run so far."""

    @abc.abstractmethod
    def pids(self) -> list[int]:
        """The processes in the run's cgroup now."""

    @abc.abstractmethod
    def kill_all(self) -> None:
        """SIGKILL every process of the run, race-free where the kernel allows it."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Kill what is left and remove the cgroup; safe to call more than once."""


class Backend(abc.ABC):
    kind: str  # "v2", "v1" or "none"
    reason: str = ""  # why limits are missing (for the Result and `nsbox doctor`)

    @abc.abstractmethod
    def supports(self) -> frozenset[str]:
        """Which of ALL_FEATURES this backend really provides on this host for this user."""

    @abc.abstractmethod
    def create(self, request: Request, name: str | None = None) -> RunCgroup:
        """Create the cgroup of one run with its limits written (``name``: default a new run
        name, see ``naming``). Raises OSError when the kernel refuses (the caller turns that
        into an error naming the step)."""

    @abc.abstractmethod
    def reclaim(self) -> list[str]:
        """Kill and remove the run cgroups of dead owners (our naming scheme only, below our own
        cgroup only). Returns the names removed."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """The backend's view of the host, for `nsbox doctor` (read-only)."""
