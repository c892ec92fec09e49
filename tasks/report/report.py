"""Readable pages from results: `report.html` for one build (from its summary.json and the stage reports beside it)
and `compare.html` for many (from rows the caller collected). Pure: files and dicts in, PNG plots and HTML out.

Every number on a page is read from those files; a number that is absent there is absent on the page. Numbers are
tagged `data-key="<file>:<path>"` with their exact value in `data-value`, so a test can check the page against them.
"""
from __future__ import annotations

import base64
import collections
import html
import json
import math
from pathlib import Path
from typing import Any, Iterable

from tasks.common.util import write_json

STAGES = ("export", "partition", "build", "calibrate", "validate", "benchmark")
STATUS_COLOR = {"ok": "#2e7d32", "cached": "#0277bd", "skipped": "#9e9e9e", "failed": "#c62828"}
PRECISION_COLOR = {"fp32": "#5c6bc0", "fp16": "#26a69a", "int8": "#ffa726", "fp8": "#ef5350"}
# pictures made by the stages: file name -> caption (others found beside summary.json are shown under "more figures")
STAGE_FIGURES = {"partition.png": "partition", "sensitivity.png": "sensitivity"}
OWN_FIGURES = ("accuracy.png", "latency.png", "precision_profile.png", "traffic.png")

CSS = """
body{font:14px/1.45 "DejaVu Sans",system-ui,sans-serif;margin:0;color:#212121;background:#fafafa}
main{max-width:1100px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:6px 0;background:#fff} td,th{border:1px solid #e0e0e0;padding:3px 8px;text-align:left;
vertical-align:top} th{background:#f5f5f5;font-weight:600} td.n{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:1px 8px;border-radius:9px;color:#fff;font-size:12px}
.bar{height:12px;display:inline-block;vertical-align:middle} .muted{color:#757575} .warn{color:#8d4b00}
img{max-width:100%;border:1px solid #e0e0e0;background:#fff} pre{background:#fff;border:1px solid #e0e0e0;padding:8px;
overflow:auto;font-size:12px} code{font-size:12px} details{margin:6px 0} .err{color:#c62828;white-space:pre-wrap}
"""


# --- small pieces ------------------------------------------------------------------------------------------------

