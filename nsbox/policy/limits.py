"""Resource limits of one run: cgroups where they can be written, rlimits always.

Three sides, like the launch itself:

- plan side (``plan_limits``): the Policy's Limits become plain data in the Plan: the rlimits
  every run gets, and the cgroup request with the rlimits to fall back on;
- helper side (``RunLimits``): creates the run's cgroup before the child is released, decides
  which rlimit fallbacks the child applies (``Enforcement``, which the launch engine's host side
  decides through as well), polls CPU time while the run lasts, reads the usage
  after it and removes the cgroup;
- result side (``apply_outcome``): the usage and the limit that ended the run go into the Result
  (status ML for an OOM kill, TO for the CPU-time limit).

The rlimits are the last line (setrlimit(2)): they hold even if the cgroup is escaped or missing.
RLIMIT_AS is only a fallback, as it limits address space, not memory: with a cgroup it would
break runtimes that reserve large address ranges (Go, Java, sanitizers) for no gain.
"""

from __future__ import annotations

import math
import os
import resource
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nsbox import cgroups
from nsbox.errors import HostError, PolicyError

if TYPE_CHECKING:  # the launch helper imports this module: keep its start small
    from nsbox.policy.policy import Limits
    from nsbox.result import Result

# Why each missing cgroup feature leaves the sandbox weaker, for Result.degraded and the docs.
DEGRADED = {
    cgroups.MEMORY: "memory: RLIMIT_AS per process only (address space, not resident memory; "
    "no total for the run, no OOM count)",
    cgroups.PIDS: "pids: RLIMIT_NPROC only (counts the sandbox user's tasks in its user "
    "namespace, not a cgroup's)",
    cgroups.CPUS: "cpus: not limited (no cgroup cpu controller)",
    cgroups.CPU_ACCOUNTING: "cpu_time: RLIMIT_CPU per process only (no total for the run); "
    "cpu time from rusage after exit",
}
# The Landlock mode has no user namespace: RLIMIT_NPROC counts the host uid's every process.
_DEGRADED_HOST_WIDE_PIDS = ("pids: RLIMIT_NPROC only, over the processes the sandbox's host uid "
                            "ran at its start (it counts all of that uid's, not a cgroup's)")


def _rlimit(resource_id: int, value: int) -> list[int]:
    # An unprivileged process cannot raise its hard limit (setrlimit(2), EPERM): keep the lower
    # of the two, which is never weaker than asked.
    _soft, hard = resource.getrlimit(resource_id)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    return [resource_id, value, value]


