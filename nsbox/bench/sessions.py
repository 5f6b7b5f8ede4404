"""Costs of a session against one-shot runs: start, one command, file operations, close.

Run: python -m nsbox.bench.sessions [N]   (prints the median and p90 of N repetitions, in ms)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import nsbox


def measure(label: str, n: int, action: Callable[[], object]) -> None:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    p90 = times[min(len(times) - 1, int(len(times) * 0.9))]
    print(f"{label:<40} median {statistics.median(times):7.2f} ms   p90 {p90:7.2f} ms")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    nsbox.run(["true"])  # start the helper once
    measure("nsbox.run(['true'])", n, lambda: nsbox.run(["true"]))
    measure("Session() + close()", n, lambda: nsbox.Session().close())
    with nsbox.Session() as s:
        measure("session.run(['true'])", n, lambda: s.run(["true"]))
        measure("session.write_file(1 KiB)", n, lambda: s.write_file("f", b"x" * 1024))
        measure("session.read_file(1 KiB)", n, lambda: s.read_file("f"))
        s.write_file("big", b"x" * (16 << 20))
        measure("session.read_file(16 MiB)", max(3, n // 5), lambda: s.read_file("big"))
        s.run(["sh", "-c", "mkdir d; for i in $(seq 100); do echo $i > d/f$i; done"])
        measure("session.files() over 102 files", n, lambda: s.files())


if __name__ == "__main__":
    main()
