"""fp16 under the accuracy budget: the few nodes to keep in fp32 when the fp16 graph misses ``accuracy.min_cosine``.

int8 has a search that keeps sensitive layers in higher precision (tasks/quantization/calibrate.py); this is fp16's. A model whose
fp16 graph is close to fp32 everywhere except at a few nodes (an autoregressive decoder: one step's argmax flips in
fp16 and the sequence it feeds back diverges) would otherwise only be told to use fp32.

Judged on the search's held-out samples (never the validation set), with the faithful fp16 emulation
(tasks/onnxrt/emulate.py: every fp16 value rounded after each op, control-flow bodies included), by ``accuracy.metric`` as the
int8 search judges (tasks/quantization/calibrate.py): cosine by its pooled figure over the samples (validate's statistic) less one
standard error (``tasks.accuracy.metrics.pooled_estimate``), another metric (allclose, top1, the user's) by its worst sample
against its own target (``tasks.accuracy.metric.SearchJudge``), in a few whole-model runs:

1. the fp16 graph as converted is scored on every held-out sample; when it meets the target, nothing is kept;
2. else each top-level node that computes in fp16 is ranked by the error it adds (``error_growth``): from ONE fp32
   pass and ONE pass of the fp16 graph, both exposing every value, on the worst held-out sample: the relative error of
   the node's outputs less the largest relative error of its inputs (a Loop is one node: its body with it);
3. ``tasks.search.restore.restore_search`` keeps nodes fp32, most error per FLOP first, by binary search on the prefix (log2 of
   the node count of judged conversions, each refused as soon as the samples run prove it cannot meet the target,
   hardest first: ``tasks.quantization.sensitivity.meets_target``), then tries the large ones back;
4. the graph with those nodes kept is scored on every held-out sample; still short, or every node kept (that is an
   fp32 engine), the build fails naming that figure, the samples and the remedy.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from tasks.common.errors import AccuracyError, StageError
from tasks.accuracy.metrics import cosine
from tasks.common.util import StageResult

Feed = dict[str, np.ndarray]
STAGE = "build"
REFINE = 4  # large nodes tried back to fp16 after the prefix search, at most (each one whole-model judgement)
NOT_CANDIDATES = ("Cast", "Constant", "Identity", "Shape", "Size")  # nothing to compute in another precision


def fp16_candidates(model16: onnx.ModelProto) -> list[str]:
    """Top-level nodes of a converted graph that compute in fp16 (an fp16 float output), in graph order."""
    from tasks.graph.types import value_types

    types = value_types(model16)
    return [n.name for n in model16.graph.node if n.op_type not in NOT_CANDIDATES
            and any(types.get(o) == onnx.TensorProto.FLOAT16 for o in n.output if o)]


def _relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| (float64); integer and boolean values: the share of elements that differ."""
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return 1.0
    if ref.dtype.kind not in "fc":
        return float(np.mean(got != ref)) if ref.size else 0.0
    a, b = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    if not np.isfinite(a).all():
        return 1.0
    nb = float(np.linalg.norm(b))
    d = float(np.linalg.norm(a - b))
    return d / nb if nb > 0 else (0.0 if d == 0 else 1.0)


def error_growth(fp32: onnx.ModelProto, model16: onnx.ModelProto, names: list[str], feed: Feed) -> dict[str, float]:
    """{node: the relative error of its outputs in the fp16 graph less the largest of its inputs'} for the top-level
    nodes ``names`` of ``model16``, from one run of each graph on ``feed`` exposing every value (a node's inputs are
    followed back through the Casts the conversion put in, to the values both graphs have)."""
    from tasks.onnxrt.emulate import fp16_rounded
    from tasks.onnxrt.ort import ort_session
    from tasks.partition.segments import run_with_intermediates

    g16 = model16.graph
    producer = {o: n for n in g16.node for o in n.output if o}
    inits = {t.name for t in g16.initializer}

    def origin(v: str) -> str:
        seen = 0
        while v in producer and producer[v].op_type == "Cast" and seen < 4:
            v, seen = producer[v].input[0], seen + 1
        return v

    by_name = {n.name: n for n in g16.node}
    fp32_values = {o for n in fp32.graph.node for o in n.output if o} | {i.name for i in fp32.graph.input}
    ios: dict[str, tuple[list[str], list[str]]] = {}
    for name in names:
        n = by_name[name]
        ins = [origin(x) for x in n.input if x and x not in inits]
        ios[name] = ([x for x in ins if x in fp32_values], [o for o in n.output if o in fp32_values])
    values = sorted({v for i, o in ios.values() for v in (*i, *o)})
    ref = run_with_intermediates(fp32, values, [feed])[0]
    rounded = fp16_rounded(model16)
    have = {o.name for o in rounded.graph.output} | {i.name for i in rounded.graph.input}
    rounded.graph.output.extend(onnx.ValueInfoProto(name=v) for v in values if v not in have)
    sess = ort_session(rounded.SerializeToString(), stage=STAGE)
    outs = [o.name for o in sess.get_outputs()]
    got = {**dict(zip(outs, sess.run(outs, feed))), **feed}
    err = {v: _relative_error(got[v], ref[v]) for v in values if v in got and v in ref}
    return {name: max(0.0, max((err.get(o, 0.0) for o in o_), default=0.0) - max((err.get(x, 0.0) for x in i_),
                                                                                 default=0.0))
            for name, (i_, o_) in ios.items()}


