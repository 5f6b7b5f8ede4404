"""Memory: what the launch processes nsbox keeps in a host process hold, and what one run is
charged.

The launch processes are the children of this process that outlive a launch (the launch helper
or the launch engine, whichever nsbox uses here) and their spawners (cgroup v1): their resident
memory (VmRSS) and its high-water mark (VmHWM, proc(5)) after the launches so far. The peak
memory charged to a run is the Result's ``peak_memory``: the run cgroup's peak where the run
had one (``accounting`` says), else the largest resident set among its processes.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import nsbox
from nsbox.bench.meter import children
from nsbox.cgroups import naming


def _status(pid: int) -> dict[str, str]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _process(pid: int, role: str) -> dict[str, Any] | None:
    try:
        status = _status(pid)
    except OSError:
        return None
    return {"pid": pid, "role": role, "name": status.get("Name", "?"),
            "rss_kib": int(status.get("VmRSS", "0 kB").split()[0]),
            "hwm_kib": int(status.get("VmHWM", "0 kB").split()[0])}


def _children_of(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(child) for child in f.read().split()]
    except OSError:
        pass
    return found


def launch_processes() -> list[dict[str, Any]]:
    """This process's long-lived children and their spawners, with their memory."""
    rows = []
    for pid in sorted(children()):
        row = _process(pid, "launch process")
        if row is None:
            continue
        rows.append(row)
        for child in _children_of(pid):
            if naming.is_spawner(child):
                spawner = _process(child, "spawner")
                if spawner is not None:
                    rows.append(spawner)
    return rows


PAYLOADS = {"/bin/true": ["/bin/true"], "python3 -c pass": ["/usr/bin/python3", "-c", "pass"]}


def run_peaks(launches: int) -> dict[str, Any]:
    """The peak memory charged to a run of each payload, default policy, median and largest
    over ``launches`` runs."""
    out: dict[str, Any] = {}
    for name, argv in PAYLOADS.items():
        peaks, accounting = [], set()
        for _ in range(launches):
            result = nsbox.run(argv, nsbox.Policy())
            if not result.ok:
                raise RuntimeError(f"{name}: {result.status.value} {result.stderr[-200:]!r}")
            peaks.append(result.peak_memory)
            accounting.add(result.accounting)
        out[name] = {"median_kib": round(statistics.median(peaks) / 1024),
                     "max_kib": round(max(peaks) / 1024), "launches": launches,
                     "accounting": ", ".join(sorted(accounting))}
    return out


def measure(launches: int) -> dict[str, Any]:
    peaks = run_peaks(launches)  # also warms the launch processes up
    return {"launch_processes": launch_processes(), "run_peak": peaks}
