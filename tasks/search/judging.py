"""How a candidate graph is judged against the accuracy target: its pooled figure less ``JUDGE_Z`` standard errors
over the judged samples (``Judged``), run feed by feed and refused as soon as the target is out of reach
(``meets_target``). Shared by the int8 search (tasks/quantization) and the fp16 search (tasks/fp16)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tasks.accuracy.metrics import pooled_estimate, pooled_sums, worst_feed_cosine
from tasks.onnxrt.ort import ordered_runs

Feed = dict[str, np.ndarray]


def meets_target(run: Callable[[dict], dict], feeds: list[dict], refs: list[dict], target: float, miss: dict[int, float],
                 norms: dict[str, float], z: float = 1.0, judge=None,
                 sums_of: dict[int, dict] | None = None, workers: int = 1,
                 abandon: Callable[[int], None] | None = None) -> tuple[bool, tuple[float, float, float] | None]:
    """Whether a candidate (``run``: feed -> outputs) meets ``target`` on ``feeds``: the pooled cosine less ``z``
    standard errors (``tasks.accuracy.metrics.pooled_estimate``), or with ``judge`` (another metric's value per feed, higher is
    better) every feed's value. The feeds that erred most before (``miss``, per feed, updated) run first, and the
    candidate is refused as soon as the feeds run so far prove it cannot reach ``target`` even pooled alone (their
    error orthogonal to the reference already exceeds what the whole set allows, ``norms``: each output's squared norm
    over the whole set; another metric: the first feed below). Returns (meets, the pooled estimate when every feed
    ran, else None; ``sums_of``, if given, gets each feed's ``pooled_sums`` by its index, and the feeds it holds already
    are not run again but counted first). ``workers``: feeds run that many at a time (``run`` must be thread-safe;
    tasks.onnxrt.ort.ordered_runs), judged in the same order, with the same verdict and figure; ``abandon(i)`` (if
    given) stops the run of feed ``i`` started ahead of a refusal (``ordered_runs``). Shared by the int8
    search (``Switchable``) and fp16's (tasks/fp16/search.py)."""
    known = dict(sums_of) if sums_of else {}
    order = sorted(range(len(feeds)), key=lambda i: (i not in known, -miss.get(i, 0.0)))

    def kept(i: int, out: dict) -> None:  # run ahead of a refusal: counted when the same candidate is judged again
        if sums_of is not None and judge is None:
            sums_of[i] = pooled_sums(refs[i], out)

    with contextlib.closing(ordered_runs(lambda i: run(feeds[i]), [i for i in order if i not in known], workers,
                                         kept, abandon)) as outs:
        return _meets(outs, feeds, refs, target, miss, norms, z, judge, sums_of, known, order)


def _meets(outs, feeds, refs, target, miss, norms, z, judge, sums_of, known, order):
    """meets_target's judgement of the feeds in ``order``, the outputs of those not ``known`` from ``outs``."""
    if judge is not None:
        for i in order:
            v = judge(next(outs), refs[i], feeds[i])
            miss[i] = max(miss.get(i, 0.0), target - v)
            if v < target:
                return False, None
        return True, None
    sums: list[dict] = []
    part = {k: np.zeros(3) for k in norms}
    # of sin^2 of the pooled angle: the bound is the cosine less z standard errors, and the standard error is never
    # below (1 - cosine) / sqrt(feeds) (tasks.accuracy.metrics.pooled_estimate), so a pooled cosine below
    # (target + f) / (1 + f), f = z / sqrt(feeds), cannot meet the target: refused that much sooner
    f = z / np.sqrt(len(feeds)) if feeds else 0.0
    reach = (target + f) / (1.0 + f)
    allowed = 1.0 - reach * reach
    for i in order:
        s = known[i] if i in known else pooled_sums(refs[i], next(outs))
        sums.append(s)
        if sums_of is not None:
            sums_of[i] = s
        for k, v in s.items():
            part[k] += v
        worst = 0.0
        for k, (dot, na2, nb2) in part.items():
            # min over a scale c of |a - c b|^2 on the feeds so far: a lower bound of the whole set's
            err = na2 - dot * dot / nb2 if nb2 > 0 else na2
            worst = max(worst, err / norms[k] if norms[k] > 0 else 0.0)
        mine = {k: (v[1] - v[0] * v[0] / v[2] if v[2] > 0 else v[1]) / (norms[k] or 1.0) for k, v in s.items()}
        miss[i] = max(miss.get(i, 0.0), max(mine.values(), default=0.0))
        if worst > allowed:
            return False, None
    last = pooled_estimate(sums, z)
    return last[2] >= target, last


def output_norms(refs: list[dict]) -> dict[str, float]:
    """Each output's squared norm over a set of references (what ``meets_target`` measures errors against), of their
    finite values (NaN/inf in the reference are left out of the comparison: tasks/accuracy/metrics.py ``finite_part``)."""
    def finite(a):
        a = np.asarray(a)
        return a if a.dtype.kind not in "fc" or np.isfinite(a).all() else a[np.isfinite(a)]
    return {k: sum(float(np.vdot(finite(r[k]), finite(r[k]))) for r in refs) for k in (refs[0] if refs else {})}


JUDGE_Z = 1.0  # standard errors of the pooled cosine a candidate's figure is lowered by before it meets the target

@dataclass(frozen=True)
class Judged:
    """A graph's figure on the search's samples: the pooled cosine, its standard error, the bound that meets the target
    (cosine less JUDGE_Z standard errors) and the worst single held-out feed (None where not measured)."""
    cosine: float
    se: float
    bound: float
    worst: float | None = None

    @property
    def less_se(self) -> str:
        return f" (less {JUDGE_Z:g} standard error: {self.bound:.6f})" if self.se else ""

    @classmethod
    def of(cls, outs: list[dict], refs: list[dict], feeds: list[Feed], metric=None, z: float = JUDGE_Z,
           held: int | None = None) -> "Judged":
        """The figure of ``outs`` (one output dict per feed) against ``refs``, as both searches judge: with ``metric``
        (tasks.accuracy.metric.SearchJudge, not cosine) its worst feed as all three; else the pooled cosine less ``z``
        standard errors (``tasks.accuracy.metrics.pooled_estimate``, validate's statistic). ``worst``: the lowest cosine of the
        first ``held`` feeds (the held-out ones; default all)."""
        held = len(outs) if held is None else held
        worst = worst_feed_cosine(outs[:held], refs[:held])
        if metric is not None and metric.name != "cosine":
            w = metric.worst(outs, refs, feeds)
            return cls(w, 0.0, w, worst=worst)
        return cls(*pooled_estimate([pooled_sums(r, o) for o, r in zip(outs, refs)], z), worst=worst)
