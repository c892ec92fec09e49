"""`report.html` for one build, from its summary.json and the stage reports beside it. Pure: files in, HTML out
(the stages draw the plots it embeds).

Every number on the page is read from those files; a number that is absent there is absent on the page. Numbers are
tagged `data-key="<file>:<path>"` with their exact value in `data-value`, so a test can check the page against them.
"""
from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

from tasks.report.markup import PRECISION_COLOR, STATUS_COLOR, badge, esc, fmt, img, num, page, table
from tasks.report.sensitivity import held_back_table

from tasks.schema import STAGES
# pictures made by the stages: file name -> caption (others found beside summary.json are shown under "more figures")
STAGE_FIGURES = {"partition.png": "partition", "sensitivity.png": "sensitivity"}
OWN_FIGURES = ("accuracy.png", "latency.png", "precision_profile.png", "traffic.png")


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
    held = held_back_table(sens)
    if held:
        out += held
    if (out_dir / "sensitivity.png").is_file():
        out += img(out_dir / "sensitivity.png", "sensitivity per layer (its own output error with only it quantized)")
    return out


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
            f"<p>{bar}</p>" + table(["precision", "share of FLOPs"], rows, numeric=[1]) + _boundaries(s)
            + (img(out_dir / "precision_profile.png", "FLOPs per layer and precision, estimated on the TensorRT network")
               if (out_dir / "precision_profile.png").is_file() else ""))


def _boundaries(s: dict) -> str:
    """The precision boundaries (reformats) beside the FLOPs shares: what was measured and on what."""
    m = s.get("metrics", {})
    if "reformat_layers" not in m:
        return ""
    size = m.get("reformat_bytes")
    mib = (" carrying " + num("summary", "metrics.reformat_bytes", size, f"{size / 2**20:.2f} MiB") + " at the opt shape"
           if isinstance(size, (int, float)) else "")
    return (f"<p>precision boundaries (each a reformat on the GPU): "
            f"{num('summary', 'metrics.reformat_layers', m['reformat_layers'], str(m['reformat_layers']))}{mib}; "
            f"{esc(str(m.get('reformat_source', '')))}</p>")


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
