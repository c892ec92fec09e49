"""The build report's plots (matplotlib, drawn off screen): accuracy per output and validation input, latency per
run."""
from __future__ import annotations

import math
from pathlib import Path

from tasks.report.markup import fmt


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def accuracy_plot(validation: dict, path: Path) -> Path | None:
    """Per output and validation input: 1 - cosine and max/mean absolute error against the fp32 reference."""
    per_feed = validation.get("per_feed") or (validation.get("emulation") or {}).get("per_feed") or []
    if not per_feed:
        return None
    plt = pyplot()
    outputs = list(per_feed[0])[:12]
    x = list(range(len(per_feed)))
    acc = validation.get("accuracy") or {}
    own = acc.get("metric") not in (None, "cosine") and acc.get("per_sample")  # the user's metric, in its own units
    fig, axes = plt.subplots(1, 3 if own else 2, figsize=(16.5 if own else 11, 3.6))
    a1, a2 = axes[0], axes[1]
    if own:
        a3, rows = axes[2], acc["per_sample"]
        if acc.get("outputs"):  # built-in metrics: per sample and output
            for name in list(acc["outputs"])[:12]:
                a3.plot(range(len(rows)), [r["outputs"].get(name, float("nan")) for r in rows], marker="o", label=name)
            a3.set_xlabel("validation sample #")
        else:  # a user function: per batch
            a3.plot(range(len(rows)), [r["score"] for r in rows], marker="o", label=acc["metric"])
            for i, r in enumerate(rows):
                if not r.get("passed", True):
                    a3.plot([i], [r["score"]], marker="x", color="#c62828", ms=10)
            a3.set_xlabel("validation batch # (x: failed)")
        a3.set_title(f"{acc['metric']} ({'higher' if acc.get('greater_is_better', True) else 'lower'} is better)",
                     fontsize=10)
        a3.grid(alpha=0.3)
        a3.legend(fontsize=7)
    for name in outputs:
        cos = [f[name]["cosine"] for f in per_feed if name in f]
        a1.plot(x[:len(cos)], [max(1.0 - c, 0.0) for c in cos], marker="o", label=name)
        a2.plot(x[:len(cos)], [f[name]["max_abs"] for f in per_feed if name in f], marker="o", label=f"{name} max")
        a2.plot(x[:len(cos)], [f[name]["mean_abs"] for f in per_feed if name in f], marker="x", ls="--", label=f"{name} mean")
    for ax, title in ((a1, "1 - cosine to fp32"), (a2, "absolute error vs fp32")):
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        if ys and min(ys) > 0 and all(math.isfinite(y) for y in ys):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("validation input #")
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"accuracy on {validation.get('inputs', '?')}", fontsize=10)
    return save_figure(fig, path)


def latency_plot(benchmark: dict, path: Path) -> Path | None:
    """Histogram of per-iteration latencies for each timed runtime, with its p50/p90/p99."""
    series = [(b.get("runtime", key), b) for key, b in (("native", benchmark.get("native")), ("engine", benchmark.get("engine")))
              if isinstance(b, dict) and b.get("times_ms")]
    if not series:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 3.4), squeeze=False)
    for ax, (label, b) in zip(axes[0], series):
        ax.hist(b["times_ms"], bins=min(40, max(5, len(b["times_ms"]) // 2)), color="#5c6bc0", alpha=0.85)
        for q, style in (("p50_ms", "-"), ("p90_ms", "--"), ("p99_ms", ":")):
            if q in b:
                ax.axvline(b[q], color="#c62828", ls=style, label=f"{q[:-3]} {fmt(b[q])} ms")
        ax.set_title(f"{label}: {len(b['times_ms'])} runs", fontsize=10)
        ax.set_xlabel("latency per run (ms)")
        ax.set_ylabel("runs")
        ax.legend(fontsize=8)
    return save_figure(fig, path)
