"""The launch targets, each judged from one run's figures: pass, miss, or not measured.

Every figure is a ratio against a peer measured in the same run (interleaved latency, the same
throughput and CPU sections), never an absolute time: the machine's speed cancels out.
Benchmark figures only: no test asserts them (docs/performance.md).
"""

from __future__ import annotations

from typing import Any

# key, figure, where it is read (section, row, ratio key), comparison, limit
TARGETS: list[tuple[str, str, tuple[str, str, str], str, float]] = [
    ("api_cold_x_bwrap", "nsbox.run cold, default policy, vs subprocess.run(bwrap ...) "
     "(no seccomp, no cgroup)", ("latency", "nsbox API cold", "bwrap"), "<=", 0.9),
    ("pool_x_bwrap", "warm pool vs bwrap", ("latency", "nsbox pool", "bwrap"), "<=", 0.5),
    ("cli_x_bwrap", "nsbox run -- /bin/true, the installed command, whole process, vs bwrap",
     ("latency", "nsbox CLI", "bwrap"), "<=", 3.0),
    ("throughput_2_x_bwrap", "throughput, 2 threads launching back to back, vs bwrap",
     ("throughput", "nsbox API cold", "x_bwrap_2"), ">=", 1.0),
    ("cpu_x_bwrap_seccomp", "CPU of one launch, every process counted, vs bwrap+seccomp",
     ("cpu", "nsbox API cold", "bwrap+seccomp"), "<=", 1.2),
]
SOAK_RSS_MIB = 5.0


def _value(report: dict[str, Any], where: tuple[str, str, str]) -> float | None:
    section, row, peer = where
    if section == "latency":
        found = report.get("latency", {}).get("/bin/true", {}).get(row, {})
    else:
        found = report.get(section, {}).get(row, {})
    if section == "throughput":
        value = found.get(peer)
    else:
        ratios = {"bwrap": found.get("x_bwrap"), **found.get("x_peers", {})}
        value = ratios.get(peer)
    return float(value) if value is not None else None


def judge(report: dict[str, Any]) -> dict[str, Any]:
    """{key: {figure, value, target, met}}; met is None when the figure was not measured
    (a peer skipped, a section left out)."""
    out: dict[str, Any] = {}
    for key, figure, where, compare, limit in TARGETS:
        value = _value(report, where)
        met = None if value is None else (value <= limit if compare == "<=" else value >= limit)
        out[key] = {"figure": figure, "value": value, "target": f"{compare} {limit:g}x",
                    "peer": where[2], "met": met}
    if "soak" in report:
        soak = report["soak"]
        out["soak"] = {"figure": f"soak: {soak['launches']} launches, nothing left behind, "
                                 "no growth",
                       "value": max(soak["rss_growth_mib"], soak.get("helper_growth_mib", 0.0)),
                       "left_behind": soak["left_behind"],
                       "target": f"clean, RSS +< {SOAK_RSS_MIB:g} MiB", "met": soak["ok"]}
    return out


def table(judged: dict[str, Any], quick: bool = False) -> list[str]:
    """The targets as lines of text: figure, value, target, and pass / MISS / not measured."""
    lines = ["\ntargets: each a ratio to the peer of the same run"]
    if quick:
        lines.append("  (a --quick run: too few launches to judge anything; it checks that "
                     "every section works)")
    for entry in judged.values():
        value = entry["value"]
        shown = "-" if value is None else (f"+{value:.2f} MiB" if entry["figure"].startswith(
            "soak") else f"{value:.2f}x")
        verdict = {True: "pass", False: "MISS", None: "not measured"}[entry["met"]]
        if entry["met"] is False and entry.get("left_behind"):
            verdict += f" (left: {entry['left_behind']})"
        lines.append(f"  {entry['figure']:<84} {shown:>11}  {entry['target']:<22} {verdict}")
    return lines
