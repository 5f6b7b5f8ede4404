"""Measure where a seccomp program comes from: compiling (libseccomp) against reading the one
built with the package, and (as root) a program of the disk cache.

    python -m nsbox.bench.seccomp_cache [rounds]

Each figure is the median over fresh interpreter processes (so imports count as they do for a
first launch), with a private XDG_CACHE_HOME.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import sys, time
t0 = time.perf_counter()
from nsbox.host import seccomp, seccomp_compile
from nsbox.policy.policy import Seccomp, SeccompRule
custom = Seccomp(rules=(SeccompRule("getppid", "errno:EACCES"),))  # not a shipped profile's
t1 = time.perf_counter()
if sys.argv[1] == "compile":
    seccomp_compile.compile_program(Seccomp())
elif sys.argv[1] == "shipped":
    seccomp.load(Seccomp())
else:
    seccomp.load(custom)
t2 = time.perf_counter()
print(f"{(t2 - t1) * 1000:.3f} {int('pyseccomp' in sys.modules)} {seccomp.stats.compiled}")
"""


def measure(mode: str, rounds: int, env: dict[str, str]) -> tuple[float, bool]:
    times, imported = [], False
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
        times.append(float(out[0]))
        imported = imported or out[1] == "1" or (mode != "compile" and out[2] != "0")
    return statistics.median(times), imported


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache)
        compile_ms, _ = measure("compile", rounds, env)
        shipped_ms, shipped_missed = measure("shipped", rounds, env)
        if os.geteuid() == 0:
            measure("disk", 1, env)  # fills the disk cache
            hit_ms, imported = measure("disk", rounds, env)
    print(f"compile (import pyseccomp + libseccomp + export): {compile_ms:.2f} ms median")

    def note(missed: bool) -> str:
        return "NOT a hit: pyseccomp imported or compiled" if missed else "pyseccomp not imported"

    print(f"built with the package (read + verify, first in process): {shipped_ms:.2f} ms "
          f"median, {note(shipped_missed)}")
    if os.geteuid() == 0:
        print(f"root's disk cache (read + verify, first in process): {hit_ms:.2f} ms median, "
              f"{note(imported)}")


if __name__ == "__main__":
    main()
