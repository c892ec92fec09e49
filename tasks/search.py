"""The accuracy-budget search: which layers to quantize so that the model stays within ``accuracy.min_cosine``.

A pure function of per-layer scores: ``score(names)`` is the cosine of the model with exactly ``names`` quantized
(measured by the caller on the search's held-out samples), ``alone[n]`` the score of layer ``n`` quantized alone,
``cos_none`` the score with no layer quantized (it meets the budget, else there is nothing to search).

Layers are ranked by accuracy lost alone per FLOP moved to the quantized type (least first: the greedy answer to
"most FLOPs quantized within the budget" when losses roughly add up). Leave-one-out ranking is deliberately not used
(effects are not additive: measured on PP-OCRv4 det, it kept 1 of 62 convs). A layer that alone already breaks the
budget cannot be part of any choice that meets it (quantizing more layers only adds error) and is left out; the
longest prefix of the remaining ranking within the budget is found by binary search, then a short greedy pass tries
the next layers one by one. Whenever any single layer meets the budget, the choice is not empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

GREEDY_TRIES = 6  # layers tried one by one after the binary-searched prefix


@dataclass
class SearchResult:
    chosen: list[str]  # the layers to quantize, in ranking order
    score: float  # score(chosen); cos_none when nothing is chosen
    ranking: list[dict] = field(default_factory=list)  # per layer, ranked: node, op, cosine_alone, flops, eligible
    tried: int = 0  # how many combinations were scored (besides the layers alone)


def budget_search(layers: list[str], score: Callable[[list[str]], float], budget: float, cos_none: float,
                  alone: dict[str, float], flops: dict[str, float] | None = None, ops: dict[str, str] | None = None,
                  greedy_tries: int = GREEDY_TRIES) -> SearchResult:
    flops = flops or {}
    ops = ops or {}

    def loss_per_flop(n: str) -> float:
        return max(cos_none - alone[n], 0.0) / max(flops.get(n) or 1.0, 1.0)

    ranked = sorted(layers, key=lambda n: (loss_per_flop(n), -alone[n]))
    ranking = [{"node": n, "op": ops.get(n), "cosine_alone": alone[n], "flops": flops.get(n),
                "eligible": alone[n] >= budget} for n in ranked]
    eligible = [n for n in ranked if alone[n] >= budget]
    memo: dict[int, float] = {0: cos_none}
    if eligible:
        memo[1] = alone[eligible[0]]
    tried = 0

    def prefix(k: int) -> float:
        nonlocal tried
        if k not in memo:
            memo[k] = score(eligible[:k])
            tried += 1
        return memo[k]

    lo, hi = 0, len(eligible) + 1  # prefix(lo) meets the budget; prefix(hi) does not (hi past the end: unknown)
    if eligible and prefix(len(eligible)) >= budget:
        lo = len(eligible)
    else:
        hi = len(eligible)
        lo = 1 if eligible else 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if prefix(mid) >= budget:
                lo = mid
            else:
                hi = mid
    chosen, cos = list(eligible[:lo]), prefix(lo)
    for n in eligible[lo + 1:lo + 1 + greedy_tries]:  # eligible[lo] just failed as part of a prefix
        c = score(chosen + [n])
        tried += 1
        if c >= budget:
            chosen.append(n)
            cos = c
    return SearchResult(chosen, cos if chosen else cos_none, ranking, tried)


def search_target(budget: float, margin: float) -> float:
    """The cosine the search aims at: `margin` of the allowed error (1 - budget) above the budget, so the budget still
    holds when validate checks other samples and shapes (0.25 with budget 0.99 -> 0.9925)."""
    return min(1.0, budget + (1.0 - budget) * margin)
