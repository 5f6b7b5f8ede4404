"""nsbox's launch benchmark: ``nsbox bench`` or ``python -m nsbox.bench`` (``python -m bench``
in a checkout), with ``--quick`` for a short run that checks that everything works.

Measures, in one run: the latency of /bin/true and of ``python3 -c pass`` through plain
subprocess, unshare, bubblewrap (alone, with nsbox's seccomp program, and that in a fresh cgroup
with the default policy's limits), the other installed peers, and nsbox (API cold, without
limits, warm pool, the command line), interleaved; the throughput with 1, 2 and 4 threads
launching at once; the CPU of one launch with every process counted; the memory of the launch
processes and the peak charged to a run; the per-step breakdown of one nsbox launch; a leak
soak; and the targets, each a ratio to a peer of the same run (nsbox/bench/targets.py). Writes
JSON (and a PNG chart when matplotlib is installed). docs/performance.md explains the method.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import nsbox
from nsbox.bench import chart, cpu, measure, memory, methods, report, soak, targets
from nsbox.sandbox import native

PAYLOADS = {"/bin/true": ["/bin/true"], "python3 -c pass": ["/usr/bin/python3", "-c", "pass"]}
# The launchers of the throughput and CPU sections (those found here).
THROUGHPUT_ROWS = ("subprocess", "bwrap", "bwrap+seccomp", "bwrap+seccomp+cgroup",
                   "nsbox API cold", "nsbox API no limits", "nsbox pool")
CPU_ROWS = (*THROUGHPUT_ROWS, "nsbox CLI")
# With --no-peers: nsbox and the bwrap rows, which are the targets' peers.
KEPT_PEERS = ("subprocess", "bwrap", "bwrap+seccomp", "bwrap+seccomp+cgroup")


def machine() -> dict[str, Any]:
    with open("/proc/cpuinfo") as f:
        models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    versions = {}
    for tool, flag in (("bwrap", "--version"), ("firejail", "--version"), ("crun", "--version"),
                       ("unshare", "--version")):
        try:
            out = subprocess.run([tool, flag], capture_output=True, text=True, timeout=10)
            versions[tool] = out.stdout.strip().splitlines()[0] if out.stdout else "?"
        except (OSError, subprocess.TimeoutExpired):
            pass
    model = models[0] if models else platform.processor()
    return {
        "summary": f"{len(models)} x {model}, Linux {platform.release()}, "
                   f"Python {platform.python_version()}",
        "cpus": len(models), "cpu": model, "kernel": platform.release(),
        "python": sys.version.split()[0], "executable": sys.executable,
        "euid": os.geteuid(), "loadavg_at_start": load, "tools": versions,
        "nsbox": nsbox.__version__,
    }


def default_out() -> str:
    """bench/results of a checkout run from its top (git ignores it), else ./nsbox-bench."""
    here = os.getcwd()
    if os.path.isfile(os.path.join(here, "bench", "__main__.py")):
        return os.path.join(here, "bench", "results")
    return os.path.join(here, "nsbox-bench")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="nsbox bench", description=__doc__.split("\n")[0].split(":")[0],
        epilog="Example: nsbox bench --quick --out /tmp/bench (a short run: checks that all "
               "runs). The figures to quote come from a full run on a quiet machine.")
    parser.add_argument("--quick", action="store_true",
                        help="a few rounds, a short soak: checks that everything runs")
    parser.add_argument("--rounds", type=int, default=None, help="latency rounds (default 100)")
    parser.add_argument("--soak", type=int, default=None,
                        help="launches in the leak soak (default 10000; 0 skips it)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="duration of each throughput measurement (default 3)")
    parser.add_argument("--cpu-launches", type=int, default=None,
                        help="launches per launcher in the CPU section (default 400)")
    parser.add_argument("--pool-size", type=int, default=2)
    parser.add_argument("--out", default=None,
                        help="directory for the JSON and the PNG (default: bench/results in a "
                        "checkout, else ./nsbox-bench)")
    parser.add_argument("--no-peers", action="store_true",
                        help="nsbox and bwrap (with its seccomp and cgroup rows) only")
    return parser.parse_args(argv)


def launchers(no_peers: bool, pool_size: int, skipped: dict[str, str]) -> list[methods.Method]:
    """Every launcher that works here; the others in ``skipped``, with the reason."""
    found = methods.peers(skipped)
    if no_peers:
        for method in found:
            if method.name not in KEPT_PEERS:
                method.close()  # e.g. crun's bundle
        found = [m for m in found if m.name in KEPT_PEERS]
    working = []
    for method in found + methods.nsbox_methods(pool_size):
        try:
            method.run(["/bin/true"])  # a peer that cannot run here is skipped, with the reason
        except Exception as exc:  # noqa: BLE001 - any failure of a peer means "skip it"
            skipped[method.name] = f"fails here: {exc}"
            method.close()
            continue
        working.append(method)
    return working


def config(args: argparse.Namespace) -> dict[str, Any]:
    """How much of everything: the options, else the defaults of a full or a --quick run."""
    quick = args.quick

    def given(value: Any, short: Any, full: Any) -> Any:
        return value if value is not None else (short if quick else full)

    return {"rounds": given(args.rounds, 3, 100), "soak": given(args.soak, 50, 10000),
            "throughput_seconds": given(args.seconds, 0.3, 3.0),
            "cpu_launches": given(args.cpu_launches, 16, 400), "cpu_blocks": 2 if quick else 10,
            "memory_runs": 5 if quick else 50, "traced": 10 if quick else 200,
            "soak_warmup": 20 if quick else 200, "pool_size": args.pool_size,
            "payloads": PAYLOADS, "quick": quick}


def measure_all(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Every section, in the order of the report; each says what it is doing on stderr."""
    report["config"] = c = config(args)
    rounds, seconds, cpu_launches = c["rounds"], c["throughput_seconds"], c["cpu_launches"]

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    skipped: dict[str, str] = {}
    everything = launchers(args.no_peers, args.pool_size, skipped)
    report["methods"] = {m.name: {"command": m.describe, "isolation": m.isolation}
                         for m in everything}
    report["skipped"] = skipped
    for name, why in skipped.items():
        say(f"skipped {name}: {why}")
    try:
        say(f"latency: {rounds} interleaved rounds of {len(everything)} launchers x "
            f"{len(PAYLOADS)} payloads")
        report["latency"] = measure.latency(everything, PAYLOADS, rounds)
        say(f"throughput: 1, 2 and 4 threads, {seconds} s each")
        fast = [m for m in everything if m.name in THROUGHPUT_ROWS]
        report["throughput"] = measure.throughput(fast, ["/bin/true"], seconds)
    finally:
        for method in everything:
            method.close()
    names = [m.name for m in everything if m.name in CPU_ROWS]
    say(f"CPU of one launch: {cpu_launches} launches of each of {len(names)} launchers")
    report["cpu"] = cpu.per_launch(names, cpu_launches, blocks=c["cpu_blocks"],
                                   pool_size=args.pool_size)
    say("memory")
    report["memory"] = memory.measure(c["memory_runs"])
    say("breakdown")
    report["breakdown"] = measure.breakdown(["/bin/true"], c["traced"], args.pool_size)
    if c["soak"]:
        say(f"soak: {c['soak']} launches")
        report["soak"] = soak.soak(["/bin/true"], c["soak"], warmup=c["soak_warmup"],
                                   progress=say)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # The command line is measured as an installed one runs: from compiled bytecode
    # (PYTHONDONTWRITEBYTECODE would make it compile every module on every run).
    import compileall

    compileall.compile_dir(os.path.dirname(nsbox.__file__), quiet=2)
    result: dict[str, Any] = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        # NSBOX_NATIVE=0 measures the Python child instead (docs/performance.md).
        "core": native.status()[1],
    }
    measure_all(args, result)
    result["targets"] = targets.judge(result)
    out = args.out or default_out()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(report.text(result))
    print(f"\nwrote {path}")
    why = chart.draw(result, path[:-5] + ".png")
    print(why if why else f"wrote {path[:-5]}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