def _nproc_counts_per_user_namespace() -> bool:
    """Since Linux 5.14 the count behind RLIMIT_NPROC is kept per user namespace ("ucounts"), so
    in the sandbox's own user namespace it counts the sandbox's tasks alone."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


MSGQUEUE_BYTES = 256 * 1024  # a quarter of Linux's default (819200: mq_overview(7))
PENDING_SIGNALS = 4096


def plan_limits(limits: Limits) -> dict[str, Any]:
    """The Plan's part for limits: ``rlimits`` ([resource, soft, hard] lists) and ``cgroup``.
    The values were checked when the Limits were made (nsbox/policy/policy.py); a CPU share is
    checked here against the CPUs of this host, which a Policy does not know."""
    rlimits = [
        [resource.RLIMIT_CORE, 0, 0],  # no core dumps: they would write the sandbox's memory out
        _rlimit(resource.RLIMIT_NOFILE, limits.open_files),
        # Counted in the sandbox's user namespace and again for the user who launched it,
        # against that user's own limit (ucounts, Linux 5.14): without limits of its own a
        # sandbox's POSIX message queues took all of host root's 819200 bytes (root's
        # mq_open(3) then failed with EMFILE), and its queued signals could take root's
        # RLIMIT_SIGPENDING (sigqueue(3): EAGAIN). docs/limits.md, "Shared kernel resources".
        _rlimit(resource.RLIMIT_MSGQUEUE, MSGQUEUE_BYTES),
        _rlimit(resource.RLIMIT_SIGPENDING, PENDING_SIGNALS),
    ]
    if limits.file_size is not None:
        rlimits.append(_rlimit(resource.RLIMIT_FSIZE, limits.file_size))
    fallback: dict[str, list[list[int]]] = {}
    if limits.pids is not None:
        nproc = _rlimit(resource.RLIMIT_NPROC, limits.pids)
        if _nproc_counts_per_user_namespace():
            rlimits.append(nproc)
        else:
            # Older kernels count every process of the mapped host uid: a second line that could
            # stop a run from forking at all, so only where no pids cgroup exists.
            fallback[cgroups.PIDS] = [nproc]
    if limits.cpu_time is not None:
        # Whole seconds. Soft = hard: SIGKILL at the limit (setrlimit(2)). A SIGXCPU at a lower
        # soft limit would not even reach the command, which is its pid namespace's init and so
        # does not get signals it has not asked for (pid_namespaces(7)).
        rlimits.append(_rlimit(resource.RLIMIT_CPU, max(1, math.ceil(limits.cpu_time))))
    if limits.memory is not None:
        fallback[cgroups.MEMORY] = [_rlimit(resource.RLIMIT_AS, limits.memory)]
    if limits.cpus is not None:
        _check_cpus(limits.cpus)
    return {
        "rlimits": rlimits,
        "cgroup": {
            "memory": limits.memory,
            "pids": limits.pids,
            "cpus": limits.cpus,
            "cpu_time": limits.cpu_time,
            "require": limits.require_cgroup,
            "fallback_rlimits": fallback,
        },
    }


def _check_cpus(cpus: float) -> None:
    # A share above the CPUs the sandbox may run on (it inherits this process's affinity,
    # sched_setaffinity(2)) would be written as a quota that never holds: a limit that limits
    # nothing is refused here, where the host is known, not accepted as one.
    available = len(os.sched_getaffinity(0))
    if cpus > available:
        raise PolicyError(
            f"{cpus:g} is more than the {available} CPU(s) this process may run on: a quota "
            "that large limits nothing", key="limits.cpus",
            hint=f"give at most {available}, or none for no CPU limit")


def wanted_features(spec: dict[str, Any]) -> set[str]:
    wanted = set()
    if spec.get("memory") is not None:
        wanted.add(cgroups.MEMORY)
    if spec.get("pids") is not None:
        wanted.add(cgroups.PIDS)
    if spec.get("cpus") is not None:
        wanted.add(cgroups.CPUS)
    if spec.get("cpu_time") is not None:
        wanted.add(cgroups.CPU_ACCOUNTING)
    return wanted


class Enforcement:
    """How one run's limits are enforced, once it is known which cgroup features its cgroup
    gives (``supported``; ``reason``: why the others are missing): the notes of what degraded,
    the rlimits the child applies (with the fallbacks of what the cgroup cannot limit), and the
    outcome for the Result. The helper's RunLimits and the launch engine's run cgroup
    (nsbox/host/engine.py) are both made of it. HostError where the cgroup is required."""

    def __init__(self, spec: dict[str, Any], rlimits: list[list[int]],
                 supported: frozenset[str], reason: str) -> None:
        self.cpu_time: float | None = spec.get("cpu_time")
        wanted = wanted_features(spec)
        self.made = bool(wanted & supported)  # the run has a cgroup
        missing = wanted - supported
        if missing and spec.get("require"):
            raise HostError(
                f"cgroup limits are required, but {', '.join(sorted(missing))} cannot be "
                f"limited here: {reason}",
                feature="cgroup",
                hint="run `nsbox doctor`; or drop require_cgroup to accept rlimits instead",
            )
        why = reason or "this host's cgroups lack the controller"
        texts = dict(DEGRADED)
        if spec.get("host_wide_nproc"):
            texts[cgroups.PIDS] = _DEGRADED_HOST_WIDE_PIDS
        self.degraded = [f"{texts[f]} [{why}]" for f in sorted(missing)]
        self.rlimits = [list(r) for r in rlimits]
        for feature in sorted(missing):
            self.rlimits.extend(spec.get("fallback_rlimits", {}).get(feature, []))
        self.has_accounting = self.made and cgroups.CPU_ACCOUNTING in supported

    def outcome(self, usage: cgroups.Usage | None, cpu_time_exceeded: bool) -> dict[str, Any]:
        """The outcome after the run's main process exited (JSON-able, for the Result), from
        what its cgroup says it used (None: it had none)."""
        outcome: dict[str, Any] = {
            "degraded": self.degraded,
            "cpu_time": self.cpu_time,
            "cpu_time_exceeded": cpu_time_exceeded,
            "accounting": "rusage",
        }
        if usage is None:
            return outcome
        if self.has_accounting and usage.cpu_user is not None:
            outcome["accounting"] = "cgroup"
        outcome.update(
            peak_memory=usage.peak_memory, cpu_user=usage.cpu_user,
            cpu_system=usage.cpu_system, peak_pids=usage.peak_pids, oom_kills=usage.oom_kills,
        )
        if self.cpu_time is not None and usage.cpu_user is not None:
            total = usage.cpu_user + (usage.cpu_system or 0.0)
            outcome["cpu_time_exceeded"] = cpu_time_exceeded or total >= self.cpu_time
        return outcome


class RunLimits(Enforcement):
    """Helper side of one run's limits. Create before the clone, ``attach`` the child before
    releasing it, ``poll`` while it runs, ``finish`` after it exited, ``close`` always."""

    def __init__(
        self, spec: dict[str, Any], rlimits: list[list[int]],
        backend: cgroups.Backend | None = None,
        create: Callable[[cgroups.Request], cgroups.RunCgroup] | None = None,
    ) -> None:
        """``create`` makes the run's cgroup with its limits (default: the backend's create);
        the launch helper passes one that takes a cgroup made ahead (nsbox/helper/spawner.py)."""
        backend = backend if backend is not None else cgroups.get_backend()
        supported = backend.supports()
        reason = backend.reason
        self.cgroup: cgroups.RunCgroup | None = None
        if wanted_features(spec) & supported:
            try:
                self.cgroup = (create or backend.create)(cgroups.Request.from_dict(spec))
            except OSError as exc:
                supported, reason = frozenset(), str(exc)
        try:
            super().__init__(spec, rlimits, supported, reason)
        except HostError:
            self.close()  # the cgroup made for the controllers that are there
            raise
        self.cpu_time_exceeded = False

    def attach(self, pid: int) -> None:
        if self.cgroup is not None:
            self.cgroup.attach(pid)

    def poll_interval(self) -> float | None:
        """How often the helper should call ``poll`` (None: never needed)."""
        return 0.05 if self.cpu_time is not None and self.has_accounting else None

    def poll(self) -> bool:
        """Check the run's total CPU time; kill the run when it is over the limit. True then."""
        if self.cgroup is None or self.cpu_time is None or self.cpu_time_exceeded:
            return self.cpu_time_exceeded
        try:
            used = self.cgroup.cpu_seconds()
        except OSError:
            return False  # read again at the next poll; RLIMIT_CPU holds meanwhile
        if used is not None and used >= self.cpu_time:
            self.cpu_time_exceeded = True
            self.cgroup.kill_all()
        return self.cpu_time_exceeded

    def finish(self) -> dict[str, Any]:
        """The outcome after the run's main process exited (JSON-able, for the Result)."""
        if self.cgroup is None:
            return self.outcome(None, self.cpu_time_exceeded)
        # Processes that outlived the main one (daemons, orphans) are killed first, so the
        # figures below are final.
        self.cgroup.kill_all()
        return self.outcome(self.cgroup.usage(), self.cpu_time_exceeded)

    def close(self) -> None:
        """Remove the run's cgroup (kills whatever is left). Safe to call more than once."""
        if self.cgroup is not None:
            cgroup, self.cgroup = self.cgroup, None
            cgroup.destroy()


