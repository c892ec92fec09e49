"""The HTML pieces every page is made of: escaping, how a number is shown (tagged with its source file and path),
status badges, tables, embedded PNG figures, the page with its style sheet."""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any, Iterable

STATUS_COLOR = {"ok": "#2e7d32", "cached": "#0277bd", "skipped": "#9e9e9e", "failed": "#c62828"}
PRECISION_COLOR = {"fp32": "#5c6bc0", "fp16": "#26a69a", "int8": "#ffa726", "fp8": "#ef5350"}

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
