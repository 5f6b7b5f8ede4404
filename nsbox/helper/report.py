"""The end of a launch on the helper's side: the run's usage read from its cgroup, the exit
report (``{"event": "exit", ...}``, nsbox/_sys/wire.py's ExitReport) and the cgroup's removal."""

from __future__ import annotations

import resource
from typing import Any

from nsbox._sys.wire import ExitReport
from nsbox.helper.launch import Launch
from nsbox.sandbox import child as _child
from nsbox.sandbox import diskfull


def exit_report(launch: Launch, wait_status: int, rusage: resource.struct_rusage,
                wall: float, reaped_ns: int, denied: list[str] | None) -> ExitReport:
    """The report of a reaped launch whose error pipe has been read to its end: the command's
    status (as pid 1 reported it, _child.command_status), its resources and the limits' outcome
    (the cgroup is left for ``remove_cgroup``, after the report is out)."""
    child_trace, setup_error, reported = _child.read_report(launch.err_data)
    status = _child.command_status(wait_status, reported)
    limits = close_limits(launch, remove=False)
    report: ExitReport = {
        "event": "exit",
        "wait_status": status,
        "wall_time": wall,
        "cpu_user": rusage.ru_utime,
        "cpu_system": rusage.ru_stime,
        "maxrss_kib": rusage.ru_maxrss,
        "timed_out": launch.timed_out,
        "kill_reason": launch.kill_reason,
        "setup_error": launch.internal_error or setup_error,  # the helper's is the cause
        "seccomp_denied": denied,
        "limits": limits,
        "core": launch.core,
        "disk_full": diskfull.disk_full(launch.err_data),
    }
    if launch.trace is not None:
        report["trace"] = [*launch.trace, *child_trace, ("helper: reaped", reaped_ns)]
    return report


def close_limits(launch: Launch, remove: bool = True) -> dict[str, Any]:
    """Read the run's usage, then remove its cgroup (killing what is left in it).

    ``remove=False`` leaves the removal to ``remove_cgroup``, after the report is out.
    """
    if launch.limits is None:
        return {}
    limits = launch.limits
    try:
        outcome = limits.finish()
    except OSError as exc:
        outcome = {"degraded": limits.degraded, "usage_error": str(exc)}
    if remove:
        launch.limits = None
        try:
            limits.close()
        except OSError as exc:  # left behind for the next helper to reclaim
            outcome["cleanup_error"] = str(exc)
    return outcome


def remove_cgroup(launch: Launch) -> None:
    # After the report: removing the cgroups takes about 0.25 ms that the caller need not
    # wait for. Everything in them was killed by finish(); one that cannot be removed now
    # is left behind for the next helper to reclaim (nsbox/cgroups).
    limits, launch.limits = launch.limits, None
    if limits is not None:
        try:
            limits.close()
        except OSError:
            pass
