"""Measure what the rule book (nsbox/policy/rules.py) adds to a launch.

    python -m nsbox.bench.rules [rounds]

For project-like trees of 10,000 and 50,000 files (20 files a directory, three levels, in a
temporary directory): the socket scan the first time in a process and again (directories
remembered), and the whole plan of a policy with the tree as its workspace, against the plan of
the default policy without a workspace. Each figure is the median of ``rounds``; "first" clears
the remembered directories before each round.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from nsbox.host import pathrules, socketscan
from nsbox.plan import plan
from nsbox.policy.policy import Policy


def make_tree(root: str, files: int, per_dir: int = 20) -> None:
    """``files`` empty files, ``per_dir`` to a directory, in directories ten to a parent."""
    made = 0
    index = 0
    while made < files:
        directory = os.path.join(root, f"d{index // 100}", f"e{index // 10 % 10}",
                                 f"f{index % 10}")
        os.makedirs(directory, exist_ok=True)
        for n in range(min(per_dir, files - made)):
            with open(os.path.join(directory, f"file{n}.py"), "w"):
                pass
        made += per_dir
        index += 1
    # Settle the directories' change times (the scan does not remember a directory changed in
    # the last seconds); setting them back changes only mtime, which is fine here: the ctime
    # is what proves a directory unchanged, and it is older than the settling time below.
    time.sleep(socketscan.SETTLED_NS / 1e9 + 0.1)


def median_ms(action: Callable[[], object], rounds: int, before: Callable[[], None]) -> float:
    times = []
    for _ in range(rounds):
        before()
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def forget_all() -> None:
    socketscan.forget(watches=True)
    pathrules.HostView.current().passed.clear()


def forget() -> None:
    socketscan.forget()


def measure_tree(root: str, base: Policy, rounds: int) -> tuple[float, float, float, float]:
    def scan() -> object:
        return socketscan.find_host_socket(root)

    policy = base.replace(workspace=root)

    def build() -> object:
        return plan.build(policy, ["true"])

    first = median_ms(scan, rounds, forget)
    scan()
    again = median_ms(scan, rounds, lambda: None)
    return first, again, median_ms(build, rounds, forget), median_ms(build, rounds, lambda: None)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    base = Policy()
    plan.build(base, ["true"])  # imports, the seccomp program, the host view
    bare = median_ms(lambda: plan.build(base, ["true"]), rounds * 10, lambda: None)
    print(f"plan of the default policy (no workspace): {bare:.2f} ms median")
    # As the CLI pays it (one process a run): nothing remembered, /usr/local scanned anew.
    fresh = median_ms(lambda: plan.build(base, ["true"]), rounds * 3, forget_all)
    print(f"plan of the default policy, first in a process: {fresh:.2f} ms median")
    for files in (10_000, 50_000):
        root = tempfile.mkdtemp(prefix="nsbox-bench-rules-")
        try:
            make_tree(root, files)
            first, again, plan_first, plan_again = measure_tree(root, base, rounds)
        finally:
            shutil.rmtree(root)
            forget()
        print(f"{files:>6} files: scan first {first:7.1f} ms, again {again:6.2f} ms; "
              f"plan with it as workspace: first {plan_first:7.1f} ms, again "
              f"{plan_again:6.2f} ms")


if __name__ == "__main__":
    main()
