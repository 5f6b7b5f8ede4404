"""nsbox's launch benchmark: ``python -m bench [--quick] [--rounds N] [--soak N] [--out DIR]``.

Measures, in one run and interleaved, the per-launch latency of /bin/true and of
``python3 -c pass`` through plain subprocess, unshare, bubblewrap, the other installed peers,
and nsbox (API cold, without limits, warm pool, CLI); throughput with 1 and 2 concurrent
launchers; the CPU of one launch in all its processes; the per-step breakdown of one nsbox
launch; and a leak soak. Each nsbox row has its ratio to the peer that does the same work
(bwrap with nsbox's seccomp program, and that in a fresh cgroup with the same limits), and the
targets are judged from those (bench/targets.py). Writes JSON (and a PNG chart when matplotlib
is installed) to bench/results/. See docs/performance.md.
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
from bench import chart, cpu, measure, methods, soak, targets
from nsbox.sandbox import native

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PAYLOADS = {"/bin/true": ["/bin/true"], "python3 -c pass": ["/usr/bin/python3", "-c", "pass"]}
# The launchers whose CPU per launch is counted (the pool's work happens between the launches).
CPU_ROWS = ("bwrap", "bwrap+seccomp", "bwrap+seccomp+cgroup", "nsbox API cold",
            "nsbox API no limits")


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
    cpu = models[0] if models else platform.processor()
    return {
        "summary": f"{len(models)} x {cpu}, Linux {platform.release()}, "
                   f"Python {platform.python_version()}",
        "cpus": len(models), "cpu": cpu, "kernel": platform.release(),
        "python": sys.version.split()[0], "executable": sys.executable,
        "euid": os.geteuid(), "loadavg_at_start": load, "tools": versions,
        "nsbox": nsbox.__version__,
    }


def table(report: dict[str, Any]) -> str:
    lines = [f"launch core: {report.get('core', '?')}"]
    for payload, rows in report["latency"].items():
        lines.append(f"\n{payload}  (median, p10-p90, ms; ratio to bwrap; to the peer doing "
                     "the same work)")
        for name, row in sorted(rows.items(), key=lambda item: item[1]["median_ms"]):
            ratio = row.get("x_bwrap")
            lines.append(f"  {name:<20} {row['median_ms']:8.2f}  {row['p10_ms']:7.2f}-"
                         f"{row['p90_ms']:<7.2f}" + (f"  {ratio:5.2f}x" if ratio else "")
                         + _peers(row))
    if report.get("throughput"):
        lines.append("\nthroughput, /bin/true launches/s (1 and 2 concurrent launchers)")
        for name, rates in report["throughput"].items():
            lines.append(f"  {name:<16} {rates['1']:8.1f} {rates['2']:8.1f}"
                         + (f"  ({rates['x_bwrap_2']:.2f}x bwrap at 2)"
                            if "x_bwrap_2" in rates else ""))
    if report.get("cpu"):
        lines.append("\nCPU of one launch of /bin/true, all processes (ms; getrusage of this "
                     "process and its children, the helper's with its children)")
        for name, row in sorted(report["cpu"].items(), key=lambda item: item[1]["cpu_ms"]):
            ratio = row.get("x_bwrap")
            lines.append(f"  {name:<20} {row['cpu_ms']:8.2f}  over {row['launches']} launches"
                         + (f"  {ratio:5.2f}x" if ratio else "") + _peers(row))
    for kind, data in report.get("breakdown", {}).items():
        lines.append(f"\nwhere the time goes, {kind} (median of {data['launches']}; "
                     f"total {data['total_median_ms']} ms)")
        for step in data["steps"]:
            lines.append(f"  {step['median_ms']:7.3f}  {step['step']}")
    if "soak" in report:
        s = report["soak"]
        lines.append(f"\nsoak: {s['launches']} launches through {s['through']} in {s['seconds']} s;"
                     f" left behind: {s['left_behind'] or 'nothing'}; launcher RSS growth "
                     f"{s['rss_growth_mib']} MiB, helper "
                     f"{round(s['delta']['rss_kib_helper'] / 1024, 2)} MiB")
    if report.get("skipped"):
        lines.append("\nskipped:")
        lines += [f"  {name}: {why}" for name, why in report["skipped"].items()]
    lines += targets.table(report["targets"])
    return "\n".join(lines)


def _peers(row: dict[str, Any]) -> str:
    return "".join(f"  {ratio:5.2f}x {peer}" for peer, ratio in row.get("x_peers", {}).items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n")[0],
        epilog="Example: nsbox bench --quick --out /tmp/bench (a short check that all runs)")
    parser.add_argument("--quick", action="store_true",
                        help="a few rounds, a short soak: checks that everything runs")
    parser.add_argument("--rounds", type=int, default=None, help="latency rounds (default 100)")
    parser.add_argument("--soak", type=int, default=None,
                        help="launches in the leak soak (default 10000; 0 skips it)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="duration of each throughput measurement (default 3)")
    parser.add_argument("--pool-size", type=int, default=2)
    parser.add_argument("--out", default=RESULTS, help="directory for the JSON and the PNG")
    parser.add_argument("--no-peers", action="store_true",
                        help="nsbox and bwrap (with its seccomp and cgroup rows) only")
    args = parser.parse_args(argv)
    # The command line is measured as an installed one would run: from compiled bytecode
    # (PYTHONDONTWRITEBYTECODE would make it compile every module on every run).
    import compileall

    compileall.compile_dir(os.path.dirname(nsbox.__file__), quiet=2)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 100)
    cpu_launches = 40 if args.quick else 400
    soak_n = args.soak if args.soak is not None else (50 if args.quick else 10000)
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 3.0)
    traced = 10 if args.quick else 200

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    skipped: dict[str, str] = {}
    found = methods.peers(skipped)
    if args.no_peers:
        # The bwrap rows stay: they are the peers of the targets (bench/targets.py).
        kept = ("subprocess", "bwrap", "bwrap+seccomp", "bwrap+seccomp+cgroup")
        for method in found:
            if method.name not in kept:
                method.close()  # e.g. crun's bundle
        found = [m for m in found if m.name in kept]
    nsboxes = methods.nsbox_methods(args.pool_size)
    everything = []
    for method in found + nsboxes:
        try:
            method.run(["/bin/true"])  # a peer that cannot run here is skipped, with the reason
        except Exception as exc:  # noqa: BLE001 - any failure of a peer means "skip it"
            skipped[method.name] = f"fails here: {exc}"
            method.close()
            continue
        everything.append(method)
    report: dict[str, Any] = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {"rounds": rounds, "soak": soak_n, "throughput_seconds": seconds,
                   "pool_size": args.pool_size, "payloads": PAYLOADS},
        "methods": {m.name: {"command": m.describe, "isolation": m.isolation}
                    for m in everything},
        "skipped": skipped,
        # NSBOX_NATIVE=0 measures the Python child instead (docs/performance.md).
        "core": native.status()[1],
    }
    for name, why in skipped.items():
        say(f"skipped {name}: {why}")
    try:
        say(f"latency: {rounds} interleaved rounds of {len(everything)} launchers x "
            f"{len(PAYLOADS)} payloads")
        report["latency"] = measure.latency(everything, PAYLOADS, rounds)
        say("throughput")
        fast = [m for m in everything if m.name in ("subprocess", "bwrap", "nsbox API cold",
                                                    "nsbox pool")]
        report["throughput"] = measure.throughput(fast, ["/bin/true"], seconds)
        say(f"CPU of one launch: {cpu_launches} launches each")
        counted = [m for m in everything if m.name in CPU_ROWS]
        report["cpu"] = cpu.per_launch(counted, ["/bin/true"], cpu_launches)
    finally:
        for method in everything:
            method.close()
    say("breakdown")
    report["breakdown"] = measure.breakdown(["/bin/true"], traced, args.pool_size)
    if soak_n:
        say(f"soak: {soak_n} launches")
        report["soak"] = soak.soak(["/bin/true"], soak_n, warmup=20 if args.quick else 200,
                                   progress=say)
    report["targets"] = targets.judge(report)
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"bench-{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))
    print(f"\nwrote {path}")
    why = chart.draw(report, path[:-5] + ".png")
    print(why if why else f"wrote {path[:-5]}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