class Judge:
    """Scores converted graphs on the held-out samples against the fp32 references, one emulated session each, as the
    int8 search judges (tasks/quantization/calibrate.py): ``metric`` (tasks.accuracy.metric.SearchJudge) cosine, or
    None: the pooled cosine less ``z`` standard errors (``tasks.accuracy.metrics.pooled_estimate``, validate's
    statistic); another metric: its worst feed (``SearchJudge.value``)."""

    def __init__(self, feeds: list[Feed], refs: list[dict], metric=None, z: float | None = None):
        from tasks.search.judging import JUDGE_Z
        from tasks.search.judging import output_norms

        self.feeds, self.refs, self.metric = feeds, refs, metric
        self.value = None if metric is None or metric.name == "cosine" else metric.value
        self.z = JUDGE_Z if z is None else z
        self.runs = 0  # whole-model runs (one sample each)
        self._miss: dict[int, float] = {}  # per sample: how far it fell short before (hardest first)
        self._norms = output_norms(refs)
        from tasks.accuracy.nonfinite import nonfinite_reference
        self.nonfinite = nonfinite_reference(refs)  # outputs whose fp32 reference is not finite: no precision helps
        self.per_feed: list[float] = []  # the last ``estimate``'s value per sample (cosine, or the metric's)

    @property
    def pooled(self) -> bool:
        return self.value is None

    def _runner(self, model16: onnx.ModelProto):
        from tasks.onnxrt.emulate import precision_runner

        run = precision_runner(model16, stage=STAGE)[0]

        def counted(feed: Feed) -> dict:
            self.runs += 1
            return run(feed)
        return counted

    def estimate(self, model16: onnx.ModelProto):
        """The graph on every sample: ``tasks.search.judging.Judged`` (the pooled cosine, its standard error and the
        bound less ``z`` of them; another metric: its worst feed as all three) with the worst single sample's cosine."""
        from tasks.search.judging import Judged

        run = self._runner(model16)
        outs = [run(f) for f in self.feeds]
        self.per_feed = [min((cosine(o[k], r[k]) for k in r), default=1.0) if self.pooled else self.value(o, r, f)
                         for o, r, f in zip(outs, self.refs, self.feeds)]
        for i, v in enumerate(self.per_feed):  # the samples that came lowest run first in ``meets``
            self._miss[i] = max(self._miss.get(i, 0.0), 1.0 - v)
        return Judged.of(outs, self.refs, self.feeds, self.metric, self.z)

    def meets(self, model16: onnx.ModelProto, target: float) -> bool:
        """Whether the graph meets ``target`` (``tasks.quantization.sensitivity.meets_target``: the samples that fell shortest before
        run first; a candidate is refused as soon as those run prove it cannot)."""
        from tasks.search.judging import meets_target

        return meets_target(self._runner(model16), self.feeds, self.refs, target, self._miss, self._norms, self.z,
                            self.value)[0]


