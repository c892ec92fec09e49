"""Stage calibrate: an fp32 ONNX graph -> a Q/DQ (int8 or fp8) graph that strongly typed TensorRT(-RTX) builds.

The parts, each in its module: calibration ranges from histograms (tasks/quantization/ranges.py), the Q/DQ graphs
(tasks/quantization/qdq.py), the accuracy-budget search over per-layer scores (tasks/search/restore.py). Here: preparing the graph (opset
>= 19 for fp16 Q/DQ scales and float8, Constant nodes folded into initializers so ORT's quantizer sees weights as
weights), scoring candidates in ONNX Runtime against the fp32 outputs on the search's held-out samples, choosing
per-tensor ranges where entropy clips, and the result.

A candidate is judged by the statistic validate gates on, the pooled cosine (``tasks.accuracy.metrics.pooled_estimate``), less
``JUDGE_Z`` standard errors of it over the judged samples: the held-out samples and up to ``JUDGE_CALIBRATION`` of the
calibration samples (their ranges came from histograms of all of them: a weak in-sample tie, against the strong one of
a search that picks among candidates on a few samples: PP-OCRv4 det judged on the worst of 8 held-out pages met 0.9925
and validated 0.9899 on 17 others, whose pages spread from 0.95 to 0.996).
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from tasks.common.errors import AccuracyError, ConfigError, StageError, UnavailableError
from tasks.graph.flops import onnx_flops
from tasks.graph.edit import fp32_from_fp16, uniquify_node_names
from tasks.graph.fold import fold_constants
from tasks.graph.load import opset_of, with_opset
from tasks.data.inputs import batch_size
from tasks.accuracy.metrics import worst_feed_cosine
from tasks.onnxrt.ort import ordered_runs, ort_runner, quiet_python_logging, run_workers
from tasks.fp16.hazards import DATA_MAX, fp16_hazards_from_data
from tasks.quantization.qdq import PRECISIONS, QUANT_OPS, Quantizer
from tasks.quantization.ranges import DEFAULT_METHOD, METHODS, alternative_ranges, ranges_from_feeds, save_ranges
from tasks.search.judging import JUDGE_Z, Judged
from tasks.search.restore import combined_search_metrics, restore_search
from tasks.accuracy.budget import JUDGE_CALIBRATION
from tasks.quantization.sensitivity import Switchable, local_errors
from tasks.common.util import StageResult

STAGE = "calibrate"
HIGH_PRECISIONS = ("fp16", "fp32")
MIN_OPSET = 19  # float16 Q/DQ scales (the fp16 remainder) and float8 need opset 19
RANK_FEEDS = 8  # calibration samples the local errors (range choice, report) are measured on
PREPARE_FEEDS = 2  # held-out samples the prepared graph (opset, folded constants) is checked on against the input's
HARM_FEEDS = 1  # calibration samples each layer's restore gain (the search's ranking) is measured on
Feed = dict[str, np.ndarray]


def qdq_from_onnx(fp32_path: Path, feeds: list[Feed], out_path: Path, *,
                  method: str | None = None,
                  precision: str = "int8",
                  min_cosine: float | None = None,
                  eval_feeds: list[Feed] | None = None,
                  workdir: Path | None = None,
                  on_sample: Callable[[int, int], None] | None = None,
                  high_precision: str = "fp16",
                  no_layers_ok: bool = False,
                  data_max: float = DATA_MAX, metric=None, through=None) -> StageResult:
    """Quantize ``fp32_path`` to a Q/DQ graph at ``out_path``, within ``min_cosine`` if given.

    ``feeds`` calibrate the ranges (one input dict per sample, shapes may differ); candidates are scored against the
    fp32 model on ``eval_feeds`` (the search's held-out samples; default: ``feeds``, said in the details).
    ``method`` chooses the activation ranges for int8 and fp8 alike (fp8 scale = amax / 448); by default entropy for
    int8 (TensorRT's calibrator) and minmax, i.e. amax = max|x|, for fp8 (its wider range needs no clipping; the
    TensorRT/ModelOpt default). With no method given (int8), a layer that alone loses much also tries the percentile
    and max range of the same histogram and keeps the one that loses least.
    ``high_precision``: the type of every op left without Q/DQ (layers the budget keeps out included), as ModelOpt's
    ``high_precision_dtype``: fp16 or fp32. The search judges exactly the graph that is written.
    ``no_layers_ok``: a graph without any layer to quantize (one TensorRT segment of several) is written at
    ``high_precision`` instead of refused.
    Metrics ``search_cosine_worst_feed`` (the written graph) and ``search_cosine_all_quantized`` (every layer) are
    absent when ONNX Runtime cannot run the graph (float8 on a CPU build), never a made-up 1.0.
    ``metric`` (tasks/accuracy.SearchJudge, default cosine): what judges a candidate and meets ``min_cosine`` (its
    target, on the metric's scale); the layers are ranked by cosine whatever the metric. With another metric than
    cosine, ``search_score_worst_feed`` is its value on the written graph and ``search_cosine_worst_feed`` its cosine.
    ``through`` (tasks/segments.Through, for a TensorRT segment of a hybrid model, on the model feeds that correspond to
    ``judge_feeds_of(feeds, eval_feeds)``): every candidate is judged on the model's outputs, the rest of the model run
    on the segment's candidate outputs (a native decoding Loop after a backbone turns a small error into another token
    sequence, which the segment's own outputs do not show); layers are still ranked on the segment's own outputs.
    """
    precision = str(precision).lower()
    choose = method is None and precision == "int8"
    method = str(method or DEFAULT_METHOD.get(precision, "entropy")).lower()
    _check_arguments(method, precision, feeds, high_precision, min_cosine)
    if metric is None:
        from tasks.accuracy.metric import Metric
        metric = Metric().judge()
    what = metric.label  # the value the search judges by, in words (messages)
    pooled = metric.name == "cosine"  # cosine: pooled less its standard error; another metric: its worst feed
    held_out = bool(eval_feeds)
    judge_feeds = judge_feeds_of(feeds, eval_feeds)
    eval_feeds = list(eval_feeds) if eval_feeds else list(feeds)
    judged = (f"{len(eval_feeds)} held-out and {len(judge_feeds) - len(eval_feeds)} calibration feeds" if held_out else
              f"the {len(eval_feeds)} calibration feeds themselves (none held out)")
    if through is not None:
        if len(through.feeds) != len(judge_feeds):
            raise ValueError(f"through: {len(through.feeds)} model feeds for {len(judge_feeds)} judged segment feeds")
        judged += ", judged on the model's outputs through the rest of the model"
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    t0 = time.perf_counter()

    with contextlib.ExitStack() as stack:
        work = Path(workdir) if workdir is not None else \
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trtforge-calib-")))
        work.mkdir(parents=True, exist_ok=True)
        stack.enter_context(quiet_python_logging())

        workers, threads = run_workers()  # the references a few at a time (tasks/ort.ordered_runs)
        run_fp32 = ort_runner(fp32_path, stage=STAGE, threads=threads)
        ref = list(ordered_runs(run_fp32, judge_feeds, workers))
        prepared, prep_info = _prepare(fp32_path, work / "fp32_prepared.onnx", eval_feeds[:PREPARE_FEEDS],
                                       ref[:min(len(eval_feeds), PREPARE_FEEDS)])

        t_cal = time.perf_counter()
        cache = work / f"calibration_{method}.json"
        # layers the calibration data never reaches (computed from constants alone: a segment without inputs, after a
        # Loop that runs in ONNX Runtime) have no activation range to learn: left unquantized, said in the details
        unreached, reachable = unreached_layers(onnx_model(prepared))
        if reachable:
            ranges, reused = ranges_from_feeds(prepared, feeds, method, work, on_sample)
        else:  # nothing to calibrate (ONNX Runtime's calibrator collects nothing from a graph without inputs)
            from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData
            ranges, reused = TensorsData(CalibrationMethod.MinMax, {}), False
        calibration_seconds = time.perf_counter() - t_cal

        t_search = time.perf_counter()
        # the float remainder in fp16, except where the calibration data's values leave fp16's range or would cancel
        keep, cancel = fp16_hazards_from_data(onnx_model(prepared), feeds, data_max) if high_precision == "fp16" else ({}, {})
        q = Quantizer(prepared, ranges, precision, high_precision, keep, cancel)
        q.layers = [n for n in q.layers if n not in unreached]
        layers = q.layers
        if not layers and not no_layers_ok:
            raise StageError(f"the model has no {'/'.join(QUANT_OPS)} node to quantize" + (
                f" that the calibration data reaches ({len(unreached)} compute from constants alone)" if unreached
                else ""), stage=STAGE, file=str(fp32_path), fix="keep this model at fp16/fp32")

        judged_refs, judged_inputs = (through.refs, through.feeds) if through is not None else (ref, judge_feeds)

        def score_with(qz: Quantizer, names: list[str]) -> Judged | None:
            outs = qz.outputs(names, judge_feeds)
            if outs is not None and through is not None:
                outs = [through(k, o) for k, o in enumerate(outs)]
            return None if outs is None else Judged.of(outs, judged_refs, judged_inputs, metric, held=len(eval_feeds))

        def score(names: list[str]) -> Judged:
            return score_with(q, names)  # q: the quantizer of the ranges in use

        scorer = None  # the search's session (int8 with a budget): it judges every layer quantized too
        all_met = None  # every layer quantized meets the target (None: not asked)
        if min_cosine is not None and precision == "int8" and layers:
            scorer = Switchable(q, judge_feeds, ref, JUDGE_Z, None if pooled else metric.value, through)
            if choose and pooled:  # only whether it meets, refused after a few feeds when far below: other ranges
                # race it below, and the figure reported is the one of the ranges kept (measured on every feed)
                all_met = scorer.meets(layers, float(min_cosine))
                cos_all = Judged(*scorer.last) if all_met else None
            else:
                cos_all = Judged.of(scorer.outputs(layers), judged_refs, judged_inputs, metric, held=len(eval_feeds))
        else:
            cos_all = score_with(q, layers)
            if min_cosine is not None and cos_all is None:
                raise UnavailableError(
                    f"{precision} Q/DQ graphs cannot be run by ONNX Runtime on this host ({q.run_error}), so the "
                    f"accuracy budget min_cosine={min_cosine:.6g} cannot be checked", stage=STAGE, file=str(fp32_path),
                    fix="set min_cosine to None to quantize every layer unchecked, use int8, or validate on a GPU")
        if all_met is None and min_cosine is not None:
            all_met = cos_all.bound >= min_cosine
        chosen, cos_chosen, cos_none, sensitivity, range_choice = list(layers), cos_all, None, [], {}
        search_runs, timing = 0, {}
        if min_cosine is not None and not all_met:
            flops = onnx_flops(q.base, {n: list(a.shape) for n, a in eval_feeds[0].items()}, layers)
            rank_feeds = list(feeds[:RANK_FEEDS])  # layers are ranked on calibration samples, judged on held-out ones
            local, range_choice = {}, {}
            clock = time.perf_counter()
            # one session: any subset scored by feeding flags
            scorer = scorer or Switchable(q, judge_feeds, ref, JUDGE_Z, None if pooled else metric.value, through)
            goal = float(min_cosine)
            all_bound = cos_all.bound if cos_all is not None else None
            if choose:  # each tensor's range by the error it causes in the layer that reads it (local, cheap)
                q_local, local, picked = _ranges_by_local_error(q, prepared, rank_feeds)
                timing["ranges_chosen"] = time.perf_counter() - clock
                s_local = Switchable(q_local, judge_feeds, ref, JUDGE_Z, None if pooled else metric.value, through)
                c_local = s_local.estimate(layers)[2]
                # kept only where the whole model gains (local error is not always global: layout_cdla all-int8 0.818
                # with entropy, 0.646 with the locally chosen ranges); the own ranges' figure raced against it
                # (refused after a few feeds where it is lower, as on most models)
                own_wins = all_bound >= c_local if all_bound is not None else scorer.meets(layers, c_local)
                if own_wins and cos_all is None:
                    cos_all = Judged(*scorer.last)
                    all_bound = cos_all.bound
                if not own_wins:
                    q, scorer, all_bound, range_choice = q_local, s_local, c_local, picked
                    cos_all = Judged(*s_local.last, worst=None)  # every layer quantized, as the search compares them
            if all_bound >= min_cosine:  # the ranges chosen suffice: every layer int8
                chosen, harm = list(layers), {n: min(e.values()) for n, e in local.items()}
                sensitivity = [{"node": n, "op": q.ops.get(n), "flops": flops.get(n)} for n in layers]
            else:  # restore layers to the high precision, most harmful per FLOP first, judged on held-out samples
                judged_at = {id(f): k for k, f in enumerate(judge_feeds)}  # a judged feed's reference is at hand
                rank_refs = [ref[judged_at[id(f)]] if id(f) in judged_at else run_fp32(f) for f in rank_feeds[:HARM_FEEDS]]
                if not local:  # the method was given: the local errors of its ranges alone
                    errs = local_errors({method: q}, prepared, rank_feeds, worst=True)[method]
                    local = {n: {method: errs.get(n)} for n in layers}
                # ranked by each layer's own output error with its ranges in use (local, from the pass above): one
                # whole-model run per layer and page (its gain restored alone in the all-int8 graph) cost 14 s on
                # PP-OCRv4 det and its boundary was no better (12 of 72 layers; the screen below finds 29)
                harm = {n: local[n].get(range_choice.get(n, method)) or 0.0 for n in layers}
                timing["ranking"] = time.perf_counter() - clock - sum(timing.values())
                met: list[float] = []  # the bound of each candidate met, the last one's margin guides the refinement

                def meets(names: list[str]) -> bool:
                    if len(names) == len(layers):  # every layer quantized: judged above, short of the target
                        return False
                    ok = scorer.meets(names, goal)
                    if ok and scorer.last is not None:
                        met.append(scorer.last[2])
                    return ok

                def screen(base: list[str], candidates: list[str]) -> dict[str, float]:
                    at = min(scorer.cosines(base, rank_feeds[:HARM_FEEDS], rank_refs))
                    return {n: at - min(scorer.cosines([*base, n], rank_feeds[:HARM_FEEDS], rank_refs))
                            for n in candidates}  # the loss of quantizing each alone on top of base, same page

                chosen, _ = restore_search(layers, meets, harm, flops, screen=screen,
                                           slack=lambda: met[-1] - goal if met else None)
                sensitivity = [{"node": n, "op": q.ops.get(n), "flops": flops.get(n)} for n in layers]
            timing["search"] = time.perf_counter() - clock - sum(timing.values())
            # the graph that is written: the scorer's figure of the same layers where it judged them on every feed and
            # the written graph gives its outputs on a feed, else judged on its own session
            cos_chosen = (_judged_as_written(q, chosen, scorer, judge_feeds, len(eval_feeds)) or score(chosen)) \
                if chosen else None
            # should the two differ (an fp32 keep the converter decides otherwise in the switchable graph), give back
            # the most harmful chosen layers, 1, 2, 4, ... of them, until the written graph meets the target or nothing
            # is quantized
            give_back, k = sorted(chosen, key=lambda n: -(harm.get(n) or 0.0)), 1
            while chosen and cos_chosen.bound < min_cosine:
                chosen = [n for n in chosen if n not in set(give_back[:k])]
                cos_chosen = score(chosen) if chosen else None
                k *= 2
            search_runs = scorer.runs
            timing["written_graph"] = time.perf_counter() - clock - sum(timing.values())
            for row in sensitivity:
                row["local_errors"] = local.get(row["node"])  # per range method: the layer's own output error
                row["local_error"] = (local[row["node"]][range_choice.get(row["node"], method)]
                                      if row["node"] in local else None)
                row["quantized"] = row["node"] in set(chosen)
                row["range"] = range_choice.get(row["node"], method) if choose else method
            if not chosen:  # the graph without any Q/DQ, measured here only (the search takes it to meet)
                cos_none = Judged.of(scorer.outputs([]), judged_refs, judged_inputs, metric, held=len(eval_feeds))
                if cos_none.bound < min_cosine:
                    raise AccuracyError(
                        f"the {high_precision} graph without any Q/DQ already gives {what} {cos_none.cosine:.8f}"
                        f"{cos_none.less_se}, below the search's target {min_cosine:.6g} "
                        f"(accuracy.metric={metric.name}; {judged})", stage=STAGE, file=str(fp32_path),
                        fix=f"relax accuracy.metric={metric.name}'s threshold, or quantize with the rest of the graph "
                            "in fp32")
                raise AccuracyError(
                    f"no layer can be quantized to {precision} within the search's target {what} {min_cosine:.6g} "
                    f"(accuracy.metric={metric.name} and calibration.budget_margin): all {len(layers)} "
                    f"{'/'.join(QUANT_OPS)} layers together give {cos_all.cosine:.6f}{cos_all.less_se}, and no part of "
                    f"them that the search tried meets it ({'pooled' if pooled else 'worst feed'} over {judged}"
                    f"{f', less {JUDGE_Z:g} standard error' if pooled else ''})", stage=STAGE, file=str(fp32_path),
                    fix=f"relax accuracy.metric={metric.name}'s threshold, calibrate on more representative samples, try another "
                        "calibration method, or build this model at fp16")
        q.write(chosen, out_path)
        if workdir is not None:  # the ranges in use, kept beside the graph (a second of JSON on PP-OCRv4 det)
            save_ranges(q.ranges, cache)
        search_seconds = time.perf_counter() - t_search

        files = {"onnx": out_path}
        if workdir is not None:
            files["calibration_cache"] = cache
            files["fp32_prepared"] = prepared
        fallback = [n for n in layers if n not in set(chosen)]
        metrics = {"quantized_layers": len(chosen), "fallback_layers": len(fallback),
                   "calibration_samples": sum(batch_size(f) for f in feeds),
                   "search_samples": sum(batch_size(f) for f in judge_feeds),
                   "calibration_seconds": calibration_seconds, "search_seconds": search_seconds,
                   "search_runs": search_runs,
                   "calibrate_seconds": time.perf_counter() - t0}
        if cos_chosen is not None and not pooled:  # the user's metric, and the cosine beside it
            metrics.update(search_metric=metric.name, search_score_worst_feed=cos_chosen.bound,
                           search_cosine_worst_feed=cos_chosen.worst)
        elif cos_chosen is not None:  # measured (never a stand-in when ONNX Runtime cannot run the graph)
            metrics.update(search_cosine=cos_chosen.cosine, search_cosine_se=cos_chosen.se,
                           search_cosine_bound=cos_chosen.bound)
            if cos_chosen.worst is not None:
                metrics["search_cosine_worst_feed"] = cos_chosen.worst
        if cos_all is not None:
            metrics["search_cosine_all_quantized" if pooled else "search_score_all_quantized"] = cos_all.cosine
        return StageResult(
            files=files, metrics=metrics,
            details={
                "method": method,
                # layers whose activation range the search took from another method (percentile/minmax) than method's
                "range_choice": range_choice,
                "calibration_reused": reused,
                "precision": precision,
                "high_precision": high_precision,
                "min_cosine": min_cosine,
                "search_feeds": len(judge_feeds),
                "search_statistic": f"pooled cosine less {JUDGE_Z:g} standard error (jackknife over the samples)",
                "search_timing": timing,  # seconds: ranges chosen by local error, ranking, search, written graph
                "search_set": judged,
                "search_judges": "the model's outputs through the rest of the model" if through is not None else
                                 "this graph's outputs",
                "cosine_measurable": cos_all is not None,
                # the graph without Q/DQ: measured only when the search found no layer to quantize (it refuses the build)
                "cosine_high_precision": cos_none.cosine if cos_none else None,
                "cosine_note": None if cos_all is not None else f"not measurable with ONNX Runtime CPU: {q.run_error}",
                "prepare": prep_info,
                "fp32_by_data_range": keep,  # value -> max |x| on the calibration data (their nodes stay fp32)
                # value -> fp16's estimated error of the cancelling subtraction it feeds (its node stays fp32)
                "fp32_by_cancellation": cancel,
                "sensitivity": sensitivity,
                "fallback": fallback,
                # layers no calibration sample reaches (computed from constants alone): left unquantized, not calibrated
                "unreached_by_data": unreached,
                "quantized": list(chosen),
            },
        )


WRITTEN_RTOL = 1e-5  # of an output's largest |value|: the written graph and the scorer's switchable graph agree


def _judged_as_written(q: Quantizer, chosen: list[str], scorer: Switchable, feeds: list[Feed],
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
        ref = np.asarray(switched.get(name))
        if ref.shape != np.shape(w) or np.abs(ref - w).max(initial=0.0) > WRITTEN_RTOL * np.abs(ref).max(initial=0.0):
            return None
    (cos, se, bound), per_feed = known
    return Judged(cos, se, bound, worst=min((per_feed[k] for k in range(held)), default=None))


def judge_feeds_of(feeds: list, eval_feeds: list | None) -> list:
    """The feeds that judge the search, in order: the held-out ones and up to ``JUDGE_CALIBRATION`` calibration feeds,
    or the calibration feeds themselves when none are held out (for a segment's feeds and the model's alike)."""
    return list(eval_feeds) + list(feeds[:JUDGE_CALIBRATION]) if eval_feeds else list(feeds)


def qdq_for_segments(segments: list[dict], feeds_for: Callable[[int], list[Feed]],
                     search_feeds_for: Callable[[int], list[Feed]] | None, out_dir: Path, *, method: str | None,
                     precision: str, min_cosine: float | None,
                     progress: Callable[[int], contextlib.AbstractContextManager] | None = None,
                     data_max: float = DATA_MAX, metric=None, rest=None) -> StageResult:
    """``qdq_from_onnx`` for each TensorRT segment of a model (``segments``: index, onnx), each on what that segment
    sees of the calibration and search samples; the layer counts summed, each search cosine the lowest segment's
    (absent when no segment measured it), and the sensitivity report of all. A segment without a layer to quantize
    (one of several) is written at the high precision; a model with none at all is refused. ``rest``
    (tasks/segments.Rest on the model feeds ``judge_feeds_of`` picks from the model's calibration and search samples):
    each segment's candidates are judged through the rest of the model, on its outputs (``qdq_from_onnx``)."""
    from tasks.report.sensitivity import sensitivity_report

    files, per_segment, details = {}, [], []
    for s in segments:
        i = s["index"]
        with (progress(i) if progress else contextlib.nullcontext()) as on_sample:
            r = qdq_from_onnx(s["onnx"], feeds_for(i), out_dir / f"qdq{i}.onnx", method=method, precision=precision,
                              min_cosine=min_cosine, eval_feeds=search_feeds_for(i) if search_feeds_for else None,
                              workdir=out_dir / f"work{i}", on_sample=on_sample, no_layers_ok=len(segments) > 1,
                              data_max=data_max, metric=metric, through=rest.after(i) if rest is not None else None)
        files[f"qdq{i}"] = r.files["onnx"]
        per_segment.append(r.metrics)
        details.append({"segment": i, **r.details})
    metrics = combined_search_metrics(per_segment)
    if not metrics["quantized_layers"] + metrics["fallback_layers"]:
        raise StageError("no TensorRT segment of the model has a Conv/ConvTranspose/MatMul/Gemm node to quantize",
                         stage=STAGE, fix="keep this model at fp16/fp32")
    files.update(sensitivity_report(details, out_dir))
    return StageResult(files=files, metrics=metrics, details={"segments": details})


LOW_SHARE = 0.5  # below this share of layer FLOPs quantized, int8 is unlikely to beat fp16 (reformats between them)


def low_share_warning(segments: list[dict], precision: str) -> str | None:
    """A warning when the search kept most of the layer FLOPs out of ``precision``, naming the layers that hold it back
    (the most FLOPs kept in high precision, with each one's own output error); None otherwise."""
    from tasks.report.sensitivity import held_back

    held = held_back(segments)
    if held is None or held[0] >= LOW_SHARE:
        return None
    share, kept = held
    names = ", ".join(f"{r['node']} ({r['flops_share']:.0%} of FLOPs"
                      + (f", its own output error alone {r['local_error']:.2g}" if r["local_error"] is not None
                         else "") + ")" for r in kept)
    return (f"only {share:.0%} of the Conv/MatMul/Gemm FLOPs are {precision} within the accuracy budget (the rest "
            f"fp16): {precision} will likely not run faster than fp16 here. Held back most: {names}; sensitivity.png in "
            f"the report ranks every layer")


def search_fix(search: dict, validate_samples: int, budget_margin: float, searched: bool = True) -> str | None:
    """How to fix an int8/fp8 build whose validation misses the budget that its accuracy search met: the search's
    figure and samples against validation's, and the two remedies. Without the search (``searched`` false:
    calibration.search=false, every layer quantized): what every layer quantized gave, and the search as the remedy.
    None when no figure was measured."""
    if "search_cosine" not in search:
        return None
    if not searched:
        return (f"calibration.search=false quantizes every layer: pooled cosine {search['search_cosine']:.6f} on "
                f"{search.get('search_samples')} samples; set calibration.search=true so that the accuracy search keeps "
                f"the layers it must in higher precision, or build at fp16")
    return (f"the accuracy search met its target with pooled cosine {search['search_cosine']:.6f} (less "
            f"{JUDGE_Z:g} standard error: {search['search_cosine_bound']:.6f}) on {search.get('search_samples')} "
            f"samples, validation measured {validate_samples} other samples: the search's samples did not represent "
            f"them. Give more calibration samples (calibration.data: a quarter of them, up to 8, are held out for the "
            f"search, and up to {JUDGE_CALIBRATION} of the rest judge it too) or raise calibration.budget_margin (now "
            f"{budget_margin:g}) so that the search keeps more layers in higher precision")


def _check_arguments(method: str, precision: str, feeds: list, high_precision: str, min_cosine: float | None) -> None:
    if method not in METHODS:
        raise ConfigError(f"calibration method {method!r} is unknown", stage=STAGE, fix=f"use one of {', '.join(METHODS)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"quantized precision {precision!r} is unknown", stage=STAGE,
                          fix=f"use one of {', '.join(PRECISIONS)} (fp16/fp32 need no calibration)")
    if not feeds:
        raise ConfigError("no calibration samples", stage=STAGE, fix="give at least one input feed to calibrate on")
    if high_precision not in HIGH_PRECISIONS:
        raise ConfigError(f"high precision {high_precision!r} is unknown", stage=STAGE,
                          fix=f"use one of {', '.join(HIGH_PRECISIONS)}")
    if min_cosine is not None and not 0.0 < float(min_cosine) <= 1.0:
        raise ConfigError(f"min_cosine={min_cosine} is outside (0, 1]", stage=STAGE, fix="use e.g. 0.99, or None")


def unreached_layers(model) -> tuple[list[str], bool]:
    """(the layers, Conv/ConvTranspose/MatMul/Gemm nodes and residual Adds, none of whose inputs depends on a graph
    input, whether any layer is reached). The calibration data never reaches such a layer: its values come from
    constants alone (a TensorRT segment without inputs, e.g. loop bookkeeping after a Loop that runs in ONNX Runtime),
    so there is no activation range to learn (and ONNX Runtime's calibrator collects nothing from a graph without
    inputs: "No data is collected"). A node with subgraphs (If, Loop, Scan) is reached when any input or any value its
    bodies read from the outer graph is."""
    from tasks.quantization.qdq import residual_adds

    g = model.graph
    reached = {i.name for i in g.input} - {t.name for t in g.initializer}

    def outer_reads(graph) -> set[str]:
        out = set()
        for n in graph.node:
            out.update(x for x in n.input if x)
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    out |= outer_reads(sub)
        return out

    for n in g.node:  # topological order
        reads = set(x for x in n.input if x)
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                reads |= outer_reads(sub)
        if reads & reached:
            reached.update(o for o in n.output if o)
    residual = residual_adds(g)
    layers = [n for n in g.node if n.op_type in QUANT_OPS or n.name in residual]
    unreached = [n.name for n in layers if not any(x in reached for x in n.input if x)]
    return unreached, len(unreached) < len(layers)


def onnx_model(path: Path):
    import onnx

    return onnx.load(str(path))


def _prepare(src: Path, dst: Path, feeds: list[Feed], ref: list[dict]) -> tuple[Path, dict]:
    """opset >= MIN_OPSET, Constants folded into initializers, every node named; checked against the original."""
    import onnx

    model = onnx.load(str(src))
    info: dict = {"opset_in": opset_of(model)}
    if fp32_from_fp16(model):  # calibrated in fp32; the Q/DQ graph's remainder is made fp16 again on the way out
        info["fp16_upcast"] = True
    if info["opset_in"] < MIN_OPSET:
        model, info["opset_upgrade"] = with_opset(model, MIN_OPSET)
    info["opset"] = opset_of(model)
    if model.ir_version >= 4:
        info["constants_folded"] = fold_constants(model.graph)
    uniquify_node_names(model.graph)
    onnx.save(model, str(dst))
    run = ort_runner(dst, stage=STAGE)
    cos = worst_feed_cosine([run(f) for f in feeds], ref)
    info["cosine_to_input"] = cos
    if cos < 0.99999:
        raise StageError(f"preparing the graph for quantization (opset {info['opset_in']} -> {info['opset']}, "
                         f"constant folding) changed its outputs: cosine {cos:.6f}", stage=STAGE, file=str(src),
                         fix="export the model at opset >= 13")
    return dst, info


def _ranges_by_local_error(q: Quantizer, prepared: Path, feeds: list[Feed]):
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
