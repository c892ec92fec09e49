"""The comparison of many builds (`flows.compare`): one row per build as a text table, a bar chart per measure, and
compare.html."""
from __future__ import annotations

from pathlib import Path

from tasks.report.markup import PRECISION_COLOR, badge, esc, fmt, img, num, page, table
from tasks.report.plots import pyplot, save_figure

COMPARE_COLUMNS = ("model", "target", "precision", "status", "cosine_min", "engine MB", "build s", "precision profile",
                   "engine p50 ms", "accuracy.metric=score", "registry", "runs", "run")


def profile_text(share: dict | None) -> str:
    if not isinstance(share, dict):
        return ""
    parts = sorted(((p, v) for p, v in share.items() if isinstance(v, (int, float)) and v > 0), key=lambda x: -x[1])
    return ", ".join(f"{p} {100 * v:.0f}%" for p, v in parts)


def compare_cells(row: dict) -> list[str]:
    """One row of the comparison as text; absent numbers stay empty. `row` holds what flows.compare collected."""
    def n(key: str, scale: float = 1.0, digits: str = ".6g") -> str:
        v = row.get(key)
        return "" if v is None else format(v * scale, digits)

    return [row["model"], row["target"], row["precision"], row.get("status") or "", n("cosine_min"),
            n("engine_bytes", 1e-6, ".2f"), n("build_seconds", 1.0, ".2f"), profile_text(row.get("flops_share")),
            n("engine_p50_ms", 1.0, ".3f"), accuracy_cell(row), row.get("registry") or "", str(row.get("runs", "")),
            row["run_id"][:8]]


def accuracy_cell(row: dict) -> str:
    """The metric that gated the build and its (worst) value, one word: ``allclose=1``; empty when not measured."""
    if row.get("accuracy_metric") is None or row.get("accuracy_score") is None:
        return ""
    return f"{row['accuracy_metric']}={row['accuracy_score']:.6g}" + ("" if row.get("accuracy_passed", True) else "(FAILED)")


def compare_text(rows: list[dict]) -> str:
    cells = [list(COMPARE_COLUMNS)] + [[c or "-" for c in compare_cells(r)] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COMPARE_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def compare_plot(rows: list[dict], path: Path) -> Path | None:
    """Bars per build: accuracy loss, engine size, build time and engine latency (each only where measured)."""
    panels = [(k, t) for k, t in (("cosine_min", "1 - cosine_min (lower is better)"), ("engine_bytes", "engine MB"),
                                  ("build_seconds", "build seconds"), ("engine_p50_ms", "engine p50 ms"),
                                  ("flops_share", "share of FLOPs per precision"))
              if any(r.get(k) is not None for r in rows)]
    if not panels:
        return None
    plt = pyplot()
    labels = [f"{r['model']} {r['target']} {r['precision']}" for r in rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.35 * len(rows) + 1.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        vals = [r.get(key) for r in rows]
        y = [i for i, v in enumerate(vals) if v is not None]
        xs = [vals[i] for i in y]
        if key == "flops_share":
            left = [0.0] * len(y)
            for p in PRECISION_COLOR:
                w = [float(x.get(p) or 0.0) for x in xs]
                ax.barh(y, w, left=left, color=PRECISION_COLOR[p], label=p)
                left = [a + b for a, b in zip(left, w)]
            ax.legend(fontsize=7)
        else:
            if key == "cosine_min":  # a loss of exactly 0 still gets a (labelled) sliver on the log axis
                xs = [max(1.0 - v, 1e-12) for v in xs]
                ax.set_xscale("log")
            elif key == "engine_bytes":
                xs = [v / 1e6 for v in xs]
            bars = ax.barh(y, xs, color=[PRECISION_COLOR.get(rows[i]["precision"], "#757575") for i in y])
            ax.bar_label(bars, labels=[fmt(1.0 - vals[i]) if key == "cosine_min" else f"{x:.3g}" for i, x in zip(y, xs)],
                         fontsize=7, padding=2)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels if ax is axes[0][0] else [""] * len(rows), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, path)


def compare_html(rows: list[dict], source: str, plot: Path | None) -> str:
    body = [f"<h1>trtforge: {len(rows)} tracked build(s)</h1>",
            f'<p class="muted">latest run per model × target × precision in {esc(source)}. Empty cells were not '
            "measured (engine latency needs a GPU of the target's compute capability).</p>"]
    cells = [compare_cells(r) for r in rows]
    for r, c in zip(rows, cells):
        c[3] = badge(c[3]) if c[3] else ""
        for i, key in ((4, "cosine_min"), (5, "engine_bytes"), (6, "build_seconds"), (8, "engine_p50_ms")):
            if r.get(key) is not None:
                c[i] = num(f"run:{r['run_id']}", key, r[key], c[i])
        c[0], c[1], c[2] = esc(c[0]), esc(c[1]), esc(c[2])
        c[7], c[10], c[12] = esc(c[7]), esc(c[10]), f"<code>{esc(r['run_id'])}</code>"
        c[9] = num(f"run:{r['run_id']}", "accuracy_score", r["accuracy_score"], c[9]) if c[9] else ""
    body.append(table(list(COMPARE_COLUMNS), cells, numeric=[4, 5, 6, 8, 11]))
    if plot is not None:
        body.append(img(plot, "per build: accuracy loss, engine size, build time, engine latency where measured"))
    return page("trtforge: compare", "".join(body))
