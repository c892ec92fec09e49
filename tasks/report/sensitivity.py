"""Per-layer sensitivity (what quantizing or restoring each layer costs or gains): its JSON table and bar chart, and
what keeps the quantized share of the layer FLOPs down (the high-precision layers with the most FLOPs)."""
from __future__ import annotations

from pathlib import Path

from tasks.common.util import write_json
from tasks.report.markup import esc, table
from tasks.report.plots import pyplot, save_figure

GROWTH_ROWS = 60  # fp16 search: the nodes that add the most error, plotted (sensitivity.json lists every node)


def sensitivity_report(segments: list[dict], d: Path) -> dict[str, Path]:
    """The per-layer sensitivity table (JSON) and a bar chart: each layer's local error (what restoring it gains, in
    reports of earlier builds)."""
    rows = [{"segment": s["segment"], **r, "kept_high_precision": r["node"] in set(s.get("fallback", []))}
            for s in segments for r in s.get("sensitivity", [])]
    files = {"sensitivity": write_json(d / "sensitivity.json", {"layers": rows, "segments": [
        {k: s.get(k) for k in ("segment", "method", "range_choice", "precision", "quantized", "fallback", "min_cosine",
                               "fp32_by_data_range", "fp32_by_cancellation", "search_set", "search_statistic",
                               "cosine_fp16", "closest")}
        for s in segments]})}
    gain = [r for r in rows if r.get("restore_gain") is not None]
    local = [r for r in rows if r.get("local_error") is not None]
    growth = [r for r in rows if r.get("error_growth") is not None]
    if gain or local or growth:  # the search's measured ranking when it searched, else each layer's local error
        plt = pyplot()
        rows, value, label = (
            (sorted(gain, key=lambda r: -r["restore_gain"]), lambda r: max(r["restore_gain"], 1e-7),
             "cosine to fp32 gained by restoring only this layer in the all-quantized graph (a calibration sample)")
            if gain else
            (sorted(local, key=lambda r: -r["local_error"]), lambda r: max(r["local_error"], 1e-12),
             "relative squared error of the layer's own output with only it quantized (from fp32 inputs)") if local else
            (sorted(growth, key=lambda r: -r["error_growth"])[:GROWTH_ROWS], lambda r: max(r["error_growth"], 1e-9),
             "relative error this node adds in the fp16 graph (its outputs' less its inputs', the hardest held-out "
             "sample)"))
        fig, ax = plt.subplots(figsize=(10, max(3.0, 0.18 * len(rows) + 1)))
        colors = ["#c62828" if r["kept_high_precision"] else "#2e7d32" for r in rows]
        ax.barh(range(len(rows)), [value(r) for r in rows], color=colors)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r["node"] for r in rows], fontsize=6)
        ax.set_xscale("log")
        ax.set_xlabel(label + " (red: kept in higher precision)")
        ax.set_title("quantization sensitivity per layer")
        files["sensitivity_plot"] = save_figure(fig, d / "sensitivity.png")
    return files


HELD_ROWS = 5  # layers kept in high precision shown, the most FLOPs first


def held_back(segments: list[dict], top: int = 3) -> tuple[float, list[dict]] | None:
    """(the share of the layer FLOPs quantized, the ``top`` layers kept in high precision with the most FLOPs: node,
    share of the FLOPs, its own output error alone where measured) from the segments' sensitivity rows; None when the
    rows carry no FLOPs or no search result."""
    rows = [r for s in segments for r in s.get("sensitivity", []) if r.get("flops")]
    total = sum(r["flops"] for r in rows)
    if not total or not any("quantized" in r for r in rows):
        return None
    share = sum(r["flops"] for r in rows if r.get("quantized")) / total
    kept = sorted((r for r in rows if not r.get("quantized")), key=lambda r: -r["flops"])[:top]
    return share, [{"node": r["node"], "flops_share": r["flops"] / total, "local_error": r.get("local_error"),
                    "kept_because": r.get("kept_because")} for r in kept]


def held_back_table(sens: dict | None) -> str:
    """What keeps the quantized share of the layer FLOPs below all: the layers kept in high precision with the most
    FLOPs, each one's share and its own output error with only it quantized (held_back)."""
    rows = (sens or {}).get("layers") or []
    held = held_back([{"sensitivity": [{**r, "quantized": not r.get("kept_high_precision")} for r in rows]}],
                     HELD_ROWS) if rows else None
    if held is None or not held[1]:
        return ""
    share, kept = held
    return (f"<p>{share:.1%} of the Conv/MatMul/Gemm FLOPs are quantized (FLOPs counted on the ONNX graph at the "
            f"shape of the search's first sample); the layers kept in higher precision that hold the most back:</p>"
            + table(["layer", "share of the FLOPs", "its own output error, quantized alone", "why kept"],
                    [[esc(r["node"]), f"{r['flops_share']:.1%}",
                      "n/m" if r["local_error"] is None else f"{r['local_error']:.3g}",
                      esc(r.get("kept_because") or "")] for r in kept], numeric=[1, 2]))
