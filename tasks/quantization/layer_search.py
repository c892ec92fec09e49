"""The calibrate stage's accuracy search, step by step: every layer quantized judged first; where that misses the
target, each tensor's range chosen by the error it causes in the layer that reads it (int8 without a method given),
the layers ranked by their own output error and restored to the high precision (tasks/search/restore.py), and the
graph that is written judged, giving back its most harmful layers until it meets the target.

``SearchState`` carries what judges a candidate (fixed for a graph) and what the search has found so far (the
quantizer of the ranges in use, its switchable session, the figures, the layers chosen) from one step to the next.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from tasks.common.errors import AccuracyError, UnavailableError
from tasks.accuracy.nonfinite import on_finite_reference
from tasks.graph.flops import onnx_flops
from tasks.quantization.qdq import QUANT_OPS, Quantizer
from tasks.quantization.ranges import STAGE, alternative_ranges
from tasks.quantization.sensitivity import Switchable, local_errors
from tasks.search.judging import JUDGE_Z, Judged
from tasks.search.restore import restore_search

RANK_FEEDS = 8  # calibration samples the local errors (range choice, report) are measured on
HARM_FEEDS = 1  # calibration samples each layer's restore gain (the search's ranking) is measured on
WRITTEN_RTOL = 1e-5  # of an output's largest |value|: the written graph and the scorer's switchable graph agree
Feed = dict[str, np.ndarray]


@dataclass
class SearchState:
    """What judges the search's candidates and what the search found: the fields after ``q`` change as it goes."""
    fp32_path: Path
    precision: str
    method: str
    choose: bool  # int8 without a method given: each tensor's range chosen by its local error
    min_cosine: float | None
    high_precision: str
    metric: object  # tasks.accuracy.metric.SearchJudge
    what: str  # the value the search judges by, in words (messages)
    pooled: bool  # cosine: pooled less its standard error; another metric: its worst feed
    feeds: list[Feed]  # the calibration samples
    eval_feeds: list[Feed]  # the held-out samples (default: the calibration samples)
    judge_feeds: list[Feed]
    judged: str  # the judged set, in words
    ref: list[dict]  # the fp32 outputs of judge_feeds
    run_fp32: Callable[[Feed], dict]
    through: object  # tasks.partition.segments.Through, or None
    prepared: Path
    layers: list[str]
    q: Quantizer  # the quantizer of the ranges in use
    scorer: Switchable | None = None  # the search's session (int8 with a budget): it judges every layer quantized too
    all_met: bool | None = None  # every layer quantized meets the target (None: not asked)
    cos_all: Judged | None = None
    chosen: list[str] = field(default_factory=list)
    cos_chosen: Judged | None = None
    cos_none: Judged | None = None
    sensitivity: list[dict] = field(default_factory=list)
    closest: list[dict] = field(default_factory=list)  # a refusal's closest layers, each judged alone
    range_choice: dict = field(default_factory=dict)
    search_runs: int = 0  # whole-model runs of every session the search judged on (the ranges race's loser too)
    boundary_choice: dict | None = None  # the layers judged back to save precision boundaries, and whether they met
    timing: dict = field(default_factory=dict)
    retired_runs: int = 0  # runs of a session the search judged on and then left (the ranges race's loser)
    judged_refs: list[dict] = field(init=False)  # what a candidate's outputs are judged against, and on which inputs
    judged_inputs: list[Feed] = field(init=False)

    def __post_init__(self) -> None:
        self.judged_refs, self.judged_inputs = ((self.through.refs, self.through.feeds) if self.through is not None
                                                else (self.ref, self.judge_feeds))

    def score_with(self, qz: Quantizer, names: list[str]) -> Judged | None:
        outs = qz.outputs(names, self.judge_feeds)
        if outs is not None and self.through is not None:
            outs = [self.through(k, o) for k, o in enumerate(outs)]
        if outs is not None:  # no precision approaches a NaN/inf of the reference: left out
            outs = [on_finite_reference(o, r) for o, r in zip(outs, self.judged_refs)]
        return None if outs is None else Judged.of(outs, self.judged_refs, self.judged_inputs, self.metric,
                                                   held=len(self.eval_feeds))

    def score(self, names: list[str]) -> Judged:
        return self.score_with(self.q, names)  # q: the quantizer of the ranges in use

    def switchable(self, q: Quantizer) -> Switchable:
        return Switchable(q, self.judge_feeds, self.ref, JUDGE_Z, None if self.pooled else self.metric.value,
                          self.through)


