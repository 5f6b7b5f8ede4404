"""The PNG chart of a run: latency of both payloads on one scale, throughput, CPU per launch.
matplotlib is an optional dependency of the bench alone (pip install 'nsbox[bench]')."""

from __future__ import annotations

from typing import Any

# The colour of a row says whose it is; the legend of every panel says so too.
KINDS = (("nsbox", "tab:blue"), ("bwrap", "tab:orange"), ("other launchers", "tab:gray"))


def _kind(name: str) -> str:
    if name.startswith("nsbox"):
        return "nsbox"
    return "bwrap" if name.startswith("bwrap") else "other launchers"


def _color(name: str) -> str:
    return dict(KINDS)[_kind(name)]


def _legend(ax: Any, names: list[str], where: str = "lower right") -> None:
    from matplotlib.patches import Patch

    shown = {_kind(n) for n in names}
    ax.legend(handles=[Patch(color=color, label=kind) for kind, color in KINDS if kind in shown],
              loc=where, fontsize=8)


def _latency(ax: Any, report: dict[str, Any], payload: str, limit: float) -> None:
    rows = report["latency"][payload]
    names = sorted(rows, key=lambda n: rows[n]["median_ms"])
    medians = [rows[n]["median_ms"] for n in names]
    low = [rows[n]["median_ms"] - rows[n]["p10_ms"] for n in names]
    high = [rows[n]["p90_ms"] - rows[n]["median_ms"] for n in names]
    ax.barh(names, medians, xerr=[low, high], color=[_color(n) for n in names], capsize=3)
    for y, name in enumerate(names):
        ratio = rows[name].get("x_bwrap")
        label = f"{rows[name]['median_ms']:.2f} ms" + (f"  ({ratio:.2f}x bwrap)"
                                                       if ratio is not None else "")
        ax.text(rows[name]["p90_ms"], y, "  " + label, va="center", fontsize=7)
    _log_axis(ax, 0.3, limit)
    ax.set_xlabel("ms per launch (median; bars p10-p90; log scale, the same in both panels)")
    ax.set_title(f"latency: {payload}", fontsize=10)
    _legend(ax, names)


def _log_axis(ax: Any, low: float, high: float) -> None:
    import matplotlib.ticker

    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _p: f"{x:g}"))


def _throughput(ax: Any, report: dict[str, Any]) -> None:
    """Each row's rate as a ratio to bwrap's with as many threads: one scale for all."""
    rates = report.get("throughput") or {}
    names = [n for n in rates if any(k.startswith("x_bwrap_") for k in rates[n])]
    counts = [k for k in (rates[names[0]] if names else {}) if not k.startswith("x_")]
    width = 0.8 / max(1, len(counts))
    for i, count in enumerate(counts):
        ys = [y + i * width for y in range(len(names))]
        ratios = [rates[n][f"x_bwrap_{count}"] for n in names]
        ax.barh(ys, ratios, height=width, color=[_color(n) for n in names],
                alpha=0.4 + 0.6 * (i + 1) / len(counts))
        for y, name, ratio in zip(ys, names, ratios, strict=True):
            ax.text(ratio, y, f" {count} thr: {ratio:.2f}x ({rates[name][count]:.0f}/s)",
                    va="center", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([y + 0.4 - width / 2 for y in range(len(names))], names)
    _log_axis(ax, 0.05, 60)
    ax.set_xlabel("launches per second of /bin/true as a ratio to bwrap's with as many threads "
                  "(1, 2, 4 threads: lighter to darker; log scale, 1 = bwrap)")
    ax.set_title("throughput", fontsize=10)
    _legend(ax, names, "upper right")


def _cpu(ax: Any, report: dict[str, Any]) -> None:
    rows = report.get("cpu") or {}
    names = sorted(rows, key=lambda n: rows[n]["cpu_ms"])
    values = [max(rows[n]["cpu_ms"], 0.01) for n in names]
    ax.barh(names, values, color=[_color(n) for n in names])
    for y, name in enumerate(names):
        ratio = rows[name].get("x_bwrap")
        ax.text(values[y], y, f" {rows[name]['cpu_ms']:.2f} ms"
                + (f" ({ratio:.2f}x bwrap)" if ratio is not None else ""), va="center",
                fontsize=7)
    _log_axis(ax, 0.3, max(values, default=1.0) * 8)
    ax.set_xlabel("CPU ms per launch of /bin/true, every process counted (log scale)")
    ax.set_title("CPU per launch", fontsize=10)
    _legend(ax, names)


def draw(report: dict[str, Any], path: str) -> str | None:
    """Write the chart; returns why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'nsbox[bench]'): no chart"
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    payloads = list(report["latency"])[:2]
    limit = max(row["p90_ms"] for rows in report["latency"].values() for row in rows.values())
    for ax, payload in zip(axes[0], payloads, strict=False):
        _latency(ax, report, payload, limit * 8)
    _throughput(axes[1][0], report)
    _cpu(axes[1][1], report)
    fig.suptitle(f"nsbox launch benchmark: {report['config']['rounds']} interleaved rounds, "
                 f"one run ({report['machine']['summary']}; load at start "
                 f"{' '.join(report['machine']['loadavg_at_start'])})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
