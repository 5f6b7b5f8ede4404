"""Interleaved latency, throughput with concurrent launchers, and the per-step breakdown."""

from __future__ import annotations

import collections
import os
import random
import statistics
import threading
import time
from typing import Any

import nsbox
from nsbox.bench.methods import Method


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def summary(samples: list[float]) -> dict[str, Any]:
    return {
        "n": len(samples),
        "median_ms": round(statistics.median(samples) * 1e3, 3),
        "p10_ms": round(percentile(samples, 0.10) * 1e3, 3),
        "p90_ms": round(percentile(samples, 0.90) * 1e3, 3),
        "min_ms": round(min(samples) * 1e3, 3),
    }


def latency(methods: list[Method], payloads: dict[str, list[str]], rounds: int,
            warmup: int = 3) -> dict[str, dict[str, Any]]:
    """Each round times one launch of every (method, payload) pair, in a new random order, so
    that noise from the other tenants of the machine falls on all of them alike."""
    pairs = [(m, name, argv) for m in methods for name, argv in payloads.items()]
    for method, _name, argv in pairs:
        for _ in range(warmup):
            method.run(argv)
            if method.after:
                method.after()
    samples: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    rng = random.Random(8)
    for _ in range(rounds):
        rng.shuffle(pairs)
        for method, name, argv in pairs:
            started = time.perf_counter()
            method.run(argv)
            samples[(name, method.name)].append(time.perf_counter() - started)
            if method.after:
                method.after()
    out: dict[str, dict[str, Any]] = {}
    for name in payloads:
        rows = {m.name: summary(samples[(name, m.name)]) for m in methods}
        add_ratios(rows, "median_ms")
        out[name] = rows
    return out


# Each nsbox row against the peer that does the same work (all from the same run): the default
# policy against bwrap with nsbox's seccomp program, and against that bwrap in a fresh cgroup
# with the same limits; nsbox without limits against bwrap+seccomp; the command line against
# plain bwrap (the figure of the targets). Every row also has x_bwrap.
PEERS = {
    "nsbox API cold": ("bwrap+seccomp", "bwrap+seccomp+cgroup"),
    "nsbox API no limits": ("bwrap+seccomp",),
    "nsbox pool": ("bwrap+seccomp",),
    "nsbox CLI": ("bwrap",),
    "nsbox CLI -I -S": ("bwrap",),
}


def add_ratios(rows: dict[str, dict[str, Any]], key: str) -> None:
    """``x_bwrap`` on every row and ``x_peers`` ({peer: ratio}) on nsbox's, from ``key``."""
    reference = rows.get("bwrap")
    for name, row in rows.items():
        if reference:
            row["x_bwrap"] = round(row[key] / reference[key], 3)
        peers = {peer: round(row[key] / rows[peer][key], 3)
                 for peer in PEERS.get(name, ()) if peer in rows and rows[peer][key]}
        if peers:
            row["x_peers"] = peers


CONCURRENCY = (1, 2, 4)


def throughput(methods: list[Method], argv: list[str], seconds: float,
               concurrency: tuple[int, ...] = CONCURRENCY) -> dict[str, dict[str, float]]:
    """Launches per second with N threads of this process launching back to back (no pause: a
    pool has no time to refill ahead, so this is its sustained rate); ``x_bwrap_N`` is the
    ratio to bwrap's rate with as many threads."""
    out: dict[str, dict[str, float]] = {}
    for method in methods:
        out[method.name] = {}
        for workers in concurrency:
            count = [0] * workers
            stop = time.perf_counter() + seconds

            def work(slot: int, method: Method = method, stop: float = stop,
                     count: list[int] = count) -> None:
                while time.perf_counter() < stop:
                    method.run(argv)
                    count[slot] += 1

            threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - started
            out[method.name][str(workers)] = round(sum(count) / elapsed, 1)
    reference = out.get("bwrap")
    if reference:
        for name, rates in list(out.items()):
            out[name] = {**rates, **{f"x_bwrap_{k}": round(v / reference[k], 3)
                                     for k, v in rates.items() if not k.startswith("x_")}}
    return out


def breakdown(argv: list[str], launches: int, pool_size: int) -> dict[str, Any]:
    """Median duration of every step of a launch (NSBOX_TRACE): cold back to back, cold after a
    pause (30 ms, not timed: as an agent's commands come, when no cgroup migration happened just
    before, see docs/limits.md), and from a pool."""
    previous = os.environ.get("NSBOX_TRACE")
    os.environ["NSBOX_TRACE"] = "1"

    def after_a_pause() -> nsbox.Result:
        time.sleep(0.03)
        return nsbox.run(argv, nsbox.Policy())

    try:
        cold = _steps(lambda: nsbox.run(argv, nsbox.Policy()), launches)
        paused = _steps(after_a_pause, launches)
        with nsbox.Pool(nsbox.Policy(), size=pool_size) as pool:
            pool.wait_ready()

            def pooled() -> nsbox.Result:
                result = pool.run(argv)
                pool.wait_ready()
                return result

            warm = _steps(pooled, launches)
    finally:
        if previous is None:
            del os.environ["NSBOX_TRACE"]
        else:
            os.environ["NSBOX_TRACE"] = previous
    return {"cold": cold, "cold after a pause": paused, "pool": warm}


def _steps(launch: Any, launches: int) -> dict[str, Any]:
    per_step: dict[str, list[float]] = collections.defaultdict(list)
    order: list[str] = []
    totals = []
    for _ in range(launches):
        result = launch()
        steps = result.extra["trace"]
        totals.append(steps[-1]["at_ms"])
        for step in steps[:-1]:
            if step["step"] not in per_step:
                order.append(step["step"])
            per_step[step["step"]].append(step["ms"])
    return {
        "launches": launches,
        "total_median_ms": round(statistics.median(totals), 3),
        "steps": [{"step": name, "median_ms": round(statistics.median(per_step[name]), 3)}
                  for name in order],
    }
