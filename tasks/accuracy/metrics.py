"""How outputs are compared: the one definition of cosine similarity and of the error statistics that validate gates
on and calibrate's accuracy search scores with.

Names say what they measure:

* ``cosine`` of one output on one feed: flattened float64 cosine similarity (two all-zero outputs are equal, 1.0;
  one all-zero or a non-finite output, 0.0).
* pooled over a set of feeds (``summarize``): per output, the cosine of all its values on every feed together
  (``cosine``: what ``cosine_min`` gates on), the worst single feed's cosine (``cosine_worst_feed``), the largest
  absolute error (``max_abs``) and the mean absolute error over every value of every feed (``mean_abs``).
* non-finite values (NaN, +inf, -inf) at the same place with the same class in both reference and candidate are left
  out and the finite rest compared (``finite_part``; a GNN writes NaN where its mask is false, by design); how many
  were left out is recorded (``nonfinite_both``, with ``elements``). A non-finite value in only one of them is a
  mismatch (``nonfinite_mismatch``): cosine 0 for that output. Finite outputs take the same path as ever.
* a set's headline numbers (``headline``): ``cosine_min`` = the lowest pooled cosine of any output,
  ``cosine_worst_feed`` = the lowest single-feed cosine of any output, ``max_abs_err``, ``mean_abs_err`` (the largest
  per-output pooled mean).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np


def finite_part(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(a, b, left out, mismatched) of two flattened float64 arrays of one shape: the positions where both are NaN, both
    +inf or both -inf are left out (equal non-finite values: nothing to compare there); ``mismatched`` counts the
    positions non-finite in only one of them, or of another class (these stay in: the comparison fails). All finite:
    a and b as given, 0, 0 (the figures of finite outputs do not move)."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if fa.all() and fb.all():
        return a, b, 0, 0
    same = (~fa & ~fb) & ((np.isnan(a) & np.isnan(b)) | (a == b))  # NaN vs NaN, +inf vs +inf, -inf vs -inf
    keep = ~same
    mismatched = int(((~fa | ~fb) & keep).sum())
    return a[keep], b[keep], int(same.sum()), mismatched


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Flattened float64 cosine similarity of the finite part (``finite_part``); both all-zero: 1.0; one all-zero or
    non-finite where the other is not: 0.0."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        return 0.0
    a, b, _, mismatched = finite_part(a, b)
    if mismatched:
        return 0.0
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0 or not (np.isfinite(na) and np.isfinite(nb)):
        return 0.0
    return float(a @ b / (na * nb))


def compare(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per output of one feed: cosine, max/mean absolute error, the reference's max |x| (of its finite values), and the
    sums that ``summarize`` pools over a set (``_dot``, ``_na2``, ``_nb2``, ``_abs_sum``, ``_n``). Non-finite values
    (``finite_part``): ``nonfinite_both`` (left out, with ``elements``) and ``nonfinite_mismatch``, when any."""
    out = {}
    for name, ref in reference.items():
        got = candidate[name]
        a = np.asarray(ref, dtype=np.float64).ravel()
        b = np.asarray(got, dtype=np.float64).ravel()
        if a.shape != b.shape:
            out[name] = {"cosine": 0.0, "max_abs": float("inf"), "mean_abs": float("inf"),
                         "ref_max_abs": float(np.abs(a).max(initial=0)),
                         "error": f"shape {list(np.shape(got))} != reference {list(np.shape(ref))}"}
            continue
        elements = int(a.size)
        a, b, both, mismatched = finite_part(a, b)
        if mismatched:  # as a non-finite candidate always was: cosine 0, errors inf, pooled as all-zero
            a = np.where(np.isfinite(a), a, 0.0)
        ref_max = float(np.abs(a).max(initial=0))
        finite = not mismatched and bool(np.isfinite(b).all())
        diff = np.abs(a - b)
        out[name] = {"cosine": cosine(a, b) if finite else 0.0,
                     "max_abs": float(diff.max(initial=0)) if finite else float("inf"),
                     "mean_abs": float(diff.mean()) if finite and diff.size else (0.0 if finite else float("inf")),
                     "ref_max_abs": ref_max,
                     "_dot": float(a @ b) if finite else 0.0, "_na2": float(a @ a), "_nb2": float(b @ b) if finite else 0.0,
                     "_abs_sum": float(diff.sum()) if finite else float("inf"), "_n": int(diff.size)}
        if both or mismatched:
            out[name].update(nonfinite_both=both, nonfinite_mismatch=mismatched, elements=elements)
    return out