def judge_every_layer(s: SearchState) -> None:
    """``s.cos_all`` (every layer quantized) and ``s.all_met`` (whether it meets the target, None without one); with
    a budget on int8, on the search's session ``s.scorer``."""
    layers, min_cosine = s.layers, s.min_cosine
    if min_cosine is not None and s.precision == "int8" and layers:
        s.scorer = s.switchable(s.q)
        if s.choose and s.pooled:  # only whether it meets, refused after a few feeds when far below: other ranges
            # race it below, and the figure reported is the one of the ranges kept (measured on every feed)
            s.all_met = s.scorer.meets(layers, float(min_cosine), again=True)  # judged again in the race
            s.cos_all = Judged(*s.scorer.last) if s.all_met else None
        else:
            s.cos_all = Judged.of(s.scorer.outputs(layers), s.judged_refs, s.judged_inputs, s.metric,
                                  held=len(s.eval_feeds))
    else:
        s.cos_all = s.score_with(s.q, layers)
        if min_cosine is not None and s.cos_all is None:
            raise UnavailableError(
                f"{s.precision} Q/DQ graphs cannot be run by ONNX Runtime on this host ({s.q.run_error}), so the "
                f"accuracy budget min_cosine={min_cosine:.6g} cannot be checked", stage=STAGE, file=str(s.fp32_path),
                fix="set min_cosine to None to quantize every layer unchecked, use int8, or validate on a GPU")
    if s.all_met is None and min_cosine is not None:
        s.all_met = s.cos_all.bound >= min_cosine


def search_layers(s: SearchState) -> None:
    """The search where every layer quantized misses the target: the ranges chosen (``choose_ranges``), the layers
    restored (``restore_layers``) unless those ranges suffice, the written graph judged (``judge_written_graph``) and
    the sensitivity rows filled in; refused (AccuracyError) when no layer can be quantized."""
    flops = onnx_flops(s.q.base, {n: list(a.shape) for n, a in s.eval_feeds[0].items()}, s.layers)
    rank_feeds = list(s.feeds[:RANK_FEEDS])  # layers are ranked on calibration samples, judged on held-out ones
    local, s.range_choice = {}, {}
    clock = time.perf_counter()
    # one session: any subset scored by feeding flags
    s.scorer = s.scorer or s.switchable(s.q)
    all_bound = s.cos_all.bound if s.cos_all is not None else None
    if s.choose:  # each tensor's range by the error it causes in the layer that reads it (local, cheap)
        local, all_bound = choose_ranges(s, rank_feeds, all_bound, clock)
    if all_bound >= s.min_cosine:  # the ranges chosen suffice: every layer int8
        s.chosen, harm = list(s.layers), {n: min(e.values()) for n, e in local.items()}
        s.sensitivity = [{"node": n, "op": s.q.ops.get(n), "flops": flops.get(n)} for n in s.layers]
    else:  # restore layers to the high precision, most harmful per FLOP first, judged on held-out samples
        local, harm = restore_layers(s, local, rank_feeds, flops, clock)
        fewer_boundaries(s)
    s.timing["search"] = time.perf_counter() - clock - sum(s.timing.values())
    judge_written_graph(s, harm)
    s.search_runs = s.scorer.runs + s.retired_runs
    s.timing["written_graph"] = time.perf_counter() - clock - sum(s.timing.values())
    annotate_sensitivity(s, local)
    if not s.chosen:
        refuse_without_layers(s)


def choose_ranges(s: SearchState, rank_feeds: list[Feed], all_bound: float | None,
                  clock: float) -> tuple[dict, float | None]:
    """The ranges chosen by local error raced against the own ranges on every layer quantized; the winner's quantizer,
    session and figure become ``s``'s. Returns (the local errors, every layer quantized's bound)."""
    q_local, local, picked = ranges_by_local_error(s.q, s.prepared, rank_feeds)
    s.timing["ranges_chosen"] = time.perf_counter() - clock
    s_local = s.switchable(q_local)
    c_local = s_local.estimate(s.layers)[2]
    # kept only where the whole model gains (local error is not always global: layout_cdla all-int8 0.818
    # with entropy, 0.646 with the locally chosen ranges); the own ranges' figure raced against it
    # (refused after a few feeds where it is lower, as on most models)
    own_wins = all_bound >= c_local if all_bound is not None else s.scorer.meets(s.layers, c_local)
    if own_wins and s.cos_all is None:
        s.cos_all = Judged(*s.scorer.last)
        all_bound = s.cos_all.bound
    s.retired_runs += s_local.runs if own_wins else s.scorer.runs  # the loser's runs count too
    if not own_wins:
        s.q, s.scorer, all_bound, s.range_choice = q_local, s_local, c_local, picked
        s.cos_all = Judged(*s_local.last, worst=None)  # every layer quantized, as the search compares them
    return local, all_bound


