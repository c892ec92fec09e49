"""The accuracy-budget search: which layers to quantize so that the model stays within ``accuracy.min_cosine``.

A pure function of whole-model judgements (``meets(names)``: the model with exactly ``names`` quantized reaches the
target on the search's held-out samples) and of a per-layer ``harm`` measured by the caller (tasks/quantization/calibrate.py: the
layer's own output error with only it quantized, from fp32 activations: no whole-model run per layer).

It searches from every layer quantized towards fewer, restoring the most harmful layers per FLOP first, then screens
the large restored layers in the configuration found (each one's loss on top of it) and takes back what fits: the
screen, not the ranking, decides most of what ends up quantized. The ranking is local because whole-model runs cost
more and find no better boundary: on PP-OCRv4 det (18 + 6 pages), ranking by the gain of restoring each layer alone in
the all-int8 graph (one run per layer, 14 s) gives 12 of 72 layers before the screen and 29 after, carrying 79% of the
FLOPs, where the local ranking gives 15, then 22 carrying 87%; ranking by the loss of quantizing each layer alone in
the fp32 graph on every search sample costs ~180 s.
"""
from __future__ import annotations

from typing import Callable


REFINE = 24  # restored layers screened after the binary search (those with at least refine_share of the FLOPs, largest)
REFINE_JUDGEMENTS = 12  # whole judgements the screened refinement spends at most, most promising candidates first:
# PP-OCRv6 det (zoo: 16 + 8 samples, up to 4 pages of 960 px, 4.5 s a judgement) spent 14 on its 17 candidates: calibrate
# 136 s, 86.5% of the conv FLOPs int8; at most 12: 100 s, 81.7%; at most 8: 102 s, 76.3%. Trying only the 12 largest
# candidates instead cut minilm's int8 FLOPs from 63% to 56% and PP-OCRv6 rec's from 67% to 42% (their largest layers
# are their most sensitive)

def planned_judgements(layers: int) -> int:
    """The whole judgements one search may make on ``layers`` layers, counted as candidates its figure is chosen from
    (tasks/accuracy/budget.py): every layer quantized and the ranges raced against it (2), the binary search over the
    restored prefix (log2 of layers + 1), the refinement (REFINE_JUDGEMENTS) and the choice with fewer precision
    boundaries (1: tasks/quantization/layer_search.py ``fewer_boundaries``)."""
    import math

    return 3 + math.ceil(math.log2(max(layers, 1) + 1)) + REFINE_JUDGEMENTS


SKIP_LOSS = 2.0  # a refinement candidate is judged while its screened loss is at most this many times the margin left


def restore_search(layers: list[str], meets: Callable[[list[str]], bool], harm: dict[str, float],
                   flops: dict[str, float] | None = None, refine: int = REFINE,
                   refine_share: float = 0.005,
                   screen: Callable[[list[str], list[str]], dict[str, float]] | None = None,
                   slack: Callable[[], float | None] | None = None,
                   judgements: int = REFINE_JUDGEMENTS, why: dict[str, str] | None = None) -> tuple[list[str], int]:
    """The layers to quantize, searched from every layer quantized towards fewer: layers are restored to the high
    precision in order of ``harm`` (the accuracy a layer costs, measured or estimated) per FLOP kept out of the
    quantized type, most harmful first; the shortest restored prefix whose complement ``meets`` the budget is found by
    binary search (log2 of the layer count judged runs); then the restored layers that carry at least
    ``refine_share`` of the FLOPs (up to ``refine``), most FLOPs first, are tried back: what the ranking misjudged,
    where it matters for the share of FLOPs quantized. ``meets`` is judged on whole-model runs. Returns (chosen
    layers, runs of ``meets``).

    Without ``screen`` each of them is judged back one by one (one whole judgement each: PP-OCRv4 det, 24 pages,
    24 judgements of 14 pages, two thirds of the search's runs). With ``screen`` (quantized layers, candidates ->
    {candidate: the accuracy lost by quantizing it alone on top of them}, measured cheaply: one run of one sample
    each) the candidates are re-ranked by that loss per FLOP in the configuration the binary search found, and the
    greedy pass over that order judges runs of candidates together (``_take_back_screened``), spending at most
    ``judgements`` of them. Every layer taken back is confirmed by a whole judgement, so the budget holds as without
    the screen; fewer judgements decide. ``why``, if given, gets each layer left restored with the reason in words
    (the report's "why kept")."""
    flops = flops or {}
    why = why if why is not None else {}
    order = sorted(layers, key=lambda n: -harm.get(n, 0.0) / max(flops.get(n) or 1.0, 1.0))
    judge = _Judge(layers, meets)
    memo: dict[int, bool] = {}

    def prefix(k: int) -> bool:
        if k not in memo:
            memo[k] = judge.ok(set(order[:k]))
        return memo[k]

    if prefix(0):
        return list(layers), judge.runs
    # prefix(0) fails; prefix(len) = nothing quantized, taken to meet
    _, hi = _bisect(0, len(order), prefix)
    if hi == len(order) and not prefix(hi):  # not even the graph without any quantized layer meets: nothing to refine
        return [], judge.runs
    restored = set(order[:hi])  # everything, when no prefix met the target: the large layers are still tried below
    total = sum(flops.get(n) or 0.0 for n in layers) or 1.0
    # in graph order before the sort by FLOPs: layers of equal FLOPs keep one order in every process (a set of strings
    # is ordered by Python's per-process hash seed)
    big = [n for n in layers if n in restored and (flops.get(n) or 0.0) >= refine_share * total]
    big = sorted(big, key=lambda n: -(flops.get(n) or 0.0))[:refine]
    for n in [n for n in layers if n in restored and n not in big]:
        why[n] = (f"restored by the binary search over the layers ranked by error per FLOP; not tried back (below "
                  f"{refine_share:.1%} of the FLOPs, or not among the {refine} largest restored)")
    if screen is None or len(big) < 2:
        for n in big:
            if judge.ok(restored - {n}):
                restored.discard(n)
            else:
                why[n] = "tried back alone on top of the layers quantized: the target was missed"
        return [n for n in layers if n not in restored], judge.runs
    restored = _take_back_screened(layers, restored, big, judge, screen, flops, slack, judgements, why)
    return [n for n in layers if n not in restored], judge.runs


