"""What an fp16 build says, as data: the warnings about the nodes its conversion kept fp32 (the data's range, fp16's
underflow, cancellation, a search that did not run) and the note on what the fp16 accuracy search kept."""
from __future__ import annotations

from typing import Any


def fp16_build_warnings(conversions: list[dict], ranged: Any, data_max: float) -> list[str]:
    """The warnings of a build from its segments' conversion details (but cancellation's); ``ranged``: the data the
    range check ran on (``kind``, ``source``), or None."""
    out = []
    if ranged is not None and ranged.kind == "random":
        out.append("the fp16 range check (which nodes stay fp32) ran on random inputs inside the profiles: give "
                   "calibration.data or validation.data at the model's real input scale")
    kept = sum(len(c.get("data_range") or {}) for c in conversions)
    if kept:
        out.append(f"{kept} nodes kept in fp32: their values exceed fp16's safe range (|x| > "
                   f"build.fp16_data_max={data_max:g}) on {ranged.source}")
    flushed = sum(len(c.get("data_underflow") or {}) for c in conversions)
    if flushed:
        out.append(f"{flushed} nodes kept in fp32: their values lie below fp16's normal range (|x| < 6.1e-5, "
                   f"where fp16's subnormals would leave them over 1% off) on {ranged.source}")
    out += [f"the fp16 accuracy search did not run: {c['fp16_search_skipped']}"
            for c in conversions if c.get("fp16_search_skipped")]
    return out


def fp16_cancellation_warning(conversions: list[dict], ranged: Any) -> str | None:
    """The nodes kept fp32 for cancellation, and how far off fp16 operands would leave them; None when none."""
    cancelled = [c.get("cancellation") or {} for c in conversions]
    if not any(cancelled):
        return None
    worst = max(v for c in cancelled for v in c.values())
    return (f"{sum(map(len, cancelled))} nodes kept in fp32: they compute subtractions of nearly equal "
            f"values (x - mean far from zero, a variance as E[x^2] - E[x]^2) that fp16 operands would "
            f"leave up to {worst:.0%} off (estimated on {ranged.source})")


def fp16_search_note(conversions: list[dict], metrics: dict, target: float, metric_name: str, held_source: str) -> str | None:
    """The build's note on the nodes the fp16 accuracy search kept fp32 (None when it kept none): how many, the worst
    five, its statistic before and after against the target, on which held-out samples."""
    found = [c["fp16_search"] for c in conversions if c.get("fp16_search")]
    kept_by_search = {n: v for f in found for n, v in f["kept"].items()}
    if not kept_by_search:
        return None
    worst = sorted(kept_by_search, key=lambda n: -kept_by_search[n])[:5]
    pooled = "search_cosine_bound" in metrics
    after = metrics["search_cosine_bound" if pooled else "search_score_worst_feed"]
    return (f"fp16 accuracy search: {len(kept_by_search)} node{'s' if len(kept_by_search) > 1 else ''} kept in fp32 "
            f"({', '.join(worst)}{' …' if len(kept_by_search) > 5 else ''}): {found[0]['search_statistic']} "
            f"{min(f['bound_fp16'] for f in found):.6f} -> {after:.6f} (target {target:.6g}"
            f"{'' if pooled else f', accuracy.metric={metric_name}'}, {metrics['search_samples']} held-out samples of "
            f"{held_source}, disjoint from validation's; onnxruntime emulation of fp16)")


def fp16_whole_model_note(whole: dict | None) -> str | None:
    """What judging a split model's converted segments together found (tasks/fp16/composed.py), where it kept a
    segment fp32 or missed; None when the segments as converted met the target together."""
    own = whole.get("fp32_by_own_search") or [] if whole else []
    if not whole or (whole["met"] and not whole["kept"] and not own):
        return None
    ahead = (f"{len(own)} TensorRT segment{'s' if len(own) > 1 else ''} kept fp32 whole, where its own fp16 search "
             f"missed the target short of every node fp32 (segment {', '.join(map(str, own[:8]))}"
             f"{' …' if len(own) > 8 else ''}); " if own else "")
    if whole["met"] and not whole["kept"]:
        return (f"fp16 of a split model: {ahead}the segments judged together on the model's outputs then gave "
                f"{whole['bound_fp16']:.6f} against the target {whole['target']:.6g}")
    where = (f"judged together with the native parts on the model's outputs ({whole['metric']}, "
             f"{whole['samples']} held-out samples, onnxruntime emulation of fp16)")
    if whole.get("all_needed"):
        return (f"fp16 of a split model: {ahead}the converted segments, {where}, give {whole['bound_fp16']:.6f} against the "
                f"target {whole['target']:.6g}; every TensorRT segment fp32 meets it ({whole['bound']:.6f}), and no "
                f"smaller set of whole segments kept fp32 did in {whole.get('judgements')} judgements: an fp32 model by "
                f"another name, so the segments stay as converted and validate judges them")
    if not whole["met"]:
        return (f"fp16 of a split model: {ahead}the converted segments, {where}, give {whole['bound_fp16']:.6f} against the "
                f"target {whole['target']:.6g}, and every TensorRT segment fp32 still {whole['bound']:.6f}: the parts "
                f"in ONNX Runtime or the data decide, not fp16; the segments stay as converted")
    kept = whole["kept"]
    return (f"fp16 of a split model: {ahead}the converted segments, {where}, gave {whole['bound_fp16']:.6f} against the target "
            f"{whole['target']:.6g}: {len(kept)} of {whole['candidates']} "
            f"TensorRT segments kept fp32 whole (segment {', '.join(map(str, kept[:8]))}{' …' if len(kept) > 8 else ''}), "
            f"giving {whole['bound']:.6f}")