def restore_layers(s: SearchState, local: dict, rank_feeds: list[Feed], flops: dict,
                   clock: float) -> tuple[dict, dict]:
    """``s.chosen``: the layers ``restore_search`` keeps quantized, ranked by each one's own output error with its
    ranges in use and judged on the search's session. Returns (the local errors, each layer's harm)."""
    scorer, layers, goal = s.scorer, s.layers, float(s.min_cosine)
    judged_at = {id(f): k for k, f in enumerate(s.judge_feeds)}  # a judged feed's reference is at hand
    rank_refs = [s.ref[judged_at[id(f)]] if id(f) in judged_at else s.run_fp32(f) for f in rank_feeds[:HARM_FEEDS]]
    if not local:  # the method was given: the local errors of its ranges alone
        errs = local_errors({s.method: s.q}, s.prepared, rank_feeds, worst=True)[s.method]
        local = {n: {s.method: errs.get(n)} for n in layers}
    # ranked by each layer's own output error with its ranges in use (local, from the pass above): one
    # whole-model run per layer and page (its gain restored alone in the all-int8 graph) cost 14 s on
    # PP-OCRv4 det and its boundary was no better (12 of 72 layers; the screen below finds 29)
    harm = {n: local[n].get(s.range_choice.get(n, s.method)) or 0.0 for n in layers}
    s.timing["ranking"] = time.perf_counter() - clock - sum(s.timing.values())
    met: list[float] = []  # the bound of each candidate met, the last one's margin guides the refinement

    def meets(names: list[str]) -> bool:
        if len(names) == len(layers):  # every layer quantized: judged above, short of the target
            return False
        ok = scorer.meets(names, goal)
        if ok and scorer.last is not None:
            met.append(scorer.last[2])
        return ok

    def screen(base: list[str], candidates: list[str]) -> dict[str, float]:
        # the loss of quantizing each alone on top of base, same page; the runs two at a time
        at, *each = (min(c) for c in scorer.cosines_each([base, *([*base, n] for n in candidates)],
                                                         rank_feeds[:HARM_FEEDS], rank_refs))
        return {n: at - c for n, c in zip(candidates, each)}

    why: dict[str, str] = {}
    s.chosen, _ = restore_search(layers, meets, harm, flops, screen=screen,
                                 slack=lambda: met[-1] - goal if met else None, why=why)
    s.sensitivity = [{"node": n, "op": s.q.ops.get(n), "flops": flops.get(n),
                      **({"kept_because": why[n]} if n in why else {})} for n in layers]
    return local, harm


def fewer_boundaries(s: SearchState) -> None:
    """Of two choices that meet the target, the one with fewer precision boundaries: the layers the search kept in
    high precision between quantized neighbours only (tasks/quantization/boundaries.py: each costs a reformat on either
    side) are judged back together, once; where the whole still meets the target it replaces the search's choice
    (more layers quantized, fewer boundaries), else the choice stays. ``s.boundary_choice`` says which."""
    from tasks.quantization.boundaries import isolated_restored

    back = isolated_restored(s.q.base.graph, s.layers, s.chosen) if s.chosen else []
    if not back:
        return
    wider = [n for n in s.layers if n in set(s.chosen) | set(back)]
    kept = s.scorer.meets(wider, float(s.min_cosine))
    s.boundary_choice = {"layers": back, "met": kept}
    if kept:
        s.chosen = wider
        for row in s.sensitivity:
            if row["node"] in set(back):
                row.pop("kept_because", None)
    else:
        for row in s.sensitivity:
            if row["node"] in set(back):
                row["kept_because"] = (row.get("kept_because", "") + "; judged back with the other layers between "
                                       "quantized ones, to save their precision boundaries: the target was missed")


def judge_written_graph(s: SearchState, harm: dict) -> None:
    """``s.cos_chosen``: the graph that is written, the scorer's figure of the same layers where it judged them on
    every feed and the written graph gives its outputs on a feed, else judged on its own session."""
    s.cos_chosen = (judged_as_written(s.q, s.chosen, s.scorer, s.judge_feeds, len(s.eval_feeds))
                    or s.score(s.chosen)) if s.chosen else None
    # should the two differ (an fp32 keep the converter decides otherwise in the switchable graph), give back
    # the most harmful chosen layers, 1, 2, 4, ... of them, until the written graph meets the target or nothing
    # is quantized
    give_back, k = sorted(s.chosen, key=lambda n: -(harm.get(n) or 0.0)), 1
    while s.chosen and s.cos_chosen.bound < s.min_cosine:
        s.chosen = [n for n in s.chosen if n not in set(give_back[:k])]
        s.cos_chosen = s.score(s.chosen) if s.chosen else None
        k *= 2


