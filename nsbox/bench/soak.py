"""The leak soak: many sequential launches, then count what was left behind.

Counted before and after (after a warm-up, so that one-time caches do not count as growth):
host mounts, the cgroups nsbox made for this process below its own cgroup, open descriptors of
this process and of the launch helper, zombies and leftover children of either, and resident
memory.
"""

from __future__ import annotations

import os
import time
from typing import Any

import nsbox
from nsbox import cgroups
from nsbox._sys import mountinfo as _mountinfo
from nsbox.cgroups import naming
from nsbox.helper.spawner import READY
from nsbox.host import engine
from nsbox.launch import launcher


def _cgroup_dirs() -> list[str]:
    """This process's own cgroup directory in every mounted hierarchy."""
    mounts: list[tuple[str, str, set[str]]] = []
    with open("/proc/self/mountinfo") as f:
        for mount in _mountinfo.parse(f.read()):
            if mount.fstype in ("cgroup", "cgroup2"):
                mounts.append((mount.fstype, mount.point, set(mount.options)))
    dirs = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            for fstype, point, flags in mounts:
                if (hid == "0" and fstype == "cgroup2") or (
                        fstype == "cgroup" and controllers
                        and set(controllers.split(",")) <= flags | {
                            o.partition("=")[2] for o in flags if o.startswith("name=")}):
                    dirs.append(os.path.join(point, path.lstrip("/")))
    return [d for d in dirs if os.path.isdir(d)]


def _count_cgroups_below(owners: set[int], spares: bool = False) -> int:
    """The cgroups below this process's own that nsbox made for ``owners`` (by the owner pid in
    their names, nsbox/cgroups/naming.py): other programs may share our cgroup and make their
    own there. Runs' cgroups, or with ``spares`` the idle spares (nsbox/helper/spawner.py)."""
    count = 0
    for directory in _cgroup_dirs():
        for root, subdirs, _files in os.walk(directory):
            for name in subdirs:
                parsed = naming.parse(name)
                if parsed is None or parsed[1] not in owners or parsed[3] == "leaf":
                    continue
                try:
                    idle = naming.is_idle_spare(name, cgroups.procs(os.path.join(root, name)))
                except OSError:
                    continue  # removed meanwhile
                count += idle == spares
    return count


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def children_of(parents: set[int]) -> list[tuple[int, str]]:
    """(pid, state letter) of every process whose parent is one of ``parents`` (proc(5): the
    fields after the command name, which may hold spaces and parentheses)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) in parents:
            found.append((int(entry), fields[0]))
    return found


def _children(parents: set[int]) -> tuple[int, int, int]:
    """(zombies, live children, spawners) whose parent is one of ``parents``; spawners are not
    counted as live children."""
    zombies = live = spawners = 0
    for pid, state in children_of(parents):
        if state == "Z":
            zombies += 1
        elif naming.is_spawner(pid):
            spawners += 1
        else:
            live += 1
    return zombies, live, spawners


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:  # no such process (no launch helper: another launch core)
        pass
    return -1


def _launch_processes_kib() -> int:
    """The resident memory of this process's children that outlive a launch (the launch
    helper, or whatever launch process the launcher keeps): the sandboxes are theirs."""
    from nsbox.bench.meter import children

    return sum(max(0, _rss_kib(pid)) for pid in children())


def snapshot() -> dict[str, int]:
    # The launch processes this process keeps: the launch helper and the launch engine, either
    # or both (sessions and pools take the helper, one-shot runs the engine).
    keepers = {pid for pid in (launcher.helper_client.pid, engine.client.pid) if pid}
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for _ in f)
    zombies, live, spawners = _children({os.getpid(), *keepers})
    return {
        "host_mounts": mounts,
        "cgroups_below_ours": _count_cgroups_below({*keepers, os.getpid()}),
        "spare_cgroups": _count_cgroups_below(keepers, spares=True),
        "spawners": spawners,
        "fds_launcher": _fds(os.getpid()),
        "fds_helper": sum(_fds(pid) for pid in keepers),
        "zombies": zombies,
        "children_left": live - len(keepers),  # the launch processes themselves are ours
        "keepers": len(keepers),
        "rss_kib_launcher": _rss_kib(os.getpid()),
        "rss_kib_helper": sum(max(0, _rss_kib(pid)) for pid in keepers),
        "rss_kib_launch_processes": _launch_processes_kib(),
    }


def settled_snapshot(timeout: float = 5.0) -> dict[str, int]:
    """A snapshot once two taken 50 ms apart agree: a spawner being made (forked, moving into
    its cgroup, named) or a sandbox being reaped is in transit, not left behind."""
    current = snapshot()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        previous, current = current, snapshot()
        steady = ("cgroups_below_ours", "spare_cgroups", "spawners", "zombies",
                  "children_left")
        if all(previous[key] == current[key] for key in steady):
            break
    return current


def soak(argv: list[str], launches: int, warmup: int = 200, pool_size: int = 0,
         progress: Any = None) -> dict[str, Any]:
    """``launches`` sequential launches of ``argv`` (through a pool when ``pool_size``)."""
    pool = nsbox.Pool(nsbox.Policy(), size=pool_size) if pool_size else None

    def launch() -> None:
        result = pool.run(argv) if pool else nsbox.run(argv, nsbox.Policy())
        if not result.ok:
            raise RuntimeError(f"soak launch failed: {result.status.value} {result.stderr!r}")

    try:
        for _ in range(warmup):
            launch()
        time.sleep(0.2)  # let the last sandboxes' deferred cleanup finish
        before = settled_snapshot()
        started = time.perf_counter()
        for i in range(launches):
            launch()
            if progress and i and i % 1000 == 0:
                progress(f"soak: {i}/{launches}")
        elapsed = time.perf_counter() - started
        time.sleep(0.5)
        if pool:
            pool.close()
            time.sleep(0.2)
        after = settled_snapshot()
    finally:
        if pool:
            pool.close()
    delta = {key: after[key] - before[key] for key in before}
    left_behind = {key: delta[key] for key in ("host_mounts", "cgroups_below_ours",
                                                "fds_launcher", "fds_helper")
                   if delta[key] > 0}
    # Spawners and their spare cgroups come and go with the launches (one is taken, one made
    # after the next report): what must hold is their bound, not an equal count.
    # Each launch process (the helper, the engine) keeps READY spares of its own.
    hierarchies, ready = len(_cgroup_dirs()), READY * max(1, after["keepers"])
    if after["spawners"] > ready:
        left_behind["spawners"] = after["spawners"]
    if after["spare_cgroups"] > ready * hierarchies:
        left_behind["spare_cgroups"] = after["spare_cgroups"]
    if after["zombies"]:
        left_behind["zombies"] = after["zombies"]
    if after["children_left"]:
        left_behind["children_left"] = after["children_left"]
    return {
        "launches": launches,
        "through": f"pool (size {pool_size})" if pool_size else "nsbox.run",
        "seconds": round(elapsed, 2),
        "before": before,
        "after": after,
        "delta": delta,
        "left_behind": left_behind,
        "rss_growth_mib": round(delta["rss_kib_launcher"] / 1024, 2),
        "helper_growth_mib": round(delta["rss_kib_launch_processes"] / 1024, 2),
        "ok": (not left_behind and delta["rss_kib_launcher"] < 5 * 1024
               and delta["rss_kib_launch_processes"] < 5 * 1024),
    }
