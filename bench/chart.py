"""The PNG chart of a run. matplotlib is an optional dependency of the bench alone."""

from __future__ import annotations

from typing import Any


def draw(report: dict[str, Any], path: str) -> str | None:
    """Write the chart; returns why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed (pip install 'nsbox[bench]'): no chart"
    payloads = list(report["latency"])
    fig, axes = plt.subplots(1, len(payloads), figsize=(6.5 * len(payloads), 4.8),
                             squeeze=False)
    for ax, payload in zip(axes[0], payloads, strict=True):
        rows = report["latency"][payload]
        names = sorted(rows, key=lambda n: rows[n]["median_ms"])
        medians = [rows[n]["median_ms"] for n in names]
        low = [rows[n]["median_ms"] - rows[n]["p10_ms"] for n in names]
        high = [rows[n]["p90_ms"] - rows[n]["median_ms"] for n in names]
        colors = ["tab:blue" if n.startswith("nsbox") else
                  "tab:orange" if n.startswith("bwrap") else "tab:gray" for n in names]
        ax.barh(names, medians, xerr=[low, high], color=colors, capsize=3)
        for y, name in enumerate(names):
            ratio = rows[name].get("x_bwrap")
            label = f"{rows[name]['median_ms']:.2f} ms" + (f"  ({ratio:.2f}x bwrap)"
                                                           if ratio is not None else "")
            ax.text(rows[name]["p90_ms"], y, "  " + label, va="center", fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _p: f"{x:g}"))
        ax.set_xlabel("latency per launch, ms (median, bars p10-p90; log scale)")
        ax.set_title(f"{payload}")
        ax.set_xlim(right=max(r["p90_ms"] for r in rows.values()) * 6)
    fig.suptitle(f"nsbox launch latency, interleaved, {report['config']['rounds']} rounds "
                 f"({report['machine']['summary']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