def annotate_sensitivity(s: SearchState, local: dict) -> None:
    """Each sensitivity row with its local errors, the one of its range in use, whether it is quantized and its
    range."""
    for row in s.sensitivity:
        row["local_errors"] = local.get(row["node"])  # per range method: the layer's own output error
        row["local_error"] = (local[row["node"]][s.range_choice.get(row["node"], s.method)]
                              if row["node"] in local else None)
        row["quantized"] = row["node"] in set(s.chosen)
        row["range"] = s.range_choice.get(row["node"], s.method) if s.choose else s.method


CLOSEST = 3  # layers a refusal measures alone and names: those whose own output error is least


def closest_layers(s: SearchState, count: int = CLOSEST) -> list[dict]:
    """The ``count`` layers whose own output error is least, each judged quantized alone on the search's session as
    the search judges a candidate: rows ``{"node", "op", "flops_share", "local_error", "value", "se", "bound"}``
    (``value``: the pooled cosine, or another metric's worst feed; ``bound``: what is compared with the target),
    best bound first."""
    rows = [r for r in s.sensitivity if r.get("local_error") is not None] or list(s.sensitivity)
    total = sum(r.get("flops") or 0 for r in s.sensitivity) or None
    picked = sorted(rows, key=lambda r: r.get("local_error") if r.get("local_error") is not None else float("inf"))
    out = []
    for r in picked[:count]:
        value, se, bound = s.scorer.estimate([r["node"]])
        out.append({"node": r["node"], "op": r.get("op"), "local_error": r.get("local_error"), "value": value, "se": se,
                    "bound": bound, "flops_share": (r.get("flops") or 0) / total if total else None})
    return sorted(out, key=lambda r: -r["bound"])


def what_would_pass(s: SearchState, best: dict) -> str:
    """The settings under which the best of ``closest_layers`` meets the search's target, in words."""
    b, target, what = best["bound"], float(s.min_cosine), s.what
    if s.metric.name != "cosine":
        return (f"a search target of at most {b:.6g} would keep {best['node']} {s.precision}: relax "
                f"accuracy.metric={s.metric.name}'s settings until its {what} reaches that, or lower "
                f"calibration.budget_margin (the search tightens the metric by it)")
    # the budget behind the target (a judge made for another target, as a direct call's default: the target itself)
    budget = float(s.metric.metric.min_cosine) if abs(float(s.metric.target) - target) < 1e-12 else target
    share = (target - budget) / (1.0 - budget) if budget < 1.0 else 0.0  # the margin in use, of the allowed error
    lower = (b - share) / (1.0 - share) if share < 1.0 else b
    text = (f"a search target of at most {b:.6f} would keep {best['node']} {s.precision} (the target is "
            f"accuracy.min_cosine={budget:.6g} plus {share:.3g} of the allowed error, calibration.budget_margin grown "
            f"for the samples judged): accuracy.min_cosine={max(lower, 0.0):.6f} at this margin")
    if b > budget:
        text += f", or calibration.budget_margin low enough that {(b - budget) / (1.0 - budget):.3g} of the allowed " \
                "error is held in reserve at accuracy.min_cosine as it is"
    return text


def refuse_without_layers(s: SearchState) -> None:
    """AccuracyError for a search that found no layer to quantize: the graph without any Q/DQ, measured here only
    (the search takes it to meet), already below the target, or no part of the layers meets it; the latter names the
    closest layers (``closest_layers``), their figures and the settings under which the best would pass."""
    min_cosine, metric, what = s.min_cosine, s.metric, s.what
    s.cos_none = Judged.of(s.scorer.outputs([]), s.judged_refs, s.judged_inputs, metric, held=len(s.eval_feeds))
    if s.cos_none.bound < min_cosine:
        raise AccuracyError(
            f"the {s.high_precision} graph without any Q/DQ already gives {what} {s.cos_none.cosine:.8f}"
            f"{s.cos_none.less_se}, below the search's target {min_cosine:.6g} "
            f"(accuracy.metric={metric.name}; {s.judged})", stage=STAGE, file=str(s.fp32_path),
            fix=f"relax accuracy.metric={metric.name}'s threshold (accuracy.min_cosine for cosine), or build this "
                "model at precision=fp16: its accuracy search keeps in fp32 the nodes fp16 cannot compute")
    closest = closest_layers(s)
    s.closest = closest
    figures = "; ".join(
        f"{r['node']}" + (f" ({r['op']}, {r['flops_share']:.1%} of the FLOPs)" if r["flops_share"] is not None else "")
        + f": {what} {r['value']:.6f}" + (f" less {JUDGE_Z:g} standard error {r['se']:.2g} = {r['bound']:.6f}"
                                          if s.pooled else "") for r in closest)
    raise AccuracyError(
        f"no layer can be quantized to {s.precision} within the search's target {what} {min_cosine:.6g} "
        f"(accuracy.metric={metric.name} and calibration.budget_margin): all {len(s.layers)} "
        f"{'/'.join(QUANT_OPS)} layers together give {s.cos_all.cosine:.6f}{s.cos_all.less_se}, and no part of "
        f"them that the search tried meets it ({'pooled' if s.pooled else 'worst feed'} over {s.judged}"
        f"{f', less {JUDGE_Z:g} standard error' if s.pooled else ''}). Closest, each quantized alone: {figures}",
        stage=STAGE, file=str(s.fp32_path),
        fix=(what_would_pass(s, closest[0]) + "; " if closest else "") +
            f"or calibrate on more representative samples, try another calibration method, or build this model at "
            f"fp16; sensitivity.json in the failed result ranks every layer")


