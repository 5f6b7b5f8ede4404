"""Per-run cgroups: one interface, one class per host type, chosen once per process.

    backend = cgroups.get_backend()          # inspects the host once
    run = backend.create(Request(memory=256 << 20, pids=64, cpus=0.5))
    run.attach(child_pid)                    # before the child is released
    ...                                      # run.cpu_seconds() while it runs
    usage = run.usage()                      # after it exited
    run.destroy()                            # kill what is left, remove the cgroup

Backends: ``V2Backend`` (unified hierarchy with controllers), ``V1Backend`` (the v1 controllers of
a v1 or hybrid host, plus the cgroup2 mount's cgroup.kill where it exists) and ``NullBackend``
(no writable cgroup: nothing is limited here, the caller falls back to rlimits). Callers never
branch on the version: they ask ``backend.supports`` which limits are real.

Every cgroup is created below this process's own cgroup in each hierarchy and carries a name that
identifies its owner (see ``naming``), so a later process can reclaim the cgroups of a dead one.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING, Any, TypeGuard

from nsbox.cgroups._base import (
    ALL_FEATURES,
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
    usage_from,
)
from nsbox.cgroups._fs import procs
from nsbox.cgroups._host import THIS_HOST, HostView, Layout, read_layout

if TYPE_CHECKING:
    from nsbox.cgroups._v2 import V2Backend

_backend: Backend | None = None
_backend_lock = threading.Lock()  # threads' first runs detect and reclaim once, not each


def delegate_command(uid: int | None = None) -> str:
    """The command that starts nsbox in a cgroup of its own, delegated to ``uid`` (the doctor's
    remedy; nsbox/cgroups/_v2.py)."""
    from nsbox.cgroups import _v2

    return _v2.delegate_command(uid)


def v2_limit_writes(request: Request) -> list[tuple[str, str, bool]]:
    """The files of a cgroup v2 run's directory that ``request`` is written to: (name, value,
    whether it may be missing). The launch engine writes them (nsbox/host/engine.py)."""
    from nsbox.cgroups import _v2

    return _v2.limit_writes(request)


def v1_usage_figures(dirs: dict[str, str], unified: str | None) -> list[Figure]:
    """Where a cgroup v1 run's usage is read (nsbox/cgroups/_v1.py): the launch engine reads
    the same files."""
    from nsbox.cgroups import _v1

    return _v1.usage_figures(dirs, unified)


def v1_cpu_figure(dirs: dict[str, str], unified: str | None) -> Figure | None:
    from nsbox.cgroups import _v1

    return _v1.cpu_figure(dirs, unified)


def v2_usage_figures(run: str) -> list[Figure]:
    """Where a cgroup v2 run's usage is read (nsbox/cgroups/_v2.py), for the launch engine."""
    from nsbox.cgroups import _v2

    return _v2.usage_figures(run)


def v2_cpu_figure(run: str) -> Figure:
    from nsbox.cgroups import _v2

    return _v2.cpu_figure(run)


def is_unified(backend: Backend) -> TypeGuard[V2Backend]:
    """Whether ``backend`` is the unified hierarchy's (cgroup v2)."""
    from nsbox.cgroups._v2 import V2Backend

    return isinstance(backend, V2Backend)


def helper_paths() -> list[str]:
    """Where the launch helper, which runs isolated (``python3 -I -S``), finds cgroupspy: the
    directory this process would import it from. Found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("cgroupspy")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [os.path.dirname(list(spec.submodule_search_locations)[0])]


def detect(layout: Layout | None = None, view: HostView = THIS_HOST) -> Backend:
    """Choose the backend for this host and user (or for the simulated host and uid of
    ``view``). Reads the host, changes nothing.

    The backend that can enforce the most wins: the unified hierarchy when its own cgroup offers
    the controllers (pure v2, or a hybrid host that moved them there), else the v1 controllers;
    without any writable cgroup, the null backend with the reasons.
    """
    from nsbox.cgroups._null import NullBackend
    from nsbox.cgroups._v1 import V1Backend
    from nsbox.cgroups._v2 import V2Backend

    layout = layout if layout is not None else read_layout(view=view)
    candidates: list[Backend] = []
    if layout.unified is not None:
        candidates.append(V2Backend(layout.unified, view))
    if layout.v1:
        candidates.append(V1Backend(layout.v1, layout.unified, view))
    # On a hybrid host some controllers may sit on each side: take the backend that can do the
    # most (v2 first on a tie).
    usable = [b for b in candidates if b.supports()]
    if usable:
        return max(usable, key=lambda b: len(b.supports()))
    reasons = [b.reason for b in candidates]
    if layout.kind == "none":
        reasons.append("no cgroup filesystem is mounted")
    return NullBackend("; ".join(r for r in reasons if r))


def get_backend() -> Backend:
    """The backend of this process, detected on first use; the cgroups that dead owners left
    behind (a launcher or helper that was SIGKILLed mid-run) are reclaimed then."""
    global _backend
    with _backend_lock:
        if _backend is None:
            backend = detect()
            # Best effort: a leftover that cannot be removed now is tried again by the next
            # process, and must not stop this one from running.
            with contextlib.suppress(OSError):
                backend.reclaim()
            _backend = backend
        return _backend


def describe_host(layout: Layout | None = None, view: HostView = THIS_HOST) -> dict[str, Any]:
    """What `nsbox doctor` shows about cgroups: the layout, the backend that would be used, the
    controllers it can use, whether this user can write a cgroup, and why not. Read-only.
    ``view``: a simulated host and uid instead of this one (the layout is read there)."""
    layout = layout if layout is not None else read_layout(view=view)
    backend = detect(layout, view)
    uid = os.getuid() if view.uid is None else view.uid
    info: dict[str, Any] = {
        "layout": layout.kind,
        "backend": backend.kind,
        "writable": backend.kind != "none",
        "supports": sorted(backend.supports()),
        "missing": sorted(ALL_FEATURES - backend.supports()),
        "reason": backend.reason,
        # A systemd user manager can give an unprivileged user a delegated cgroup:
        # `systemd-run --user --scope -p Delegate=yes <launcher>` (systemd.resource-control(5)).
        "systemd_user_manager": os.path.exists(view.path(f"/run/user/{uid}/systemd/private")),
    }
    info.update(backend.describe())
    from nsbox.cgroups import _fs
    from nsbox.cgroups._v2 import V2Backend

    blocking = info.get("blocking_processes")
    if blocking and isinstance(backend, V2Backend):
        # What a run then gets (nsbox.policy.limits.RunLimits): creating its cgroup fails with this
        # reason, and every limit falls back to an rlimit.
        info["supports"], info["missing"] = [], sorted(ALL_FEATURES)
        info["reason"] = backend.blocking_reason(blocking)
    # A container's cgroupfs is mounted read-only: then no delegation helps.
    hierarchies = [h for h in (layout.unified, *layout.v1.values()) if h is not None]
    info["read_only"] = bool(info["missing"]) and any(
        _fs.read_only(h.own_dir) for h in hierarchies)
    return info


__all__ = [
    "ALL_FEATURES", "CPUS", "CPU_ACCOUNTING", "KILL", "MEMORY", "PIDS", "THIS_HOST", "Backend",
    "Figure", "HostView", "Layout", "Request", "RunCgroup", "Usage", "delegate_command",
    "describe_host", "detect", "get_backend", "is_unified", "procs", "read_layout", "usage_from",
]
