"""Non-finite values (NaN, +inf, -inf) in the fp32 reference, found before anything is judged against it: which output,
how many elements, on which feed, and, when the inputs were generated at random, that they caused it. A reference that
is not finite is no target: a GNN writes NaN where its mask is false (by design), a Log of a random value <= 0 is NaN,
an attention mask that came out all False gives NaN rows. Where the candidate is non-finite at the same places, the
comparison is on the finite part (tasks/accuracy/metrics.py ``finite_part``) and says so (``finite_part_notes``)."""
from __future__ import annotations

import numpy as np

DATA_HOW = ("give validation.data=PATH (a .npz/.npy file or a folder of them, one array per model input name) with "
            "inputs the model is meant to see")


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
                       random_inputs: bool) -> list[str]:
    """One warning per output of ``nonfinite_reference``: the output, the count, the feeds (the first one's input
    shapes) and where they come from; ``random_inputs`` (no validation.data): the random inputs caused it, with the
    model's inputs named and how to give data."""
    out = []
    for name, w in found.items():
        first = w["feeds"][0]
        shapes = ", ".join(f"{n}{list(np.shape(a))}" for n, a in feeds[first].items()) if first < len(feeds) else ""
        where = (f"on feed {first}" + (f" and {len(w['feeds']) - 1} more" if len(w["feeds"]) > 1 else "")
                 + f" of {len(feeds)} ({inputs_source}; feed {first}: {shapes})")
        text = (f"the fp32 reference output {name!r} is not finite: {w['count']} of {w['elements']} elements "
                f"({_classes(w)}) {where}")
        if random_inputs:
            names = ", ".join(feeds[first]) if first < len(feeds) else "?"
            text += (f"; the generated random inputs caused it (model inputs: {names}): random values the model does "
                     f"not expect (a Log or Sqrt of values <= 0, an all-False mask) give NaN/inf in fp32 already, so no "
                     f"precision can match them: {DATA_HOW}")
        else:
            text += ("; where the build is non-finite at the same places it is compared on the finite part, elsewhere "
                     "it fails: check these inputs (the model's own NaN/inf, or inputs outside its domain)")
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