def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def fmt(v: Any) -> str:
    """How a number is shown: integers as is, floats with 6 significant digits (bigger ones with one decimal)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.1f}" if abs(v) >= 1e5 else f"{v:.6g}"


def num(doc: str, path: str, v: Any, shown: str | None = None) -> str:
    """A number with its source: `doc:path` and the exact value, for checking the page against the files."""
    return (f'<span class="num" data-key="{esc(doc)}:{esc(path)}" data-value="{esc(json.dumps(v))}">'
            f"{esc(fmt(v) if shown is None else shown)}</span>")


def badge(status: str) -> str:
    return f'<span class="badge" style="background:{STATUS_COLOR.get(status, "#616161")}">{esc(status)}</span>'


def table(head: list[str], rows: Iterable[list[str]], numeric: Iterable[int] = ()) -> str:
    numeric = set(numeric)
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + f"</tr>{body}</table>"


def img(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<figure><img alt="{esc(alt)}" src="data:image/png;base64,{data}"><figcaption class="muted">{esc(alt)}' \
           f"</figcaption></figure>"


def page(title: str, body: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>'
            f"<body><main>{body}</main></body></html>\n")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def _read(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def warnings_in(doc: Any, where: str = "") -> list[tuple[str, str]]:
    """Every `warnings` entry (and stage `note`) anywhere in a report, with where it was found."""
    found = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            here = f"{where}.{k}" if where else k
            if k == "warnings" and isinstance(v, list):
                found += [(where or "-", str(w)) for w in v]
            elif k == "note" and isinstance(v, str):
                found.append((where or "-", v))
            else:
                found += warnings_in(v, here)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += warnings_in(v, f"{where}[{i}]")
    return found


# --- plots --------------------------------------------------------------------------------------------------------

def accuracy_plot(validation: dict, path: Path) -> Path | None:
    """Per output and validation input: 1 - cosine and max/mean absolute error against the fp32 reference."""
    per_feed = validation.get("per_feed") or (validation.get("emulation") or {}).get("per_feed") or []
    if not per_feed:
        return None
    plt = _pyplot()
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
    return _save(fig, path)


def latency_plot(benchmark: dict, path: Path) -> Path | None:
    """Histogram of per-iteration latencies for each timed runtime, with its p50/p90/p99."""
    series = [(b.get("runtime", key), b) for key, b in (("native", benchmark.get("native")), ("engine", benchmark.get("engine")))
              if isinstance(b, dict) and b.get("times_ms")]
    if not series:
        return None
    plt = _pyplot()
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
    return _save(fig, path)


# --- report.html --------------------------------------------------------------------------------------------------

GROWTH_ROWS = 60  # fp16 search: the nodes that add the most error, plotted (sensitivity.json lists every node)


def sensitivity_report(segments: list[dict], d: Path) -> dict[str, Path]:
    """The per-layer sensitivity table (JSON) and a bar chart: each layer's local error (what restoring it gains, in
    reports of earlier builds)."""
    rows = [{"segment": s["segment"], **r, "kept_high_precision": r["node"] in set(s.get("fallback", []))}
            for s in segments for r in s.get("sensitivity", [])]
    files = {"sensitivity": write_json(d / "sensitivity.json", {"layers": rows, "segments": [
        {k: s.get(k) for k in ("segment", "method", "range_choice", "precision", "quantized", "fallback", "min_cosine",
                               "fp32_by_data_range", "fp32_by_cancellation", "search_set", "search_statistic",
                               "cosine_fp16")}
        for s in segments]})}
    gain = [r for r in rows if r.get("restore_gain") is not None]
    local = [r for r in rows if r.get("local_error") is not None]
    growth = [r for r in rows if r.get("error_growth") is not None]
    if gain or local or growth:  # the search's measured ranking when it searched, else each layer's local error
        plt = _pyplot()
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
        files["sensitivity_plot"] = _save(fig, d / "sensitivity.png")
    return files



def write_report(out_dir: Path) -> Path:
    """report.html in a result folder that holds summary.json and the stages' reports and plots (validate draws
    accuracy.png, benchmark latency.png: a cached stage brings its figure, nothing is drawn again)."""
    out_dir = Path(out_dir)
    path = out_dir / "report.html"
    path.write_text(report_html(out_dir))
    return path


def report_html(out_dir: Path) -> str:
    out_dir = Path(out_dir)
    s = json.loads((out_dir / "summary.json").read_text())
    docs = {name: _read(out_dir / f"{name}.json") for name in ("partition", "validation", "benchmark", "sensitivity")}
    title = f"{s.get('model')} → {s.get('target')} {s.get('precision')}"
    parts = [f"<h1>{esc(title)} {badge(s.get('status', '?'))}</h1>",
             '<p class="muted">trtforge build report: every number below is read from summary.json and the stage '
             "reports beside it; what was not measured is not shown.</p>"]
    if s.get("error"):
        parts.append(f'<p class="err">{esc(s["error"])}</p>')
    parts += [_stages(s), _partition(s, docs["partition"], out_dir), _traffic(s, out_dir), _accuracy(s, docs["validation"], out_dir),
              _quantization(s, docs["sensitivity"], out_dir), _precision_profile(s, out_dir), _benchmark(s, docs["benchmark"], out_dir),
              _engines(s), _more_figures(out_dir), _metrics(s), _warnings(s, docs), _config(s, out_dir)]
    return page(f"trtforge: {title}", "".join(p for p in parts if p))


def _stages(s: dict) -> str:
    stages = s.get("stages", {})
    longest = max([st.get("seconds") or 0 for st in stages.values()] + [1e-9])
    rows = []
    for name in [n for n in STAGES if n in stages] + [n for n in stages if n not in STAGES]:
        st = stages[name]
        secs = st.get("seconds")
        width = 0 if secs is None else max(1, int(300 * secs / longest))
        bar = f'<span class="bar" style="width:{width}px;background:{STATUS_COLOR.get(st.get("status"), "#616161")}"></span>'
        rows.append([esc(name), badge(st.get("status", "?")),
                     "" if secs is None else num("summary", f"stages.{name}.seconds", secs) + " s", bar,
                     esc(st.get("reason", ""))])
    return "<h2>Stages</h2>" + table(["stage", "status", "seconds", "timeline", "reason"], rows, numeric=[2])


def _partition(s: dict, plan: dict | None, out_dir: Path) -> str:
    m = s.get("metrics", {})
    if plan is None and "trt_subgraphs" not in m:
        return ""
    facts = [f"{num('summary', 'metrics.' + k, m[k])} {label}" for k, label in
             (("trt_subgraphs", "TensorRT subgraph(s)"), ("trt_nodes", "nodes in TensorRT"),
              ("fallback_nodes", "nodes in ONNX Runtime")) if k in m]
    out = "<h2>Partition</h2><p>" + ", ".join(facts) + (
        f" of {num('partition', 'nodes', plan['nodes'])} nodes" if plan and "nodes" in plan else "") + "</p>"
    if plan and plan.get("segments"):
        out += table(["segment", "runs in", "nodes", "inputs", "outputs"],
                     [[str(g.get("index")), esc(g.get("kind")), str(len(g.get("nodes", []))) if isinstance(g.get("nodes"), list)
                       else esc(g.get("nodes", "")), esc(", ".join(g.get("inputs", []))[:200]),
                       esc(", ".join(g.get("outputs", []))[:200])] for g in plan["segments"]], numeric=[2])
    if plan and plan.get("fallback_nodes"):
        fb = plan["fallback_nodes"]
        out += "<details><summary>nodes that run in ONNX Runtime, and why</summary>" + table(
            ["node", "op", "reason"], [[esc(f.get("name") or f"#{f.get('index')}"), esc(f.get("op")), esc(f.get("reason"))]
                                       for f in fb[:200]]) + (f"<p>… and {len(fb) - 200} more</p>" if len(fb) > 200 else "") \
            + "</details>"
    if (out_dir / "partition.png").is_file():
        out += img(out_dir / "partition.png", "partition: which nodes run in TensorRT and which natively")
    return out


def _accuracy(s: dict, v: dict | None, out_dir: Path) -> str:
    st = s.get("stages", {}).get("validate", {})
    if v is None:
        reason = st.get("reason")
        return "<h2>Accuracy</h2><p>not measured" + (f": {esc(reason)}" if reason else "") + "</p>"
    m = s.get("metrics", {})
    head = "<h2>Accuracy</h2>"
    if "cosine_min" in m:
        head += f"<p>lowest cosine to the fp32 reference: <b>{num('summary', 'metrics.cosine_min', m['cosine_min'])}</b>"
        if "min_cosine" in v:
            head += f" (budget accuracy.min_cosine {num('validation', 'min_cosine', v['min_cosine'])}" \
                    f"{', passed' if v.get('passed') else ', FAILED'})"
        head += "</p>"
    head += _metric(v.get("accuracy"))
    if v.get("verdict"):
        head += f"<p>verdict: <b>{esc(v['verdict'])}</b></p>"
    for why in v.get("evidence") or []:
        head += f"<p class='warn'>before shipping: {esc(why)}</p>"
    feeds = v.get("feeds", [])
    head += (f"<p>measured on: <b>{esc(v.get('inputs', '?'))}</b>, {v.get('samples', len(feeds))} sample(s) in "
             f"{len(feeds)} input(s) {esc('; '.join(', '.join(f'{n} {sh}' for n, sh in f.items()) for f in feeds[:6]))}"
             f"{' …' if len(feeds) > 6 else ''}. What ran: the precision-transformed ONNX graph in ONNX Runtime vs the "
             f"fp32 model (the engine's own output only where a GPU of the target's compute capability ran it).</p>")
    sets = [[esc(key), num("summary", f"data.{key}.samples", d.get("samples")), esc(d.get("source", "")),
             esc("; ".join(d.get("notes") or []))] for key, d in (s.get("data") or {}).items()]
    if sets:
        head += "<p class='muted'>data sets (disjoint: no sample is in two of them):</p>" + \
            table(["set", "samples", "source", "notes"], sets, numeric=[1])
    rows = [[esc(name), num("validation", f"outputs.{name}.cosine", o["cosine"]),
             num("validation", f"outputs.{name}.cosine_worst_feed", o["cosine_worst_feed"]) if "cosine_worst_feed" in o else "",
             num("validation", f"outputs.{name}.max_abs", o["max_abs"]), num("validation", f"outputs.{name}.mean_abs", o["mean_abs"]),
             num("validation", f"outputs.{name}.ref_max_abs", o["ref_max_abs"]) if "ref_max_abs" in o else ""]
            for name, o in (v.get("outputs") or {}).items()]
    out = head + table(["output", "cosine (all inputs)", "cosine (worst input)", "max |error|", "mean |error|",
                        "max |reference|"], rows, numeric=[1, 2, 3, 4, 5])
    eng = v.get("engine") or {}
    if eng.get("status") == "ok":
        out += f"<p>engine on the GPU: lowest cosine {num('validation', 'engine.cosine_min', eng['cosine_min'])}</p>"
    elif eng.get("reason"):
        out += f"<p class='muted'>engine output not compared: {esc(eng['reason'])}</p>"
    if (out_dir / "accuracy.png").is_file():
        out += img(out_dir / "accuracy.png", "accuracy per output and validation input")
    return out


def _metric(acc: dict | None) -> str:
    """The metric that gated (accuracy.metric) by name: its rule, worst value, value per output, the logits of outputs
    from a final Softmax/Sigmoid/LogSoftmax, and which level gated."""
    if not acc:
        return ""
    out = (f"<p>accuracy.metric <b>{esc(acc['metric'])}</b>: {esc(acc.get('rule', ''))}; worst "
           f"{'score' if acc.get('greater_is_better', True) else 'score (lower is better)'} "
           f"<b>{num('validation', 'accuracy.score', acc['score'])}</b>, "
           f"{'passed' if acc.get('passed') else 'FAILED'} (gated by the {esc(acc.get('gated_by', 'outputs'))})</p>")
    if acc.get("outputs"):
        out += table(["output", f"{acc['metric']} (all inputs)"],
                     [[esc(n), num("validation", f"accuracy.outputs.{n}", x)] for n, x in acc["outputs"].items()],
                     numeric=[1])
    if acc.get("logits"):
        out += "<p class='muted'>on the logits (the input of the final activation):</p>" + table(
            ["output", "op", "logits", "cosine", "allclose within", "atol", "rtol", "max |error|"],
            [[esc(n), esc(r["op"]), esc(r["logits"]), num("validation", f"accuracy.logits.{n}.cosine", r["cosine"]),
              num("validation", f"accuracy.logits.{n}.allclose_within", r["allclose_within"]), fmt(r["atol"]),
              fmt(r["rtol"]), num("validation", f"accuracy.logits.{n}.max_abs", r["max_abs"])]
             for n, r in acc["logits"].items()], numeric=[3, 4, 5, 6, 7])
    elif acc.get("logits_not_measured"):
        out += f"<p class='muted'>logits not compared: {esc(acc['logits_not_measured'])}</p>"
    return out


def _quantization(s: dict, sens: dict | None, out_dir: Path) -> str:
    m = s.get("metrics", {})
    keys = [k for k in ("quantized_layers", "fallback_layers", "calibration_samples", "search_samples",
                        "search_cosine", "search_cosine_bound", "search_cosine_worst_feed", "search_cosine_all_quantized",
                        "search_cosine_fp16", "search_metric", "search_score_worst_feed", "search_score_all_quantized",
                        "search_score_fp16") if k in m]
    if not keys and not (out_dir / "sensitivity.png").is_file():
        return ""
    head = "Quantization" if "quantized_layers" in m else "fp16 accuracy search (nodes kept in fp32)"
    out = f"<h2>{head}</h2>" + table(["metric", "value"], [[esc(k), num("summary", f"metrics.{k}", m[k])] for k in keys],
                                          numeric=[1])
    if sens and sens.get("segments"):
        out += table(["segment", "method", "precision", "layers quantized", "kept in higher precision"],
                     [[esc(g.get("segment")), esc(_method_text(g)), esc(g.get("precision")),
                       str(len(g.get("quantized") or [])), esc(", ".join(g.get("fallback") or []) or "none")]
                      for g in sens["segments"]])
    held = _held_back(sens)
    if held:
        out += held
    if (out_dir / "sensitivity.png").is_file():
        out += img(out_dir / "sensitivity.png", "sensitivity per layer (its own output error with only it quantized)")
    return out


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
    return share, [{"node": r["node"], "flops_share": r["flops"] / total, "local_error": r.get("local_error")}
                   for r in kept]


def _held_back(sens: dict | None) -> str:
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
            + table(["layer", "share of the FLOPs", "its own output error, quantized alone"],
                    [[esc(r["node"]), f"{r['flops_share']:.1%}",
                      "n/m" if r["local_error"] is None else f"{r['local_error']:.3g}"] for r in kept], numeric=[1, 2]))


def _method_text(segment: dict) -> str:
    """"entropy", or "entropy; percentile range for 3 layers, minmax for 1" when the budget search switched some."""
    counts = collections.Counter((segment.get("range_choice") or {}).values())
    more = ", ".join(f"{m} for {n} layer{'s' if n > 1 else ''}" for m, n in sorted(counts.items()))
    return f"{segment.get('method')}" + (f"; range from {more}" if more else "")


def _traffic(s: dict, out_dir: Path) -> str:
    t = s.get("traffic")
    if not isinstance(t, dict):
        return ""
    rows = []
    for k, prof in enumerate(t.get("profiles") or []):
        shapes = "<br>".join(f"{esc(n)}: {esc(r['min'])} … opt {esc(r['opt'])} … {esc(r['max'])}" for n, r in prof.items())
        served = t["per_profile"][k]
        rows.append([f"profile {k}", shapes, num("summary", f"traffic.per_profile[{k}]", served, f"{served:,}"),
                     f"{100 * served / t['requests']:.2f} %" if t.get("requests") else ""])
    out = sum(o.get("count", 0) for o in t.get("outliers") or [])
    rows.append(["outliers", "<br>".join(esc(", ".join(f"{k}={v}" for k, v in o.items())) for o in t["outliers"][:8]),
                 f"{out:,}", f"{100 * out / t['requests']:.2f} %" if t.get("requests") else ""])
    cov = num("summary", "metrics.traffic_coverage", t["coverage"], f"{100 * t['coverage']:.3f} %")
    head = (f"<h2>Traffic</h2><p>{t['requests']:,} requests, {cov} covered by "
            f"{len(t.get('profiles') or [])} profile(s); {esc(t.get('k_reason', ''))}; cost: {esc(t.get('cost', ''))}</p>")
    return (head + table(["", "min … opt … max", "requests", "share"], rows, numeric=[2, 3])
            + (img(out_dir / "traffic.png", "the traffic's requests with the profiles' boxes (x: opt)")
               if (out_dir / "traffic.png").is_file() else ""))


def _precision_profile(s: dict, out_dir: Path) -> str:
    share = s.get("metrics", {}).get("flops_share")
    if not isinstance(share, dict) or not share:
        return ""
    bar = "".join(f'<span class="bar" title="{esc(p)}" style="width:{max(0.0, float(v)) * 600:.0f}px;'
                  f'background:{PRECISION_COLOR.get(p, "#757575")}"></span>' for p, v in share.items()
                  if isinstance(v, (int, float)) and v > 0)
    rows = [[f'<span class="bar" style="width:12px;background:{PRECISION_COLOR.get(p, "#757575")}"></span> {esc(p)}',
             num("summary", f"metrics.flops_share.{p}", v, f"{100 * v:.2f} %")] for p, v in share.items()
            if isinstance(v, (int, float))]
    return ("<h2>Precision profile</h2><p>share of the network's estimated FLOPs computed at each precision</p>"
            f"<p>{bar}</p>" + table(["precision", "share of FLOPs"], rows, numeric=[1])
            + (img(out_dir / "precision_profile.png", "FLOPs per layer and precision, estimated on the TensorRT network")
               if (out_dir / "precision_profile.png").is_file() else ""))


def _benchmark(s: dict, b: dict | None, out_dir: Path) -> str:
    if b is None:
        reason = s.get("stages", {}).get("benchmark", {}).get("reason")
        return "<h2>Benchmark</h2><p>not measured" + (f": {esc(reason)}" if reason else "") + "</p>"
    cols = ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "first_run_ms", "throughput_per_s", "spread_pct", "runs")
    rows = []
    for key in ("native", "engine"):
        r = b.get(key)
        if isinstance(r, dict) and "p50_ms" in r:
            rows.append([esc(r.get("runtime", key))] + [num("benchmark", f"{key}.{c}", r[c]) if c in r else "" for c in cols])
    out = "<h2>Benchmark</h2>"
    host = b.get("host") or {}
    if host:
        out += f"<p class='muted'>host: {esc(host.get('cpu'))}, {esc(host.get('cores'))} cores; shape " \
               f"{esc((b.get('native') or {}).get('shape', ''))}</p>"
    if rows:
        out += table(["runtime"] + [c.replace("_ms", " (ms)").replace("_per_s", " (/s)").replace("_pct", " (%)") for c in cols],
                     rows, numeric=range(1, len(cols) + 1))
    eng = b.get("engine") or {}
    if eng.get("status") == "skipped":
        out += f"<p><b>engine latency not measured</b>: {esc(eng.get('reason'))}. The row above is ONNX Runtime on " \
               "this host's CPU, not the engine.</p>"
    for k, v in b.items():
        if k.startswith("quantized_vs") and isinstance(v, str):
            out += f"<p>{esc(v)}</p>"
    if (out_dir / "latency.png").is_file():
        out += img(out_dir / "latency.png", "latency per run (histogram)")
    return out


def _engines(s: dict) -> str:
    engines = s.get("engines") or []
    if not engines:
        return "<h2>Engines</h2><p>none published</p>"
    rows = [[esc(e.get("file")), num("summary", f"engines[{i}].bytes", e["bytes"], f"{e['bytes']:,}"),
             f"{e['bytes'] / 1e6:.2f}", f"<code>{esc(e.get('sha256'))}</code>"] for i, e in enumerate(engines)]
    return "<h2>Engines</h2>" + table(["file", "bytes", "MB", "sha256"], rows, numeric=[1, 2])


def _more_figures(out_dir: Path) -> str:
    known = set(STAGE_FIGURES) | set(OWN_FIGURES)
    more = [p for p in sorted(out_dir.glob("*.png")) if p.name not in known]
    return "".join(["<h2>More figures</h2>"] + [img(p, p.stem.replace("_", " ")) for p in more]) if more else ""


def _metrics(s: dict) -> str:
    m = s.get("metrics", {})
    rows = [[esc(k), num("summary", f"metrics.{k}", v)] for k, v in m.items() if isinstance(v, (int, float))]
    rows += [[esc(f"{k}.{k2}"), num("summary", f"metrics.{k}.{k2}", v2)] for k, v in m.items() if isinstance(v, dict)
             for k2, v2 in v.items() if isinstance(v2, (int, float))]
    return "<details><summary>all metrics</summary>" + table(["metric", "value"], rows, numeric=[1]) + "</details>" if rows else ""


def _warnings(s: dict, docs: dict) -> str:
    found = warnings_in(s.get("stages", {}), "stages") + warnings_in({k: v for k, v in s.items() if k != "stages"})
    for name, doc in docs.items():
        if doc:
            found += [(f"{name}.json" + ("" if w == "-" else f" {w}"), t) for w, t in warnings_in(doc)]
    seen, rows = set(), []
    for where, text in found:
        if text not in seen:
            seen.add(text)
            rows.append([esc(where), f'<span class="warn">{esc(text)}</span>'])
    return "<h2>Warnings</h2>" + (table(["where", "warning"], rows) if rows else "<p>none</p>")


def _config(s: dict, out_dir: Path) -> str:
    out = "<h2>Versions and configuration</h2>"
    v = s.get("versions") or {}
    if v:
        out += table(["component", "version"], [[esc(k), esc(x)] for k, x in v.items()])
    cfg = out_dir / "config.yaml"
    if cfg.is_file():
        out += f"<details><summary>resolved config (config.yaml)</summary><pre>{esc(cfg.read_text())}</pre></details>"
    return out


# --- compare.html -------------------------------------------------------------------------------------------------

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
    plt = _pyplot()
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
    return _save(fig, path)


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
