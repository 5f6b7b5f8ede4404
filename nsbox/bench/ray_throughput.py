"""Launches per second through Ray against direct nsbox calls and Ray without a sandbox.

    python -m nsbox.bench.ray_throughput [jobs] [rounds] [default|nolimits]

Starts a local Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``, one
CPU and 200 MB of object store each) and runs ``jobs`` short commands (``/bin/true``) with each
method, ``rounds`` times in turn so that the noise of other tenants falls on all of them:

- ``direct``: ``nsbox.run`` from as many threads as the Ray methods run jobs at once, in this
  process (no Ray): the cost of the sandbox alone;
- ``direct-pool``: the same through an ``nsbox.Pool`` of that many warm sandboxes, as each
  executor runs plain jobs;
- ``ray-plain``: a Ray task per job that runs the command with subprocess, no sandbox: the cost
  of Ray alone;
- ``ray-nsbox``: ``nsbox.ray.Executors.map``, one executor per node: both.

``nolimits`` runs every sandbox without memory and process limits, so without a cgroup per run:
the difference to ``default`` is the cost of the cgroup (on a cgroup v1 host, moving a process
into a cgroup has a tail of 10-20 ms).

Prints the median jobs per second of each method and the figures of every round as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# The local cluster binds and dials 127.0.0.1 only (see tests/test_ray.py).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import nsbox  # noqa: E402
from nsbox import ray as nsray  # noqa: E402

NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 200 * 1024 * 1024}
COMMAND = ["/bin/true"]
POOL_SIZE = 2  # per executor; also the jobs an executor runs at once


@ray.remote(num_cpus=0)
def plain(argv: list[str]) -> int:
    return subprocess.run(argv, capture_output=True).returncode


def direct(policy: nsbox.Policy, jobs: int, threads: int) -> None:
    with ThreadPoolExecutor(threads) as workers:
        codes = list(workers.map(lambda _: nsbox.run(COMMAND, policy).exit_code, range(jobs)))
    assert codes == [0] * jobs


def direct_pool(pool: nsbox.Pool, jobs: int, threads: int) -> None:
    with ThreadPoolExecutor(threads) as workers:
        codes = list(workers.map(lambda _: pool.run(COMMAND).exit_code, range(jobs)))
    assert codes == [0] * jobs


def ray_plain(jobs: int, in_flight: int) -> None:
    pending: list[Any] = []
    done = 0
    for _ in range(jobs):
        if len(pending) >= in_flight:
            ready, pending = ray.wait(pending, num_returns=1)
            done += sum(code == 0 for code in ray.get(ready))
        pending.append(plain.remote(COMMAND))
    done += sum(code == 0 for code in ray.get(pending))
    assert done == jobs


def ray_nsbox(executors: nsray.Executors, jobs: int, in_flight: int) -> None:
    results = executors.map(({"argv": COMMAND} for _ in range(jobs)), max_in_flight=in_flight,
                            ordered=False)
    assert sum(r["status"] == "OK" for r in results) == jobs


def rate(work: Callable[[], None], jobs: int) -> float:
    started = time.perf_counter()
    work()
    return jobs / (time.perf_counter() - started)


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    variant = sys.argv[3] if len(sys.argv) > 3 else "default"
    policy = nsbox.Policy()
    if variant == "nolimits":
        policy = policy.with_limits(memory=None, pids=None)
    elif variant != "default":
        sys.exit(f"unknown variant {variant!r}: default or nolimits")
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    try:
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
        cluster.wait_for_nodes()
        with nsray.Executors(policy, pool_size=POOL_SIZE) as executors, \
                nsbox.Pool(policy, size=POOL_SIZE * 2) as pool:
            slots = POOL_SIZE * len(executors.executors)
            in_flight = 4 * slots
            methods: dict[str, Callable[[], None]] = {
                "direct": lambda: direct(policy, jobs, slots),
                "direct-pool": lambda: direct_pool(pool, jobs, slots),
                "ray-plain": lambda: ray_plain(jobs, in_flight),
                "ray-nsbox": lambda: ray_nsbox(executors, jobs, in_flight),
            }
            for work in methods.values():  # warm-up: helpers, worker processes, imports
                work()
            figures: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(rounds):
                for name, work in methods.items():
                    figures[name].append(round(rate(work, jobs), 1))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"{jobs} x {' '.join(COMMAND)} ({variant}), {rounds} rounds, 2 nodes x 1 CPU, "
          f"{POOL_SIZE} jobs at once per executor, {os.cpu_count()} cores")
    for name, values in figures.items():
        print(f"  {name:<11} {statistics.median(values):8.1f} jobs/s (median)")
    print(json.dumps({"jobs": jobs, "rounds": rounds, "variant": variant,
                      "jobs_per_second": figures}))


if __name__ == "__main__":
    main()