def fp16_within_budget(fp32_path: Path, out_path: Path, feeds: list[Feed], target: float, *,
                       convert: Callable[[dict[str, float]], tuple[onnx.ModelProto, dict]],
                       metric=None, samples_text: str = "held-out samples", budget: float | None = None) -> StageResult:
    """The fp16 graph of ``fp32_path`` that meets ``target`` on the held-out ``feeds`` with the fewest nodes kept fp32
    (see the module doc), written to ``out_path``. ``convert(keep_nodes)`` converts the fp32 model with those nodes
    kept fp32 (and whatever the data decided). ``metric`` (tasks.accuracy.metric.SearchJudge; None: cosine) judges as
    the int8 search does: cosine by its pooled figure less one standard error, another metric by its worst feed;
    ``target`` is on the metric's scale. Metrics, under the int8 search's names: cosine: ``search_cosine``,
    ``search_cosine_se``, ``search_cosine_bound`` (the written graph) and ``search_cosine_fp16`` (the graph as
    converted, pooled); another metric: ``search_metric``, ``search_score_worst_feed``, ``search_score_fp16``; both:
    ``search_cosine_worst_feed`` (the written graph's worst sample), ``fallback_layers`` (nodes the search kept fp32),
    ``search_samples``, ``search_runs``, ``search_seconds``; details: the kept nodes with what each costs, and the
    ranking (``sensitivity``, as the int8 search reports it)."""
    from tasks.graph.models import save_onnx
    from tasks.data.inputs import batch_size

    t0 = time.perf_counter()
    fp32 = onnx.load(str(fp32_path))
    model16, stats = convert({})
    try:
        judge, first = _judged_as_converted(fp32_path, feeds, metric, model16)
    except StageError as e:  # ONNX Runtime cannot run it here: no figure (validate says what it can), no search
        save_onnx(model16, out_path)
        return StageResult(files={"onnx": out_path}, metrics={}, details={
            **stats, "fp16_search_skipped": f"not measured: ONNX Runtime cannot run the graph here ({e.message[:300]})"})
    pooled = judge.pooled
    what = "cosine" if pooled else getattr(metric, "label", "score")
    statistic = (f"pooled cosine less {judge.z:g} standard error (jackknife over the samples)" if pooled else
                 f"{what}, worst sample")
    details: dict = {"min_cosine": target, "search_feeds": len(feeds), "search_set": samples_text,
                     "search_statistic": statistic, "metric": "cosine" if pooled else metric.name,
                     "cosine_fp16": first.cosine, "bound_fp16": first.bound, "kept": {}, "sensitivity": []}
    metrics = {"search_samples": sum(batch_size(f) for f in feeds)}
    chosen_kept: dict[str, float] = {}
    final = first
    if first.bound < target:
        candidates, chosen_kept, details["sensitivity"] = _kept_by_search(fp32, model16, feeds, judge, convert, target)
        model16, stats = convert(chosen_kept)
        final = judge.estimate(model16)
        details["kept"] = chosen_kept
        where = (f"{statistic} over {len(feeds)} {samples_text}, onnxruntime emulation of fp16")
        aim = (f"the search's target {target:.6g}" + (
            f" (accuracy.min_cosine={budget:g} plus calibration.budget_margin of the allowed error)"
            if budget is not None and pooled else f" ({what})" if not pooled else ""))
        _refuse_short_of_target(first, final, candidates, chosen_kept, target, judge.z, where, aim, samples_text,
                                fp32_path, judge.nonfinite)
    save_onnx(model16, out_path)
    if pooled:
        metrics.update(search_cosine_fp16=first.cosine, search_cosine=final.cosine, search_cosine_se=final.se,
                       search_cosine_bound=final.bound)
    else:
        metrics.update(search_metric=metric.name, search_score_fp16=first.cosine, search_score_worst_feed=final.cosine)
    metrics.update(search_cosine_worst_feed=final.worst, fallback_layers=len(chosen_kept), search_runs=judge.runs,
                   search_seconds=time.perf_counter() - t0)
    return StageResult(files={"onnx": out_path}, metrics=metrics, details={**stats, "fp16_search": details})


def _judged_as_converted(fp32_path: Path, feeds: list[Feed], metric, model16: onnx.ModelProto):
    """The ``Judge`` of the held-out ``feeds`` against the fp32 model's outputs, and its estimate of ``model16`` (the
    graph as converted). Raises StageError when ONNX Runtime cannot run either graph here."""
    from tasks.onnxrt.ort import ort_session, ort_run

    ref_sess = ort_session(Path(fp32_path), stage=STAGE)
    refs = [ort_run(ref_sess, f, stage=STAGE) for f in feeds]
    judge = Judge(feeds, refs, metric)
    return judge, judge.estimate(model16)