def summarize(per_feed: Iterable[dict[str, dict]]) -> dict[str, dict]:
    """Per output over a set of feeds (``compare`` results): the pooled cosine of all its values together, the worst
    single feed's cosine, the largest absolute error, the mean absolute error over all values, the reference's max |x|.
    The per-feed dicts lose their pooling sums (``_…``)."""
    stats: dict[str, dict] = {}
    sums: dict[str, list[float]] = {}
    for res in per_feed:
        for name, m in res.items():
            w = stats.setdefault(name, {"cosine": 1.0, "cosine_worst_feed": 1.0, "max_abs": 0.0, "mean_abs": 0.0,
                                        "ref_max_abs": 0.0})
            w["cosine_worst_feed"] = min(w["cosine_worst_feed"], m["cosine"])
            w["max_abs"] = max(w["max_abs"], m["max_abs"])
            w["ref_max_abs"] = max(w["ref_max_abs"], m["ref_max_abs"])
            w["_elements"] = w.get("_elements", 0) + m.get("elements", m.get("_n", 0))
            acc = sums.setdefault(name, [0.0, 0.0, 0.0, 0.0, 0.0])
            for i, k in enumerate(("_dot", "_na2", "_nb2", "_abs_sum", "_n")):
                acc[i] += m.pop(k, 0.0)
            if "error" in m:
                w["error"] = m["error"]
            if "elements" in m or "nonfinite_both" in w:  # non-finite values seen: counted over the set
                for k in ("nonfinite_both", "nonfinite_mismatch"):
                    w[k] = w.get(k, 0) + m.get(k, 0)
    for name, (dot, na2, nb2, abs_sum, n) in sums.items():
        w = stats[name]
        elements = w.pop("_elements", 0)
        if "nonfinite_both" in w:
            w["elements"] = elements
        if "error" in w:
            w["cosine"], w["mean_abs"] = 0.0, float("inf")
            continue
        w["mean_abs"] = abs_sum / n if n else 0.0
        if na2 == 0 and nb2 == 0:
            w["cosine"] = 1.0
        else:
            w["cosine"] = float(dot / np.sqrt(na2 * nb2)) if na2 > 0 and nb2 > 0 else 0.0
    return stats


def headline(stats: dict[str, dict]) -> dict[str, float]:
    """A set's headline numbers from ``summarize``: cosine_min, cosine_worst_feed, max_abs_err, mean_abs_err."""
    return {"cosine_min": min(m["cosine"] for m in stats.values()),
            "cosine_worst_feed": min(m["cosine_worst_feed"] for m in stats.values()),
            "max_abs_err": max(m["max_abs"] for m in stats.values()),
            "mean_abs_err": max(m["mean_abs"] for m in stats.values())}


def outputs_as_dict(names: list[str], values: list[np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip(names, values))


def pooled_cosine(outputs: list[dict[str, np.ndarray]], references: list[dict[str, np.ndarray]]) -> float:
    """cosine_min of a candidate's outputs against the references, feed by feed (the gate's statistic)."""
    return headline(summarize(compare(r, o) for o, r in zip(outputs, references)))["cosine_min"]


def pooled_sums(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, tuple[float, float, float]]:
    """Per output of one feed: (a.b, a.a, b.b) in float64, a the reference, on the finite part (``finite_part``): what a
    pooled cosine adds up (a misshapen candidate, or one non-finite where the reference is not, counts as all-zero:
    cosine 0)."""
    out = {}
    for name, ref in reference.items():
        a = np.asarray(ref, dtype=np.float64).ravel()
        b = np.asarray(candidate[name], dtype=np.float64).ravel()
        mismatched = 0
        if a.shape == b.shape:
            a, b, _, mismatched = finite_part(a, b)
            if mismatched:
                a = np.where(np.isfinite(a), a, 0.0)
        if a.shape != b.shape or mismatched or not np.isfinite(b).all():
            out[name] = (0.0, float(a @ a), 0.0)
        else:
            out[name] = (float(a @ b), float(a @ a), float(b @ b))
    return out


def pooled_cosine_of(dot: float, na2: float, nb2: float) -> float:
    """The cosine of ``pooled_sums``' (a.b, a.a, b.b): of one output of one feed, or summed over feeds (pooled)."""
    if na2 == 0 and nb2 == 0:
        return 1.0
    return float(dot / np.sqrt(na2 * nb2)) if na2 > 0 and nb2 > 0 else 0.0


def pooled_estimate(per_feed: list[dict[str, tuple[float, float, float]]], z: float = 1.0) -> tuple[float, float, float]:
    """(cosine, standard error, lower bound) of a set of feeds' ``pooled_sums``: the cosine is validate's statistic
    (per output, all feeds' values together; the lowest output); its standard error is the jackknife's over the feeds
    (leave each feed out in turn: how much the figure depends on which samples happened to be drawn, the spread a
    validation on other samples of the same kind will show), but never below (1 - cosine) / sqrt(feeds): the errors
    of a quantized network spread over samples about as much as their mean, and a few samples rarely show the
    tail (PP-OCRv4 det int8 pages: 0.004 to 0.04 around 0.01; the jackknife of 24 pages without a bad one said 0.0005
    where pooled cosines of sets of 8 pages spread by 0.0028). The bound is the cosine minus ``z`` standard errors."""
    names = list(per_feed[0]) if per_feed else []
    total = {k: np.sum([f[k] for f in per_feed], axis=0) for k in names}
    value = min((pooled_cosine_of(*total[k]) for k in names), default=1.0)
    n = len(per_feed)
    if not n:
        return value, 0.0, value
    se = (1.0 - value) / np.sqrt(n)  # the floor: see below
    if n > 1:
        loo = np.array([min(pooled_cosine_of(*(total[k] - np.asarray(f[k]))) for k in names) for f in per_feed])
        se = max(se, float(np.sqrt((n - 1) / n * np.sum((loo - loo.mean()) ** 2))))
    return value, float(se), value - z * float(se)


def worst_feed_cosine(outputs: list[dict[str, np.ndarray]], references: list[dict[str, np.ndarray]]) -> float:
    """The lowest single-feed cosine of any output (stricter than pooled_cosine)."""
    return min((cosine(o[n], r[n]) for o, r in zip(outputs, references) for n in r), default=1.0)
