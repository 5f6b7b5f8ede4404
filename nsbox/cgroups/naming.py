"""Names of the cgroups nsbox creates, and how to tell that their owner is gone.

A name says which process owns the cgroup: ``nsbox-<pidns>-<pid>-<start>-<kind>``
(kind: ``r<N>`` a run, ``s<N>`` a spare made ahead, ``leaf`` the owner's own), where pidns is
the inode of the owner's pid namespace, pid its pid there and start its start time in clock
ticks after boot (proc(5), /proc/PID/stat field 22). The pid alone is not enough: pids are reused,
and a hierarchy can be shared by processes of several pid namespaces. An owner counts as dead
only when it lived in our pid namespace and no process with that pid and start time exists;
anything else is left alone.
"""

from __future__ import annotations

import itertools
import os
import re

PREFIX = "nsbox-"
_NAME = re.compile(r"^nsbox-(?P<ns>\d+)-(?P<pid>\d+)-(?P<start>\d+)-(?P<kind>[rs]\d+|leaf)$")
_counter = itertools.count(1)


def _start_time(pid: int) -> int | None:
    """The start time of ``pid``; None when no such process lives (or only its zombie).
    Any other failure to read it (EMFILE, ENOMEM, EACCES under hidepid) raises OSError: it says
    nothing of the owner, and taking it for "gone" would kill a live owner's sandboxes."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it ended while being read
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ")".
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # a zombie cleans nothing up any more: its owner is gone
        return None
    return int(fields[19])


def _pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def owner_tag(pid: int) -> str:
    """The part of a name that says its owner is the live process ``pid``; OSError when its
    start time cannot be read (see _start_time)."""
    start = _start_time(pid)
    if start is None:
        raise ProcessLookupError(f"no process {pid} to name a cgroup for")
    return f"{PREFIX}{_pidns()}-{pid}-{start}"


def run_name() -> str:
    """A new, unique name for one run's cgroup, owned by this process."""
    return f"{owner_tag(os.getpid())}-r{next(_counter)}"


def spare_name() -> str:
    """A new name for a cgroup made ahead of the run that takes it (nsbox/helper/spawner.py).
    It keeps that name when a run takes it (a v2 directory cannot be renamed): a spare is idle while
    it holds nothing but its spawner (see ``is_idle_spare``)."""
    return f"{owner_tag(os.getpid())}-s{next(_counter)}"


def leaf_name() -> str:
    """The name of the leaf cgroup this process moves itself into on cgroup v2."""
    return f"{owner_tag(os.getpid())}-leaf"


def parse(name: str) -> tuple[int, int, int, str] | None:
    """(pidns, pid, start, kind) for a name nsbox made, None for any other name."""
    match = _NAME.match(name)
    if not match:
        return None
    return int(match["ns"]), int(match["pid"]), int(match["start"]), match["kind"]


def owner_is_dead(name: str) -> bool:
    """True only for our own naming scheme, in our pid namespace, with the owner gone."""
    parsed = parse(name)
    if parsed is None:
        return False
    ns, pid, start, _kind = parsed
    try:
        if ns != _pidns():
            return False
        return _start_time(pid) != start
    except OSError:
        return False  # unknown is not dead: tried again by the next process


def is_leaf(name: str) -> bool:
    parsed = parse(name)
    return parsed is not None and parsed[3] == "leaf"


SPAWNER_NAME = "nsbox-spawner"  # the command name of a spare's waiting process


def is_spawner(pid: int) -> bool:
    """Whether ``pid`` is a waiting spawner (by its command name; False once it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().rstrip("\n") == SPAWNER_NAME
    except OSError:
        return False


def is_idle_spare(name: str, procs: list[int]) -> bool:
    """Whether the cgroup ``name`` holding ``procs`` is a spare that no run has taken: empty
    (its spawner not in yet) or holding its spawner alone."""
    parsed = parse(name)
    if parsed is None or not parsed[3].startswith("s") or len(procs) > 1:
        return False
    # A process that has just exited (comm unreadable) no longer holds the spare.
    return all(is_spawner(pid) or not os.path.exists(f"/proc/{pid}") for pid in procs)