def judged_as_written(q: Quantizer, chosen: list[str], scorer: Switchable, feeds: list[Feed],
                      held: int) -> Judged | None:
    """The scorer's figure of ``chosen`` (a subset it met, judged on every feed) as the written graph's, where the
    written graph gives the scorer's outputs on the first feed (the same ops on the same values: its If switches only
    choose between them; each output within WRITTEN_RTOL of its largest |value|); None where it has no such figure
    or they differ, and the written graph is judged itself (a judgement of every feed: 1.7 s of PP-OCRv4 det's 24
    pages)."""
    known = scorer.met.get(frozenset(chosen)) if scorer is not None and scorer.judge is None else None
    if known is None or len(known[1]) != len(feeds):
        return None
    written = q.outputs(chosen, feeds[:1])
    if written is None:
        return None
    switched = scorer._run(set(chosen), feeds[0])
    for name, w in written[0].items():
        ref, w = np.asarray(switched.get(name)), np.asarray(w)
        if ref.shape != w.shape:
            return None
        if ref.dtype.kind not in "fc" or w.dtype.kind not in "fc":  # a mask, an index (a segment's outputs): equal
            if not np.array_equal(ref, w):
                return None
        elif np.abs(ref - w).max(initial=0.0) > WRITTEN_RTOL * np.abs(ref).max(initial=0.0):
            return None
    (cos, se, bound), per_feed = known
    return Judged(cos, se, bound, worst=min((per_feed[k] for k in range(held)), default=None))


def ranges_by_local_error(q: Quantizer, prepared: Path, feeds: list[Feed]):
    """Per activation tensor, the range (entropy, percentile, max or MSE of the same histogram) whose quantization
    gives the least error in the layer that reads it on its worst sample (each layer quantized alone, from fp32
    activations: local, one probe run per method and sample; the worst sample, not the pooled error, so that a range
    clipping what a few samples need is not chosen: PP-OCRv4 det's pages in large type). Entropy's KL criterion clips tensors whose rare large values carry the signal
    (PP-OCRv4 det's first pointwise Conv: relative output error 0.67 with entropy, 0.003 with the percentile range).
    A tensor read by several layers: the most sensitive one decides. Returns (the quantizer with those ranges,
    {layer: {method: its local error}}, {layer: method} where that is not ``q``'s own)."""
    from onnxruntime.quantization.calibrate import TensorsData

    own = q.ranges.calibration_method
    own_name = {"Entropy": "entropy", "Percentile": "percentile", "MinMax": "minmax"}.get(str(own).split(".")[-1], "entropy")
    alts = {m: r for m, r in alternative_ranges(q.ranges).items() if m != own_name}
    quantizers = {own_name: q, **{m: q.with_ranges(r) for m, r in alts.items()}}
    errors = local_errors(quantizers, prepared, feeds, worst=True)
    best = {n: min(errors, key=lambda m: (errors[m].get(n, float("inf")), m != own_name)) for n in q.layers}
    data, taken = dict(q.ranges.data), set()
    for n in sorted(q.layers, key=lambda n: -errors[best[n]].get(n, 0.0)):
        for t in q.activations(n):
            if t not in taken:
                taken.add(t)
                if best[n] != own_name:
                    data[t] = alts[best[n]].data[t]
    return (q.with_ranges(TensorsData(own, data)), {n: {m: errors[m].get(n) for m in errors} for n in q.layers},
            {n: m for n, m in best.items() if m != own_name})
