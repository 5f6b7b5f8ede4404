"""bwrap in a cgroup of its own, with the memory and pids limits of nsbox's default policy, made
by the caller the way a bwrap user does it: mkdir below the caller's own cgroup, write the
limits, start bwrap attached to it, wait, rmdir.

bwrap itself makes no cgroup, so this is the work a bwrap user adds to get what nsbox's default
policy gives. The directories are found with nsbox's own detection (the caller's cgroup in the
memory and pids hierarchies; on cgroup v2 the base in which nsbox enabled the controllers, which
a bwrap user's delegated cgroup must have done too); every per-launch step is a plain file
operation. The child attaches itself (a ``preexec_fn`` that writes its pid into each
cgroup.procs) before it execs bwrap: a process moved in after the start could run before it is
limited. On cgroup v1 that write waits for an RCU grace period unless another migration just
happened (docs/performance.md, "The cgroup of a run"): that is part of what this costs.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable

import nsbox
from nsbox import cgroups

_counter = itertools.count(1)


def bases() -> tuple[str, dict[str, str]] | str:
    """(cgroup version, {controller: directory to make run cgroups in}) for memory and pids, or
    why there is none (not root and no delegated cgroup)."""
    backend = cgroups.get_backend()
    wanted = {cgroups.MEMORY, cgroups.PIDS}
    if not wanted <= backend.supports():
        return (f"no writable cgroup with memory and pids for uid {os.geteuid()} "
                f"({backend.reason or 'this host lacks the controllers'}): needs root or a "
                "delegated cgroup")
    if cgroups.is_unified(backend):
        # The controllers enabled for the children of the base (moving this process into a
        # leaf if the no-internal-processes rule demands it): the delegation a bwrap user's
        # service has too. Done once, not per launch.
        backend.prepare()
        return "v2", {"memory": backend.base, "pids": backend.base}
    bases_v1 = getattr(backend, "bases", {})
    return "v1", {"memory": bases_v1["memory"], "pids": bases_v1["pids"]}


def limit_files(version: str, dirs: dict[str, str]) -> list[tuple[str, str]]:
    """(file, value) to write into a fresh cgroup: the default policy's memory (no swap) and pids
    limits."""
    limits = nsbox.Policy().limits
    memory, pids = str(limits.memory), str(limits.pids)
    if version == "v2":
        files = [(os.path.join(dirs["memory"], "memory.max"), memory)]
        swap = os.path.join(dirs["memory"], "memory.swap.max")
        return [*files, (swap, "0"), (os.path.join(dirs["pids"], "pids.max"), pids)]
    files = [(os.path.join(dirs["memory"], "memory.limit_in_bytes"), memory),
             # memory plus swap equal to memory: no swap (cgroup-v1 memory.rst 2.4)
             (os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes"), memory)]
    return [*files, (os.path.join(dirs["pids"], "pids.max"), pids)]


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _rmdir(directory: str) -> None:
    # The last process leaves its cgroup a moment after it was reaped: EBUSY until then.
    for _ in range(200):
        try:
            os.rmdir(directory)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        time.sleep(0.001)
    os.rmdir(directory)


def in_fresh_cgroup(version: str, base_dirs: dict[str, str],
                    launch: Callable[[Callable[[], None]], None]) -> None:
    """Make a cgroup in each hierarchy, write the limits, ``launch(attach)`` (attach is the
    child's preexec_fn), then remove the cgroup."""
    name = f"bench-bwrap-{os.getpid()}-{next(_counter)}"
    dirs = {c: os.path.join(base, name) for c, base in base_dirs.items()}
    made = []
    try:
        for directory in sorted(set(dirs.values())):
            os.mkdir(directory, 0o755)
            made.append(directory)
        for path, value in limit_files(version, dirs):
            if not path.endswith((".memsw.limit_in_bytes", ".swap.max")) or os.path.exists(path):
                _write(path, value)
        procs = [os.path.join(d, "cgroup.procs") for d in made]

        def attach() -> None:  # in the child, before it execs bwrap
            pid = str(os.getpid())
            for path in procs:
                _write(path, pid)

        launch(attach)
    finally:
        for directory in reversed(made):
            _rmdir(directory)
