"""The launch targets (issue 19), each judged from one run's figures: pass, miss, or not measured.

Every figure is a ratio against the peer that does the same work, from the same interleaved run
(bench/measure.py, ``PEERS``). Benchmark figures only: no test asserts them.
"""

from __future__ import annotations

from typing import Any

# key, figure, where it is read (section, row, ratio key), comparison, limit
TARGETS: list[tuple[str, str, tuple[str, str, str], str, float]] = [
    ("api_cold_x_bwrap_seccomp", "API cold, default profile, vs subprocess.run(bwrap+seccomp)",
     ("latency", "nsbox API cold", "bwrap+seccomp"), "<=", 0.9),
    ("api_cold_x_bwrap_cgroup", "API cold, default profile, vs bwrap in a fresh cgroup with "
     "the same limits", ("latency", "nsbox API cold", "bwrap+seccomp+cgroup"), "<=", 0.5),
    ("pool_x_bwrap_seccomp", "warm pool vs bwrap+seccomp",
     ("latency", "nsbox pool", "bwrap+seccomp"), "<=", 0.5),
    ("cli_x_bwrap", "CLI `nsbox run -- /bin/true`, whole process, vs bwrap",
     ("latency", "nsbox CLI", "bwrap"), "<=", 3.0),
    ("throughput_2_x_bwrap", "throughput, 2 launchers, vs bwrap",
     ("throughput", "nsbox API cold", "x_bwrap_2"), ">=", 1.0),
    ("cpu_x_bwrap", "CPU of one launch, all processes, vs bwrap",
     ("cpu", "nsbox API cold", "bwrap"), "<=", 1.2),
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
        out[key] = {"figure": figure, "value": value, "target": f"{compare} {limit}",
                    "peer": where[2], "met": met}
    if "soak" in report:
        soak = report["soak"]
        out["soak"] = {"figure": f"soak: {soak['launches']} launches",
                       "value": soak["rss_growth_mib"], "left_behind": soak["left_behind"],
                       "target": f"clean, RSS +< {SOAK_RSS_MIB:g} MiB", "met": soak["ok"]}
    return out


def table(judged: dict[str, Any]) -> list[str]:
    """The targets as lines of text: figure, value, target, and pass / MISS / not measured."""
    lines = ["\ntargets (issue 19): ratio to the peer of the same run"]
    for entry in judged.values():
        value = entry["value"]
        shown = "-" if value is None else (f"{value:.2f} MiB" if entry["figure"].startswith(
            "soak") else f"{value:.2f}x")
        verdict = {True: "pass", False: "MISS", None: "not measured"}[entry["met"]]
        lines.append(f"  {entry['figure']:<78} {shown:>10}  {entry['target']:<22} {verdict}")
    return lines
