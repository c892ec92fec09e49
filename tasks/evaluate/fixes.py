"""The fix validate names when a build misses the accuracy budget: a pre-quantized model's (or an unsearched build's)
from what it arrived with, an int8/fp8 build's from its accuracy search; none for a metric other than cosine (those
fixes speak of cosine)."""
from __future__ import annotations

import numpy as np

from tasks.prequant.fixes import accuracy_fix
from tasks.quantization.calibrate import search_fix


def validation_fix(prequantized: dict | None, search_metrics: dict | None, samples: int, budget_margin: float | None,
                   searched: bool, metric_name: str) -> str | None:
    """``prequantized``: the quantization a model arrived with and kept; ``search_metrics``: calibrate's metrics (None
    when it did not run); ``samples``: validation's."""
    if metric_name != "cosine":
        return None
    if prequantized or search_metrics is None:
        return accuracy_fix(prequantized or {})
    return search_fix(search_metrics, samples, budget_margin, searched)


FAILING_NAMED = 5  # validation feeds a failed verdict names, lowest cosine first


def input_ranges(feeds) -> dict[str, list[float]]:
    """{input name: [min, max]} of the finite values of the float inputs over ``feeds`` (what calibration saw, or one
    validation feed's)."""
    out: dict[str, list[float]] = {}
    for f in feeds:
        for name, a in f.items():
            a = np.asarray(a)
            if a.dtype.kind != "f" or not a.size:
                continue
            finite = a[np.isfinite(a)]
            if not finite.size:
                continue
            lo, hi = float(finite.min()), float(finite.max())
            old = out.get(name)
            out[name] = [min(lo, old[0]), max(hi, old[1])] if old else [lo, hi]
    return out


def failing_feeds_text(report: dict, calibration_ranges: dict | None) -> str | None:
    """The validation feeds that fail a cosine verdict (each one's lowest output cosine below ``min_cosine``; when no
    single feed is, the lowest ones), named with their cosine and whether their inputs reach outside the range the
    calibration samples spanned (``calibration_ranges``, ``input_ranges`` of them; None: not compared). None when the
    report has no per-feed figures."""
    per_feed = (report.get("emulation") or {}).get("per_feed")
    inputs = report.get("feed_inputs")
    if not per_feed or not inputs or len(inputs) != len(per_feed):
        return None
    budget = report["min_cosine"]
    cos = [min((o["cosine"] for o in f.values()), default=1.0) for f in per_feed]
    order = sorted(range(len(cos)), key=cos.__getitem__)
    below = [k for k in order if cos[k] < budget]
    named = (below or order)[:FAILING_NAMED]
    outside = []

    def where(k: int) -> str:
        if not calibration_ranges:
            return ""
        parts = []
        for name, (lo, hi) in inputs[k].items():
            c = calibration_ranges.get(name)
            if c is None:
                continue
            slack = 1e-6 * max(abs(c[0]), abs(c[1]), 1e-12)
            if lo < c[0] - slack or hi > c[1] + slack:
                outside.append(k)
                parts.append(f"{name} in [{lo:.4g}, {hi:.4g}], outside calibration's [{c[0]:.4g}, {c[1]:.4g}]")
        return "; " + ", ".join(parts) if parts else "; inputs within calibration's range"

    rows = ", ".join(f"#{k} (cosine {cos[k]:.6f}{where(k)})" for k in named)
    head = (f"validation feeds below accuracy.min_cosine={budget} on their own: {len(below)} of {len(cos)}"
            if below else f"no validation feed is below accuracy.min_cosine={budget} on its own; the lowest of "
                          f"{len(cos)}")
    text = f"{head}: {rows}"
    if calibration_ranges:
        n = len(set(outside))
        text += (f"; {n} of the {len(named)} named {'reaches' if n == 1 else 'reach'} outside the input range of the "
                 f"calibration samples: give calibration.data samples that cover it" if outside else
                 "; their inputs lie within the calibration samples' range: they differ from them in content, not in "
                 "range")
    return text
