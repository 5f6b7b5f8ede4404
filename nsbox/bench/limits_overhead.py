"""Measure what per-run limits cost a launch: the cgroup calls on their own, and whole runs of
/bin/true with and without cgroup limits.

    python -m nsbox.bench.limits_overhead [rounds]

Run as root (or with a writable cgroup); without one, the cgroup rows are skipped. Medians and
the 90th percentile, in milliseconds.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import nsbox
from nsbox import cgroups
from nsbox.policy.policy import Policy


def _summary(name: str, samples: list[float]) -> None:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    print(f"{name:<40} median {statistics.median(samples) * 1e3:6.2f}   p90 {p90 * 1e3:6.2f}")


def cgroup_calls(rounds: int) -> None:
    backend = cgroups.get_backend()
    if not backend.supports():
        print(f"no writable cgroup: {backend.reason}")
        return
    create, attach, destroy = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run = backend.create(cgroups.Request(memory=256 << 20, pids=64, cpus=0.5))
        t1 = time.perf_counter()
        read_end, write_end = os.pipe()
        proc = subprocess.Popen(["cat"], stdin=read_end)  # waits on the pipe: still alive
        t2 = time.perf_counter()
        run.attach(proc.pid)
        t3 = time.perf_counter()
        os.close(write_end)
        proc.wait()
        os.close(read_end)
        t4 = time.perf_counter()
        run.destroy()
        t5 = time.perf_counter()
        create.append(t1 - t0)
        attach.append(t3 - t2)
        destroy.append(t5 - t4)
    print(f"backend {backend.kind}: {sorted(backend.supports())}")
    _summary("create (limits written)", create)
    _summary("attach one process", attach)
    _summary("destroy (empty cgroup)", destroy)


def whole_runs(rounds: int) -> None:
    policies = {
        "run true, no cgroup limits": Policy().with_limits(memory=None, pids=None),
        "run true, default limits (512M, 256)": Policy(),
        "run true, memory+pids+cpus+cpu_time": Policy().with_limits(
            memory=256 << 20, pids=64, cpus=1.0, cpu_time=10),
    }
    nsbox.run(["true"])  # the helper is started once per process
    samples: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(rounds):  # interleaved, so load changes hit every row alike
        for name, policy in policies.items():
            t0 = time.perf_counter()
            result = nsbox.run(["true"], policy)
            samples[name].append(time.perf_counter() - t0)
            assert result.ok, result
    for name, values in samples.items():
        _summary(name, values)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    cgroup_calls(rounds)
    whole_runs(rounds)


if __name__ == "__main__":
    main()