def note_disk(result: Result, workspace: str | None, size: int | None) -> None:
    """A host-directory workspace is bound as it is: nothing limits what the sandbox writes
    there but its filesystem's free space. Said in ``degraded`` unless the policy asks for no
    limit (``workspace_size`` None); docs/limits.md, "Disk"."""
    if workspace is not None and size is not None:
        result.degraded.append(
            f"disk: not limited: /workspace is the host directory {workspace!r} (a "
            "workspace_size limits only a tmpfs workspace; writes stop where its filesystem "
            "is full) [--workspace-size none: accept this]")


def apply_outcome(result: Result, outcome: dict[str, Any]) -> None:
    """Fill the Result from a RunLimits outcome and set ML / TO where a limit ended the run."""
    from nsbox.result import Status

    result.degraded.extend(outcome.get("degraded", []))
    if outcome.get("accounting") == "cgroup":
        result.accounting = "cgroup"
        result.cpu_user = outcome["cpu_user"]
        result.cpu_system = outcome["cpu_system"] or 0.0
    if outcome.get("peak_memory") is not None:
        result.peak_memory = outcome["peak_memory"]
    if outcome.get("peak_pids") is not None:
        result.peak_pids = outcome["peak_pids"]
    if outcome.get("oom_kills"):
        result.oom_killed = True
    if result.status in (Status.OK, Status.XX, Status.TO, Status.OL):
        return
    # An OOM kill is a SIGKILL like any other; the cgroup's count tells them apart.
    if result.oom_killed:
        result.status = Status.ML
        result.extra["limit"] = "memory"
        return
    # Without a cgroup, RLIMIT_CPU ends the run with SIGKILL at the limit (SIGXCPU when a
    # process lowered its own soft limit). The kernel checks that limit against tick-sampled
    # CPU time, while rusage is scaled to the precise runtime: under load the two differ (seen
    # here: killed at 0.8 s of rusage for a 1 s limit). The helper's own kills have set another
    # status already, so a SIGKILL after half the limit is taken as the limit's.
    cpu_time = outcome.get("cpu_time")
    cpu_signal = cpu_time is not None and (
        result.signal == signal.SIGXCPU
        or (result.signal == signal.SIGKILL
            and result.cpu_user + result.cpu_system >= 0.5 * math.ceil(cpu_time))
    )
    if outcome.get("cpu_time_exceeded") or cpu_signal:
        result.status = Status.TO
        result.timed_out = True
        result.extra["limit"] = "cpu_time"
