"""The CPU of one launch with every process counted, for any launcher.

    python -m nsbox.bench.meter NAME LAUNCHES [WARMUP] [POOL_SIZE]

runs ``WARMUP`` and then ``LAUNCHES`` launches of /bin/true through the launcher called NAME
(nsbox/bench/methods.py) in this process, then ends every process the launcher keeps (nsbox's
launch helper, a pool) and exits. ``cpu_of`` starts it and returns the CPU seconds of its whole
tree. A launcher that keeps no process across launches (bwrap, the command line) has all its
processes reaped between two marks around the launches: that figure is exact. One that does
(nsbox's launch helper or engine) has its CPU only when it ends: ``per_launch``
(nsbox/bench/cpu.py) then takes the difference between a meter with the launches and one with
the warm-up alone, so that the interpreter's start, the imports and the warm-up cancel out.

Why a meter of its own: bwrap's monitor exits without reaping the sandbox's pid 1, so the
caller's getrusage(RUSAGE_CHILDREN) misses pid 1, the command it reaped and the namespace
teardown (2.2-2.4x of bwrap's CPU). The meter and its caller are child subreapers
(prctl(2) PR_SET_CHILD_SUBREAPER): every orphan below them becomes their child, is reaped,
and its CPU is counted. Each process's times reach the parent that reaps it (getrusage(2)),
so what the tree used arrives, exactly, in the rusage of the meter and of the orphans its
caller reaps. Not counted: kernel threads' deferred work (a network namespace's cleanup),
which ``python -m nsbox.bench.cpu`` shows in the machine's figure.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import nsbox

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
PAYLOAD = ["/bin/true"]


def become_subreaper(on: bool = True) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def children() -> set[int]:
    """The pids whose parent is this process: each thread's children (proc(5))."""
    found: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                found.update(int(pid) for pid in f.read().split())
        except OSError:
            continue
    return found


def reap(keep: set[int], wait: float = 0.0) -> tuple[float, int]:
    """Reap every child not in ``keep`` that has ended (waiting up to ``wait`` seconds for the
    others to end too); the CPU seconds of those reaped, with all they had reaped, and how
    many they were."""
    seconds, count = 0.0, 0
    deadline = time.monotonic() + wait
    while True:
        pending = children() - keep
        for pid in pending:
            try:
                got, _status, usage = os.wait4(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if got:
                seconds += usage.ru_utime + usage.ru_stime
                count += 1
        if not children() - keep or time.monotonic() >= deadline:
            return seconds, count
        time.sleep(0.005)


def reap_dead() -> int:
    """Reap every child that has ended (here: orphans of the launches), without a scan; how
    many there were."""
    count = 0
    while True:
        try:
            pid, _status, _usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return count
        if pid == 0:
            return count
        count += 1


def cpu_of(name: str, launches: int, warmup: int, pool_size: int) -> dict[str, Any]:
    """Run a meter and return {"seconds": CPU of its whole tree, "host": its own CPU during
    the launches, "exact": the CPU of the launches where nothing outlives one ("kept": 0)}.
    The caller must be a subreaper (become_subreaper) for the orphans."""
    keep = children()
    # The nsbox of this process, wherever it is (site-packages, a checkout, nsbox.pyz).
    top = os.path.dirname(os.path.dirname(os.path.abspath(nsbox.__file__)))
    path = os.pathsep.join(p for p in (top, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "nsbox.bench.meter", name, str(launches), str(warmup),
         str(pool_size)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=path))
    assert proc.stdout is not None
    out = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, with its rusage
    if proc.returncode != 0:
        raise RuntimeError(f"meter {name} exited with {proc.returncode}")
    seconds = usage.ru_utime + usage.ru_stime
    seconds += reap(keep, wait=5.0)[0]  # what outlived the meter: a launch process, orphans
    report = json.loads(out)
    return {"seconds": seconds, **report}


def _stop_launch_processes() -> None:
    """End what the launcher keeps running, so that its CPU is reaped and counted."""
    from nsbox.launch import launcher

    helper = getattr(launcher, "_helper", None)
    if helper is not None:
        helper.stop()


def main(argv: list[str]) -> int:
    name, launches = argv[0], int(argv[1])
    warmup = int(argv[2]) if len(argv) > 2 else 3
    pool_size = int(argv[3]) if len(argv) > 3 else 2
    become_subreaper()
    from nsbox.bench import methods

    method = methods.by_name(name, pool_size)
    try:
        for _ in range(warmup):
            method.run(PAYLOAD)
            if method.after:
                method.after()
        reap(set(), wait=0.5)  # the warm-up's orphans
        keep = children()  # the launch processes that stay (a helper, an engine, a pool)
        started, reaped, orphans = time.process_time(), _children_seconds(), 0
        for _ in range(launches):
            method.run(PAYLOAD)
            if method.after:
                method.after()
            orphans += reap_dead()
        orphans += reap(keep, wait=1.0 if launches else 0.0)[1]  # the last launches' orphans
        host = time.process_time() - started
        exact = host + _children_seconds() - reaped
    finally:
        method.close()
        _stop_launch_processes()
    reap(set(), wait=2.0)
    # Without launch processes kept across launches, everything the launches used was reaped
    # here between the two marks: ``exact`` is the whole figure.
    print(json.dumps({"host": host, "exact": exact, "kept": len(keep), "orphans": orphans}))
    return 0


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            sys.exit(1)
        raise