class _Judge:
    """``meets`` of the layers left quantized when ``restored`` are kept out, with the count of its runs."""

    def __init__(self, layers: list[str], meets: Callable[[list[str]], bool]):
        self.layers, self.meets, self.runs = layers, meets, 0

    def ok(self, restored: set[str]) -> bool:
        self.runs += 1
        return self.meets([n for n in self.layers if n not in restored])


def _take_back_screened(layers: list[str], restored: set[str], big: list[str], judge: _Judge,
                        screen: Callable[[list[str], list[str]], dict[str, float]], flops: dict[str, float],
                        slack: Callable[[], float | None] | None, judgements: int,
                        why: dict[str, str]) -> set[str]:
    """``restored`` less the candidates ``big`` taken back, re-ranked by their screened loss per FLOP on top of the
    layers quantized, judged in runs whose losses add up to ``slack()``, at most ``judgements`` judgements."""
    loss = screen([n for n in layers if n not in restored], big)
    cand = sorted(big, key=lambda n: max(loss.get(n, 0.0), 0.0) / max(flops.get(n) or 1.0, 1.0))
    # the one-by-one greedy pass over ``cand`` (each taken back when it meets on top of those taken before), judged in
    # runs of candidates: the run whose screened losses add up to the margin left (the last met judgement's, at least
    # one candidate) is judged at once; met, it is taken back and the next run guessed from the new margin; missed, the
    # longest part of it that meets is found by a binary search and the candidate after it (which failed on top of it)
    # is skipped. Where the screen is right this costs one judgement per run; where every candidate fails, one each,
    # as one by one. (Galloping from each met run, 1, 2, 4, ..., cost PP-OCRv6 det 21 judgements for 17 candidates.)
    i, start = 0, judge.runs
    while i < len(cand) and judge.runs - start < judgements:
        left = slack() if slack is not None else None
        if left is not None and left >= 0:  # a candidate whose screened loss is far beyond the margin left is not
            # judged (a narrowly failing judgement runs most feeds before it is refused: PP-OCRv4 det, 9 of them after
            # the margin fell to 2e-5, 18 s)
            for n in cand[i:]:
                if loss.get(n, 0.0) > SKIP_LOSS * left:
                    why[n] = (f"its loss quantized on top of the layers quantized ({loss[n]:.2g}, screened on one "
                              f"sample) is more than {SKIP_LOSS:g}x the margin left ({left:.2g}): not judged back")
            cand[i:] = [n for n in cand[i:] if loss.get(n, 0.0) <= SKIP_LOSS * left]
            if i >= len(cand):
                break
        rest = cand[i:]

        def back(k: int) -> bool:
            return judge.ok(restored - set(rest[:k]))

        k, spent = 0, 0.0
        while k < len(rest) and (k == 0 or (left is not None and spent + max(loss.get(rest[k], 0.0), 0.0) <= left)):
            spent += max(loss.get(rest[k], 0.0), 0.0)
            k += 1
        if back(k):
            restored -= set(rest[:k])
            i += k
            continue
        lo, _ = _bisect(0, k, lambda m: not back(m))  # back(0) meets (the last judgement), back(k) does not
        restored -= set(rest[:lo])
        why[rest[lo]] = "judged back on top of the layers quantized: the target was missed"
        i += lo + 1  # rest[lo] fails on top of rest[:lo]
    for n in cand[i:]:
        if n in restored:
            why.setdefault(n, f"not judged back: the refinement's {judgements} judgements were spent on candidates "
                              f"with less loss per FLOP")
    return restored


def _bisect(lo: int, hi: int, flips: Callable[[int], bool]) -> tuple[int, int]:
    """(lo, hi) with hi = lo + 1 where ``flips`` turns from False (at lo) to True (at hi), by halving [lo, hi]."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if flips(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


SUMMED = ("quantized_layers", "fallback_layers", "search_runs")  # counts over a model's segments
LARGEST = ("search_samples", "calibration_samples", "search_cosine_se")  # the same sets (or the widest error)
LOWEST = ("search_cosine", "search_cosine_bound", "search_cosine_worst_feed", "search_cosine_all_quantized",
          "search_cosine_fp16", "search_score_worst_feed", "search_score_all_quantized", "search_score_fp16")


def combined_search_metrics(per_segment: list[dict]) -> dict:
    """One figure per search metric over a model's TensorRT segments (int8's calibrate and fp16's build alike): layer
    and run counts summed, sample counts and the standard error the largest, every figure of accuracy the lowest
    segment's, ``search_metric`` as named; a metric no segment measured stays absent."""
    out: dict = {}
    for m in per_segment:
        for k, v in m.items():
            if k in SUMMED:
                out[k] = out.get(k, 0) + v
            elif k in LARGEST:
                out[k] = max(out.get(k, v), v)
            elif k in LOWEST:
                out[k] = min(out.get(k, v), v)
            elif k == "search_metric":
                out[k] = v
    return out
