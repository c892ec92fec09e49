"""fp16 of a model split into TensorRT segments and native parts, judged as a whole.

Each segment's fp16 search (tasks/fp16/search.py) judges that segment's own outputs, which do not show a discrete
decision the rest of the model takes from them: a predicted duration rounded to whole frames (a TTS model's audio then
has another length), an argmax that ends a decode. Here the converted segments are run together with the native
parts, composed as validate composes them, and judged on the model's outputs by the user's metric; where that misses
the target, whole segments are kept fp32: a small set of them that meets it, found by halving the segments (those whose
own outputs erred most first), each judgement one composed run per sample.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np


STAGE = "build"
WHOLE_JUDGEMENTS = 16  # composed judgements the halving spends at most: past them it keeps the segments it holds
# (one segment that flips the decision takes about 2 log2(segments): 16 for 182; where many add up to the flip, as in
# Kokoro-82M's text encoder, more segments stay fp32 than the fewest would need)
Feed = dict[str, np.ndarray]


def segments_kept_fp32(model_path: Path, plan: dict, plan_files: dict, graph_outputs: list[str], feeds: list[Feed],
                       converted: dict[int, Path], error: dict[int, float], judge, target: float) -> dict:
    """Which TensorRT segments of a hybrid ``plan`` to keep fp32 so that the model composed of the ``converted`` fp16
    graphs (the rest: the segments' fp32 graphs, ``plan_files``) meets ``target`` on ``feeds`` against the fp32
    model at ``model_path``, by ``judge`` (tasks.accuracy.metric.SearchJudge: cosine pooled less one standard error,
    another metric its worst feed; tasks.search.judging.Judged). ``error``: each segment's own error (1 - cosine of its
    outputs), the order the halving splits them in (``_fewest``). Returns {"kept": [segment indices], "bound_fp16": the figure of every
    segment as converted, "bound": the figure with those kept (None: not judged again), "met": whether it meets,
    "runs": composed runs of one sample, "candidates": the segments it chose among}."""
    from tasks.accuracy.nonfinite import on_finite_reference
    from tasks.onnxrt.emulate import precision_runner
    from tasks.onnxrt.ort import ort_runner
    from tasks.partition.segments import Composed
    from tasks.search.judging import Judged

    trt = [s["index"] for s in plan["segments"] if s["kind"] == "trt" and s["index"] in converted]
    runners: dict[tuple[int, bool], Callable] = {}

    def runner(seg: dict, kept: frozenset) -> Callable:
        i = seg["index"]
        fp32 = seg["kind"] != "trt" or i in kept or i not in converted
        if (i, fp32) not in runners:  # one session per segment and precision, shared by every judgement
            runners[i, fp32] = (ort_runner(plan_files[f"segment{i}"], stage=STAGE, arena=False) if fp32 else
                                precision_runner(converted[i], arena=False, stage=STAGE)[0])
        return runners[i, fp32]

    reference = ort_runner(model_path, stage=STAGE, arena=False)
    refs = [reference(f) for f in feeds]
    runs = 0

    def judged(kept: frozenset):
        nonlocal runs
        composed = Composed(plan["segments"], graph_outputs, lambda s: runner(s, kept))
        outs = []
        for f, r in zip(feeds, refs):
            outs.append(on_finite_reference(composed(f), r))
            runs += 1
        return Judged.of(outs, refs, feeds, judge)

    first = judged(frozenset())
    out = {"kept": [], "bound_fp16": first.bound, "bound": None, "met": first.bound >= target, "runs": runs,
           "candidates": len(trt)}
    if out["met"] or not trt:
        return out
    order = sorted(trt, key=lambda i: -error.get(i, 0.0))
    figures: dict[frozenset, object] = {frozenset(): first}

    def meets(kept) -> bool:
        kept = frozenset(kept)
        if kept not in figures:
            figures[kept] = judged(kept)
        return figures[kept].bound >= target

    if not meets(order):  # every segment fp32 misses too: nothing fp16 can be kept for (validate says why)
        return {**out, "bound": figures[frozenset(order)].bound, "runs": runs}
    budget = [WHOLE_JUDGEMENTS]

    def judged_within(kept) -> bool:  # past the budget every part is taken to miss: the halving keeps what it holds
        if frozenset(kept) not in figures:
            if budget[0] <= 0:
                return False
            budget[0] -= 1
        return meets(kept)

    kept = frozenset(_fewest(order, frozenset(), judged_within))
    final = figures[kept] if kept in figures else judged(kept)  # judged already: the halving returns a set it met
    if len(kept) == len(order):  # only every segment fp32 met it (or the halving found no smaller set within its
        # judgements): an fp32 model by another name; the segments stay as converted and validate says why
        return {**out, "bound": final.bound, "runs": runs, "judgements": len(figures), "all_needed": True}
    return {**out, "kept": [i for i in order if i in kept], "bound": final.bound, "met": final.bound >= target,
            "runs": runs, "judgements": len(figures)}


def _fewest(cands: list[int], fixed: frozenset, meets: Callable) -> frozenset:
    """A small part of ``cands`` that, kept fp32 with ``fixed``, still meets (``meets(fixed | cands)`` holds), by
    halving: a half that meets alone is searched further, else each half is searched with the other kept. One segment
    whose rounding flips the decision is found in about 2 log2(segments) judgements."""
    if len(cands) <= 1:
        return frozenset(cands)
    half = len(cands) // 2
    a, b = cands[:half], cands[half:]
    if meets(fixed | set(a)):
        return _fewest(a, fixed, meets)
    if meets(fixed | set(b)):
        return _fewest(b, fixed, meets)
    first = _fewest(a, fixed | set(b), meets)
    return first | _fewest(b, fixed | first, meets)


def fp16_or_fp32(segments: list[dict], convert: Callable[[dict], object], fp32: Callable[[dict], object]) -> dict:
    """The TensorRT segments of a split model at fp16 (``convert(segment)``: its conversion with the fp16 search), each
    one whose search cannot meet its target on the segment's own outputs short of keeping every node fp32 at fp32
    instead (``fp32(segment)``, with the search's words in details ``fp16_search_refused``): kept fp32 whole, the model
    then judged whole (``segments_kept_fp32``). {segment index: result}. Where that leaves no segment fp16 (an fp32
    engine by another name), the first search's refusal (AccuracyError) stands."""
    from tasks.common.errors import AccuracyError

    out, refused = {}, []
    for s in segments:
        try:
            out[s["index"]] = convert(s)
        except AccuracyError as e:
            refused.append(e)
            out[s["index"]] = fp32(s)
            out[s["index"]].details["fp16_search_refused"] = e.message
    if refused and len(refused) == len(segments):
        raise refused[0]
    return out