def _kept_by_search(fp32: onnx.ModelProto, model16: onnx.ModelProto, feeds: list[Feed], judge: Judge,
                    convert: Callable[[dict[str, float]], tuple[onnx.ModelProto, dict]],
                    target: float) -> tuple[list[str], dict[str, float], list[dict]]:
    """The nodes to keep fp32 (``tasks.search.restore.restore_search`` over the fp16 nodes ranked by their error growth on
    the worst held-out sample, per FLOP): the candidates, {kept node: its error growth} and the ranking (``sensitivity``,
    most error first)."""
    from tasks.graph.flops import onnx_flops
    from tasks.search.restore import restore_search

    names = fp16_candidates(model16)
    hardest = feeds[int(np.argmin(judge.per_feed))]
    growth = error_growth(fp32, model16, names, hardest)
    shapes = {k: list(v.shape) for k, v in hardest.items()}
    flops = onnx_flops(model16, shapes, names)
    ops = {n.name: n.op_type for n in model16.graph.node}
    candidates = names

    def meets(fp16_nodes: list[str]) -> bool:
        on = set(fp16_nodes)
        m, _ = convert({n: growth.get(n, 0.0) for n in candidates if n not in on})
        return judge.meets(m, target)

    fp16_nodes, _ = restore_search(candidates, meets, growth, flops, refine=REFINE)
    chosen_kept = {n: growth.get(n, 0.0) for n in candidates if n not in set(fp16_nodes)}
    sensitivity = sorted(
        ({"node": n, "op": ops.get(n), "flops": flops.get(n), "error_growth": growth.get(n, 0.0),
          "quantized": n not in chosen_kept} for n in candidates), key=lambda r: -r["error_growth"])
    return candidates, chosen_kept, sensitivity


def _figure(j, z: float) -> str:
    """A judged graph's figure as the search's messages give it (with its bound when it has a standard error)."""
    return f"{j.cosine:.6f}" + (f" (less {z:g} standard error: {j.bound:.6f})" if j.se else "")


def _refuse_short_of_target(first, final, candidates: list[str], chosen_kept: dict[str, float], target: float,
                            z: float, where: str, aim: str, samples_text: str, fp32_path: Path,
                            nonfinite: dict | None = None) -> None:
    """Raise the AccuracyError of a search that kept every candidate fp32 (an fp32 engine) or whose ``final`` graph
    still misses ``target``. ``nonfinite`` (tasks.accuracy.nonfinite.nonfinite_reference of the search's references):
    the fp32 model itself gives NaN/inf on these samples, so the error says that, not "build at fp32"."""
    if nonfinite:
        from tasks.accuracy.nonfinite import DATA_HOW

        outs = ", ".join(f"{n!r} ({w['count']} of {w['elements']} elements, samples {w['feeds'][:4]})"
                         for n, w in nonfinite.items())
        raise AccuracyError(
            f"fp16 misses the accuracy budget: the fp16 graph gives {_figure(first, z)} ({where}) against {aim}, but "
            f"the fp32 reference itself is not finite on {samples_text}: {outs}; where the fp16 graph is non-finite at "
            f"other places, no precision makes NaN/inf line up", stage=STAGE, file=str(fp32_path),
            fix=f"give calibration.data with real inputs (the search judged {samples_text}); for validation, "
                + DATA_HOW)
    if not set(candidates) - set(chosen_kept):  # every node fp32: an fp32 engine, not an fp16 one
        raise AccuracyError(
            f"fp16 misses the accuracy budget: the fp16 graph gives {_figure(first, z)} ({where}) against {aim}, and "
            f"no set of nodes kept in fp32 that the search tried meets it short of all {len(candidates)} (that is "
            f"an fp32 engine; with all of them fp32: {_figure(final, z)})", stage=STAGE, file=str(fp32_path),
            fix="build this model at precision=fp32, or lower accuracy.min_cosine")
    if final.bound < target:
        raise AccuracyError(
            f"fp16 misses the accuracy budget: the fp16 graph gives {_figure(first, z)} ({where}), and keeping the "
            f"{len(chosen_kept)} nodes that cost the most in fp32 gives {_figure(final, z)} against {aim}; kept: "
            f"{', '.join(sorted(chosen_kept, key=lambda n: -chosen_kept[n])[:6])}",
            stage=STAGE, file=str(fp32_path),
            fix="build this model at precision=fp32, give calibration.data with real inputs (the search judged "
                f"{samples_text}), or lower accuracy.min_cosine")


def searched_segments(convs: dict[int, StageResult], out_dir: Path) -> StageResult:
    """The fp16 search over a model's TensorRT segments (``convs``: segment index -> ``fp16_within_budget``'s or a plain
    conversion's result): its figures under the int8 search's names, combined as int8's are
    (``tasks.search.restore.combined_search_metrics``: the lowest segment's cosine), and one sensitivity report of the segments
    it searched; empty when it searched none."""
    from tasks.report.sensitivity import sensitivity_report
    from tasks.search.restore import combined_search_metrics

    searched = [(i, c) for i, c in convs.items() if "fp16_search" in c.details]
    if not searched:
        return StageResult(files={}, metrics={})
    return StageResult(metrics=combined_search_metrics([c.metrics for _, c in searched]), files=sensitivity_report([
        {"segment": i, "method": "fp16 accuracy search (nodes ranked by error growth)", "precision": "fp16",
         "fallback": list(c.details["fp16_search"]["kept"]), **c.details["fp16_search"]} for i, c in searched], out_dir))
