"""The text of a bench run: every section's table, then the targets."""

from __future__ import annotations

from typing import Any

from nsbox.bench import targets


def _peers(row: dict[str, Any]) -> str:
    return "".join(f"  {ratio:5.2f}x {peer}" for peer, ratio in row.get("x_peers", {}).items())


def _latency(report: dict[str, Any]) -> list[str]:
    lines = []
    for payload, rows in report.get("latency", {}).items():
        lines.append(f"\nlatency of {payload}, whole launch from this process (median, "
                     "p10-p90, ms; ratio to bwrap; to the peer doing the same work)")
        for name, row in sorted(rows.items(), key=lambda item: item[1]["median_ms"]):
            ratio = row.get("x_bwrap")
            lines.append(f"  {name:<22} {row['median_ms']:8.2f}  {row['p10_ms']:7.2f}-"
                         f"{row['p90_ms']:<7.2f}" + (f"  {ratio:5.2f}x" if ratio else "")
                         + _peers(row))
    return lines


def _throughput(report: dict[str, Any]) -> list[str]:
    rates = report.get("throughput")
    if not rates:
        return []
    counts = [k for k in next(iter(rates.values())) if not k.startswith("x_")]
    lines = ["\nthroughput, /bin/true launches per second, N threads of one process launching "
             "back to back (ratio to bwrap with as many threads)",
             "  " + " " * 22 + "".join(f"{'N=' + k:>18}" for k in counts)]
    for name, row in rates.items():
        cells = "".join(f"{row[k]:8.1f}" + (f" ({row['x_bwrap_' + k]:4.2f}x)"
                                           if f"x_bwrap_{k}" in row else " " * 8)
                        + "  " for k in counts)
        lines.append(f"  {name:<22} {cells}")
    return lines


def _cpu(report: dict[str, Any]) -> list[str]:
    rows = report.get("cpu")
    if not rows:
        return []
    lines = ["\nCPU of one launch of /bin/true, every process counted (child subreapers reap "
             "the orphans; ms per launch; 'host': the launching process itself)"]
    for name, row in sorted(rows.items(), key=lambda item: item[1]["cpu_ms"]):
        ratio = row.get("x_bwrap")
        lines.append(f"  {name:<22} {row['cpu_ms']:8.2f}  host {row['host_ms']:6.2f}  over "
                     f"{row['launches']} launches" + (f"  {ratio:5.2f}x" if ratio else "")
                     + _peers(row))
    return lines


def _memory(report: dict[str, Any]) -> list[str]:
    memory = report.get("memory")
    if not memory:
        return []
    lines = ["\nmemory: the launch processes this process keeps (resident now, high-water "
             "mark), and the peak charged to one run"]
    for proc in memory["launch_processes"]:
        lines.append(f"  {proc['role']} {proc['name']} (pid {proc['pid']}): RSS "
                     f"{proc['rss_kib'] / 1024:.1f} MiB, HWM {proc['hwm_kib'] / 1024:.1f} MiB")
    for payload, peak in memory["run_peak"].items():
        lines.append(f"  run peak, {payload}: median {peak['median_kib'] / 1024:.1f} MiB, max "
                     f"{peak['max_kib'] / 1024:.1f} MiB over {peak['launches']} runs "
                     f"(from {peak['accounting']})")
    return lines


def _breakdown(report: dict[str, Any]) -> list[str]:
    lines = []
    for kind, data in report.get("breakdown", {}).items():
        lines.append(f"\nwhere the time goes, {kind} (median of {data['launches']}; "
                     f"total {data['total_median_ms']} ms)")
        for step in data["steps"]:
            lines.append(f"  {step['median_ms']:7.3f}  {step['step']}")
    return lines


def _soak(report: dict[str, Any]) -> list[str]:
    if "soak" not in report:
        return []
    s = report["soak"]
    return [f"\nsoak: {s['launches']} launches through {s['through']} in {s['seconds']} s; "
            f"left behind: {s['left_behind'] or 'nothing'}; RSS growth: launcher "
            f"{s['rss_growth_mib']} MiB, its launch processes (the launch helper) "
            f"{s['helper_growth_mib']} MiB"]


def text(report: dict[str, Any]) -> str:
    lines = [f"machine: {report['machine']['summary']}; load at start "
             f"{' '.join(report['machine']['loadavg_at_start'])}; launch core: "
             f"{report.get('core', '?')}"]
    for part in (_latency, _throughput, _cpu, _memory, _breakdown, _soak):
        lines += part(report)
    if report.get("skipped"):
        lines.append("\nskipped:")
        lines += [f"  {name}: {why}" for name, why in report["skipped"].items()]
    quick = bool(report.get("config", {}).get("quick"))
    lines += targets.table(report["targets"], quick=quick)
    return "\n".join(lines)
