"""Non-finite values (NaN, +inf, -inf) in the fp32 reference, found before anything is judged against it: which output,
how many elements, on which feed, and, when the inputs were generated at random, that they caused it. A reference that
is not finite is no target: a GNN writes NaN where its mask is false (by design), a Log of a random value <= 0 is NaN,
an attention mask that came out all False gives NaN rows. Where the candidate is non-finite at the same places, the
comparison is on the finite part (tasks/accuracy/metrics.py ``finite_part``) and says so (``finite_part_notes``)."""
from __future__ import annotations

import numpy as np

DATA_HOW = ("give validation.data=PATH (a .npz/.npy file or a folder of them, one array per model input name) with "
            "inputs the model is meant to see")
CALIBRATION_DATA_HOW = ("give calibration.data=PATH (a .npz/.npy file or a folder of them, one array per model input "
                        "name) and validation.data alike, with inputs the model is meant to see")


def nonfinite_reference(refs: list[dict[str, np.ndarray]]) -> dict[str, dict]:
    """Per output of the references (one dict per feed) that holds non-finite values: ``{"count", "elements", "nan",
    "posinf", "neginf", "feeds": [feed indices]}``; empty when every value is finite."""
    found: dict[str, dict] = {}
    for i, ref in enumerate(refs):
        for name, value in ref.items():
            a = np.asarray(value)
            if a.dtype.kind not in "fc" or np.isfinite(a).all():
                continue
            w = found.setdefault(name, {"count": 0, "elements": 0, "nan": 0, "posinf": 0, "neginf": 0, "feeds": []})
            w["nan"] += int(np.isnan(a).sum())
            w["posinf"] += int(np.isposinf(a).sum())
            w["neginf"] += int(np.isneginf(a).sum())
            w["count"] = w["nan"] + w["posinf"] + w["neginf"]
            w["feeds"].append(i)
    for name, w in found.items():  # elements over every feed, for "N of M"
        w["elements"] = sum(int(np.size(r[name])) for r in refs if name in r)
    return found


def _classes(w: dict) -> str:
    return ", ".join(f"{label} {w[k]}" for k, label in (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf"))
                     if w[k])


def reference_warnings(found: dict[str, dict], feeds: list[dict[str, np.ndarray]], inputs_source: str,
                       random_inputs: bool, origins: dict[str, dict] | None = None, data_how: str = DATA_HOW,
                       judged: str | None = None) -> list[str]:
    """One warning per output of ``nonfinite_reference``: the output, the count, the feeds (the first one's input
    shapes) and where they come from; ``random_inputs`` (no data given): the random inputs caused it, with the inputs
    named (``origins``, tasks.onnxrt.origins.nonfinite_origins of the first such feed: the node that made the first
    non-finite value and the inputs that reach it; else every model input) and how to give data (``data_how``).
    ``judged``: how the caller judges those places (default: validate's, the finite part where the build lines up)."""
    out = []
    for name, w in found.items():
        origin = (origins or {}).get(name)
        first = w["feeds"][0]
        shapes = ", ".join(f"{n}{list(np.shape(a))}" for n, a in feeds[first].items()) if first < len(feeds) else ""
        where = (f"on feed {first}" + (f" and {len(w['feeds']) - 1} more" if len(w["feeds"]) > 1 else "")
                 + f" of {len(feeds)} ({inputs_source}; feed {first}: {shapes})")
        text = (f"the fp32 reference output {name!r} is not finite: {w['count']} of {w['elements']} elements "
                f"({_classes(w)}) {where}")
        if origin and origin.get("node"):
            text += f"; the first non-finite value is made by node {origin['node']!r} ({origin['op']})"
        if random_inputs:
            if origin and origin.get("inputs"):
                names = ", ".join(origin["inputs"])
                which = f"the random values of input(s) {names} (those that reach it) caused it"
            else:
                which = "the generated random inputs caused it (model inputs: " + (
                    ", ".join(feeds[first]) if first < len(feeds) else "?") + ")"
            text += (f"; {which}: random values the model does not expect (a Log or Sqrt of values <= 0, an "
                     f"all-False mask) give NaN/inf in fp32 already, so no precision can match them: {data_how}")
        else:
            text += "; " + (judged or "where the build is non-finite at the same places it is compared on the finite "
                                      "part, elsewhere it fails") + (
                ": check these inputs (the model's own NaN/inf, or inputs outside its domain)")
        out.append(text)
    return out


def finite_part_notes(outputs: dict[str, dict]) -> list[str]:
    """From ``summarize``'s per-output statistics: a note per output compared on the finite part, and one per output
    non-finite at other places than the reference (``nonfinite_mismatch``)."""
    notes = []
    for name, m in outputs.items():
        both, bad, n = m.get("nonfinite_both", 0), m.get("nonfinite_mismatch", 0), m.get("elements", 0)
        if both:
            notes.append(f"output {name!r} compared on the finite part ({both} of {n} elements non-finite in both "
                         f"the reference and the build, at the same places)")
        if bad:
            notes.append(f"output {name!r} is non-finite at {bad} of {n} elements where the other of reference and "
                         f"build is not (or holds another of NaN, +inf, -inf)")
    return notes


def on_finite_reference(out: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``out`` with the reference's non-finite values copied in at their places, for a search that chooses a precision:
    where the fp32 reference is NaN/inf there is no value to approach (a quantized layer turns a NaN it reads into a
    finite code, so NaN that no precision keeps would otherwise count as its error), and the comparison
    (tasks/accuracy/metrics.py ``finite_part``) leaves those places out. Outputs whose reference is finite are ``out``'s
    own arrays."""
    fixed = dict(out)
    for name, r in ref.items():
        r = np.asarray(r)
        if name not in fixed or r.dtype.kind not in "fc" or np.isfinite(r).all():
            continue
        o = np.asarray(fixed[name])
        if o.shape == r.shape:
            fixed[name] = np.where(np.isfinite(r), o, r).astype(o.dtype, copy=False)
    return fixed


def search_note(found: dict[str, dict], judged: str) -> str:
    """What an accuracy search judged where its fp32 reference is not finite (``nonfinite_reference`` of its samples)."""
    outs = ", ".join(f"{n!r} ({w['count']} of {w['elements']} elements)" for n, w in found.items())
    return (f"the search judged the finite part of the fp32 reference: {outs} non-finite in the fp32 reference on "
            f"{judged} left out (no precision has a value to approach there), the rest compared")
