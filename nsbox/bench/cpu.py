"""How much CPU one launch costs, and in which process: nsbox against bwrap, back to back.

    python -m nsbox.bench.cpu [launches]

The machine's CPU (from /proc/stat: everything but idle, so also kernel threads such as the
deferred cleanup of network namespaces) per launch, and the parts of the host process, of the
launch helper, and of the helper's reaped children (the sandboxes and, on v1 hosts, the
spawners, nsbox/helper/spawner.py). Run it on a quiet machine: other tenants' work counts
too. With 1 and 2 threads launching at once.

``per_launch`` is the row of ``python -m nsbox.bench``: every process's CPU per launch, each
launcher's in child subreapers (nsbox/bench/meter.py), nsbox against its peers in one run.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import nsbox
from nsbox.bench import meter
from nsbox.bench.measure import add_ratios
from nsbox.bench.methods import BWRAP_FLAGS, run_checked
from nsbox.host import engine
from nsbox.launch import launcher

TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / TICK  # all but idle and iowait


def _process_seconds(pid: int) -> tuple[float, float]:
    """(own, of its reaped children) CPU seconds of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK, (int(fields[13]) + int(fields[14])) / TICK


def per_launch(names: list[str], launches: int, blocks: int = 4,
               pool_size: int = 2) -> dict[str, dict[str, Any]]:
    """The CPU of one launch of /bin/true, every process counted (nsbox/bench/meter.py), per
    launcher: in ``blocks`` blocks, the launchers in a new random order in each, a meter of
    ``launches // blocks`` launches (against a meter of the warm-up alone where a launch
    process outlives the launches). ``host_ms`` is what the launching process itself spent."""
    per_block = max(1, launches // blocks)
    spent: dict[str, float] = dict.fromkeys(names, 0.0)
    host: dict[str, float] = dict.fromkeys(names, 0.0)
    rng = random.Random(9)
    order = list(names)
    meter.become_subreaper()
    try:
        for _ in range(blocks):
            rng.shuffle(order)
            for name in order:
                measured = meter.cpu_of(name, per_block, WARMUP, pool_size)
                host[name] += measured["host"]
                if not measured["kept"]:
                    spent[name] += measured["exact"]
                    continue
                baseline = meter.cpu_of(name, 0, WARMUP, pool_size)
                spent[name] += measured["seconds"] - baseline["seconds"]
    finally:
        meter.become_subreaper(False)
    n = per_block * blocks
    rows = {name: {"launches": n, "cpu_ms": round(spent[name] / n * 1e3, 3),
                   "host_ms": round(host[name] / n * 1e3, 3)} for name in names}
    add_ratios(rows, "cpu_ms")
    return rows


WARMUP = 3


def measure(name: str, launch: Callable[[], object], launches: int, threads: int,
            helper: int | None) -> None:
    for _ in range(20):
        launch()
    per_thread = launches // threads
    machine0, host0 = _busy_seconds(), os.times()
    helper0 = _process_seconds(helper) if helper else (0.0, 0.0)
    started = time.perf_counter()
    workers = [threading.Thread(target=lambda: [launch() for _ in range(per_thread)])
               for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    machine1, host1 = _busy_seconds(), os.times()
    helper1 = _process_seconds(helper) if helper else (0.0, 0.0)
    n = per_thread * threads
    host = (host1.user + host1.system) - (host0.user + host0.system)
    line = (f"{name:<6} x{threads}: {n / elapsed:6.1f} launches/s; CPU per launch: machine "
            f"{(machine1 - machine0) / n * 1e3:5.2f} ms, host {host / n * 1e3:5.2f}")
    if helper:
        line += (f", helper {(helper1[0] - helper0[0]) / n * 1e3:5.2f}, its children "
                 f"{(helper1[1] - helper0[1]) / n * 1e3:5.2f}")
    print(line, flush=True)


def main() -> None:
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    policy = nsbox.Policy()
    nsbox.run(["/bin/true"], policy)  # starts the helper
    helper = launcher.helper_client.pid or engine.client.pid  # or the launch engine
    bwrap = shutil.which("bwrap")
    for threads in (1, 2):
        measure("nsbox", lambda: nsbox.run(["/bin/true"], policy), launches, threads, helper)
        if bwrap:
            measure("bwrap", lambda: run_checked([bwrap, *BWRAP_FLAGS, "/bin/true"]), launches,
                    threads, None)


if __name__ == "__main__":
    main()
