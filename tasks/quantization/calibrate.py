"""Stage calibrate: an fp32 ONNX graph -> a Q/DQ (int8 or fp8) graph that strongly typed TensorRT(-RTX) builds.

The parts, each in its module: preparing the graph and calibrating its ranges (tasks/quantization/prepare.py: opset
>= 19 for fp16 Q/DQ scales and float8, Constant nodes folded into initializers so ORT's quantizer sees weights as
weights), calibration ranges from histograms (tasks/quantization/ranges.py), the Q/DQ graphs
(tasks/quantization/qdq.py), the accuracy search's steps (tasks/quantization/layer_search.py: scoring candidates in
ONNX Runtime against the fp32 outputs on the search's held-out samples, choosing per-tensor ranges where entropy clips)
over the accuracy-budget search (tasks/search/restore.py). Here: the stage that runs them in order, and the result.

A candidate is judged by the statistic validate gates on, the pooled cosine (``tasks.accuracy.metrics.pooled_estimate``), less
``JUDGE_Z`` standard errors of it over the judged samples: the held-out samples, alone from ``HELD_ALONE`` of them, below
that with up to ``JUDGE_CALIBRATION`` of the calibration samples, whose standard error steadies the figure of a few
held-out ones (tasks.accuracy.budget.calibration_judged). In-sample, the calibration samples flatter it: on PP-OCRv6
det they carry 14% of the chosen graph's error for 8 of 19 judged pages.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from tasks.common.errors import AccuracyError, StageError
from tasks.data.inputs import batch_size
from tasks.onnxrt.ort import ordered_runs, ort_runner, quiet_python_logging, run_workers
from tasks.fp16.hazards import DATA_MAX, fp16_hazards_from_data
from tasks.quantization.layer_search import SearchState, judge_every_layer, search_layers
from tasks.quantization.prepare import (PREPARE_FEEDS, calibrate_ranges, check_arguments, check_layers, onnx_model,
                                        prepare_graph)
from tasks.quantization.qdq import Quantizer
from tasks.quantization.ranges import DEFAULT_METHOD, STAGE, save_ranges
from tasks.search.judging import JUDGE_Z
from tasks.search.restore import combined_search_metrics
from tasks.accuracy.budget import HELD_ALONE, JUDGE_CALIBRATION, calibration_judged
from tasks.common.util import StageResult

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
                  data_max: float = DATA_MAX, metric=None, through=None, random_inputs: bool = False) -> StageResult:
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
    ``metric`` (tasks.accuracy.metric.SearchJudge, default cosine): what judges a candidate and meets ``min_cosine``
    (its target, on the metric's scale); the layers are ranked by cosine whatever the metric. With another metric than
    cosine, ``search_score_worst_feed`` is its value on the written graph and ``search_cosine_worst_feed`` its cosine.
    ``through`` (tasks.partition.segments.Through, for a TensorRT segment of a hybrid model, on the model feeds that
    correspond to ``judge_feeds_of(feeds, eval_feeds)``): every candidate is judged on the model's outputs, the rest of
    the model run on the segment's candidate outputs (a native decoding Loop after a backbone turns a small error into
    another token sequence, which the segment's own outputs do not show); layers are still ranked on the segment's own
    outputs.
    ``random_inputs``: the samples were generated at random (no calibration.data). Non-finite values (NaN/inf) in the
    fp32 reference of the judged samples are found before any judgement and reported (details ``nonfinite``: per
    output the count and the feeds, the node that made them and the inputs that reach it, tasks/accuracy/nonfinite.py);
    the search judges the finite part of the reference (no precision has a value to approach where it is NaN/inf), so
    it never keeps layers out of ``precision`` for them, and its refusals say so.
    """
    precision = str(precision).lower()
    choose = method is None and precision == "int8"
    method = str(method or DEFAULT_METHOD.get(precision, "entropy")).lower()
    check_arguments(method, precision, feeds, high_precision, min_cosine)
    if metric is None:
        from tasks.accuracy.metric import Metric
        metric = Metric().judge()
    judge_feeds, eval_feeds, judged = _judged_set(feeds, eval_feeds, through)
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    t0 = time.perf_counter()

    with contextlib.ExitStack() as stack:
        work = Path(workdir) if workdir is not None else \
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trtforge-calib-")))
        work.mkdir(parents=True, exist_ok=True)
        stack.enter_context(quiet_python_logging())
        workers, threads = run_workers()  # the references a few at a time (tasks.onnxrt.ort.ordered_runs)
        # no arena: it would keep the largest run's activations for the whole stage (GBs at 1024x1024)
        run_fp32 = ort_runner(fp32_path, stage=STAGE, threads=threads, arena=False)
        ref = list(ordered_runs(run_fp32, judge_feeds, workers))
        nonfinite = nonfinite_report(fp32_path, ref, judge_feeds, judged, random_inputs)  # before any judgement
        prepared, prep_info = prepare_graph(fp32_path, work / "fp32_prepared.onnx", eval_feeds[:PREPARE_FEEDS],
                                            ref[:min(len(eval_feeds), PREPARE_FEEDS)], metric, random_inputs)

        t_cal = time.perf_counter()
        cache = work / f"calibration_{method}.json"
        unreached, ranges, reused = calibrate_ranges(prepared, feeds, method, work, on_sample)
        calibration_seconds = time.perf_counter() - t_cal

        t_search = time.perf_counter()
        # the float remainder in fp16, except where the calibration data's values leave fp16's range, would cancel or
        # fall below its normal range: what the fp16 checks keep fp32 at fp16 stays fp32 here
        keep, cancel, tiny = fp16_hazards_from_data(onnx_model(prepared), feeds, data_max, underflow=True) \
            if high_precision == "fp16" else ({}, {}, {})
        tried: list[SearchState] = []

        def searched(keep_nodes: dict[str, float]) -> SearchState:
            q = Quantizer(prepared, ranges, precision, high_precision, keep, cancel, tiny, keep_nodes)
            q.layers = [n for n in q.layers if n not in unreached]
            check_layers(q.layers, unreached, no_layers_ok, fp32_path)
            s = SearchState(fp32_path, precision, method, choose, min_cosine, high_precision, metric, metric.label,
                            metric.name == "cosine", feeds, eval_feeds, judge_feeds, judged, ref, run_fp32, through,
                            prepared, q.layers, q)
            tried.append(s)
            judge_every_layer(s)
            s.chosen, s.cos_chosen = list(s.layers), s.cos_all
            if min_cosine is not None and not s.all_met:
                try:
                    search_layers(s)
                except AccuracyError as e:  # refused: the search's figures and sensitivity rows go with the error
                    e.result = _stage_result(s, {}, reused, prep_info, keep, cancel, unreached, calibration_seconds,
                                             time.perf_counter() - t_search, t0)
                    if nonfinite:  # what the figures were taken on
                        e.message += f" ({nonfinite['note']})"
                        e.result.details["nonfinite"] = nonfinite
                    raise
            return s

        try:
            s = searched({})
            remainder: dict = {}
        except AccuracyError:
            first = tried[-1] if tried else None
            if first is None or first.cos_none is None or first.cos_none.bound >= min_cosine or \
                    high_precision != "fp16" or through is not None:
                raise
            # the fp16 remainder alone misses the target: the fp16 accuracy search keeps what it must fp32, as at fp16
            remainder = _remainder_kept_fp32(first, keep, cancel, tiny, work)
            s = searched(remainder["kept"])
        s.q.write(s.chosen, out_path)
        if workdir is not None:  # the ranges in use, kept beside the graph (a second of JSON on PP-OCRv4 det)
            save_ranges(s.q.ranges, cache)
        search_seconds = time.perf_counter() - t_search
        files = {"onnx": out_path, **({"calibration_cache": cache, "fp32_prepared": prepared} if workdir is not None
                                      else {})}
        r = _stage_result(s, files, reused, prep_info, keep, cancel, unreached, calibration_seconds, search_seconds, t0)
        if nonfinite:
            r.details["nonfinite"] = nonfinite
        r.details["fp32_by_data_underflow"] = tiny  # value -> fp16's relative error below its normal range (fp32)
        if remainder:  # nodes of the float remainder the fp16 search kept fp32 (the remainder alone missed the target)
            r.details["fp16_remainder_search"] = remainder
        return r


def nonfinite_report(fp32_path: Path, refs: list[dict], feeds: list[Feed], judged: str,
                     random_inputs: bool) -> dict | None:
    """The non-finite values of the search's fp32 reference (``refs`` of ``feeds``), found before any judgement:
    {"reference": per output the count and feeds (tasks.accuracy.nonfinite.nonfinite_reference), "origins": the node
    that made them on the first such feed and the inputs that reach it (tasks.onnxrt.origins), "warnings": one per
    output, "note": what the search judged instead, "random_inputs"}; None when every value is finite."""
    from tasks.accuracy.nonfinite import CALIBRATION_DATA_HOW, nonfinite_reference, reference_warnings, search_note
    from tasks.onnxrt.origins import nonfinite_origins

    found = nonfinite_reference(refs)
    if not found:
        return None
    first = min(w["feeds"][0] for w in found.values())
    origins = nonfinite_origins(fp32_path, feeds[first], list(found), stage=STAGE)
    return {"reference": found, "origins": origins, "random_inputs": random_inputs,
            "warnings": reference_warnings(found, feeds, f"the {STAGE} search's samples: {judged}", random_inputs,
                                           origins, CALIBRATION_DATA_HOW,
                                           "the search leaves those elements out (no precision has a value to approach "
                                           "there; validate fails where the build does not line up with them)"),
            "note": search_note(found, judged)}


def _remainder_kept_fp32(s: SearchState, keep: dict, cancel: dict, tiny: dict, work: Path) -> dict:
    """The nodes of the fp32 graph (``s.prepared``) that int8's float remainder keeps fp32, found by the fp16 accuracy
    search (tasks.fp16.search) on the int8 search's judged samples against its target, by its metric: {"kept": {node:
    its error growth}, "cosine_fp16": the remainder as converted, "metrics": the fp16 search's}. An fp16 search that
    cannot meet the target raises its AccuracyError, said of int8's remainder."""
    from tasks.fp16.convert import fp16_from_onnx
    from tasks.fp16.search import fp16_within_budget

    model = onnx_model(s.prepared)
    try:
        r = fp16_within_budget(s.prepared, work / "remainder_fp16.onnx", s.judge_feeds, s.min_cosine,
                               convert=lambda kept: fp16_from_onnx(model, keep, cancel, tiny, kept),
                               metric=s.metric, samples_text=f"samples of the {s.precision} search ({s.judged})")
    except AccuracyError as e:
        raise AccuracyError(f"{s.precision}'s float remainder computes in fp16, and {e.message}", stage=STAGE,
                            file=str(s.fp32_path), fix=e.fix) from e
    search = r.details.get("fp16_search", {})
    return {"kept": dict(search.get("kept", {})), "cosine_fp16": search.get("cosine_fp16"), "metrics": r.metrics}


def _judged_set(feeds: list[Feed], eval_feeds: list[Feed] | None, through) -> tuple[list[Feed], list[Feed], str]:
    """(the feeds that judge the search, the held-out ones, default ``feeds``; the judged set in words)."""
    held_out = bool(eval_feeds)
    judge_feeds = judge_feeds_of(feeds, eval_feeds)
    eval_feeds = list(eval_feeds) if eval_feeds else list(feeds)
    judged = (f"{len(eval_feeds)} held-out and {len(judge_feeds) - len(eval_feeds)} calibration feeds" if held_out else
              f"the {len(eval_feeds)} calibration feeds themselves (none held out)")
    if through is not None:
        if len(through.feeds) != len(judge_feeds):
            raise ValueError(f"through: {len(through.feeds)} model feeds for {len(judge_feeds)} judged segment feeds")
        judged += ", judged on the model's outputs through the rest of the model"
    return judge_feeds, eval_feeds, judged


def _stage_result(s: SearchState, files: dict, reused: bool, prep_info: dict, keep: dict, cancel: dict,
                  unreached: list[str], calibration_seconds: float, search_seconds: float, t0: float) -> StageResult:
    """The stage's result: the layer counts, samples, seconds and figures as metrics, and the details of the search."""
    chosen, cos_chosen, cos_all, pooled, metric = s.chosen, s.cos_chosen, s.cos_all, s.pooled, s.metric
    fallback = [n for n in s.layers if n not in set(chosen)]
    metrics = {"quantized_layers": len(chosen), "fallback_layers": len(fallback),
               "calibration_samples": sum(batch_size(f) for f in s.feeds),
               "search_samples": sum(batch_size(f) for f in s.judge_feeds),
               "calibration_seconds": calibration_seconds, "search_seconds": search_seconds,
               "search_runs": s.search_runs,
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
            "method": s.method,
            # layers whose activation range the search took from another method (percentile/minmax) than method's
            "range_choice": s.range_choice,
            # layers kept in high precision between quantized ones, judged back to save precision boundaries
            "boundary_choice": s.boundary_choice,
            "calibration_reused": reused,
            "precision": s.precision,
            "high_precision": s.high_precision,
            "min_cosine": s.min_cosine,
            "search_feeds": len(s.judge_feeds),
            "search_statistic": f"pooled cosine less {JUDGE_Z:g} standard error (jackknife over the samples)",
            "search_timing": s.timing,  # seconds: ranges chosen by local error, ranking, search, written graph
            "search_set": s.judged,
            "search_judges": "the model's outputs through the rest of the model" if s.through is not None else
                             "this graph's outputs",
            "cosine_measurable": cos_all is not None,
            # the graph without Q/DQ: measured only when the search found no layer to quantize (it refuses the build)
            "cosine_high_precision": s.cos_none.cosine if s.cos_none else None,
            "cosine_note": None if cos_all is not None else f"not measurable with ONNX Runtime CPU: {s.q.run_error}",
            "prepare": prep_info,
            "fp32_by_data_range": keep,  # value -> max |x| on the calibration data (their nodes stay fp32)
            # value -> fp16's estimated error of the cancelling subtraction it feeds (its node stays fp32)
            "fp32_by_cancellation": cancel,
            "sensitivity": s.sensitivity,
            "fallback": fallback,
            # layers no calibration sample reaches (computed from constants alone): left unquantized, not calibrated
            "unreached_by_data": unreached,
            "quantized": list(chosen),
            # a refusal's closest layers, each quantized alone (tasks.quantization.layer_search.closest_layers)
            **({"closest": s.closest} if s.closest else {}),
        },
    )


def judge_feeds_of(feeds: list, eval_feeds: list | None) -> list:
    """The feeds that judge the search, in order: the held-out ones alone from ``HELD_ALONE`` samples, below that with
    up to ``JUDGE_CALIBRATION`` calibration feeds, or the calibration feeds themselves when none are held out (for a
    segment's feeds and the model's alike; tasks.accuracy.budget.calibration_judged)."""
    extra = calibration_judged(len(eval_feeds) if eval_feeds else 0)
    return list(feeds) if extra is None else list(eval_feeds) + list(feeds[:extra])


def qdq_for_segments(segments: list[dict], feeds_for: Callable[[int], list[Feed]],
                     search_feeds_for: Callable[[int], list[Feed]] | None, out_dir: Path, *, method: str | None,
                     precision: str, min_cosine: float | None,
                     progress: Callable[[int], contextlib.AbstractContextManager] | None = None,
                     data_max: float = DATA_MAX, metric=None, rest=None, random_inputs: bool = False) -> StageResult:
    """``qdq_from_onnx`` for each TensorRT segment of a model (``segments``: index, onnx), each on what that segment
    sees of the calibration and search samples; the layer counts summed, each search cosine the lowest segment's
    (absent when no segment measured it), and the sensitivity report of all. A segment without a layer to quantize
    (one of several) is written at the high precision; a model with none at all is refused. ``rest``
    (tasks.partition.segments.Rest on the model feeds ``judge_feeds_of`` picks from the model's calibration and search
    samples): each segment's candidates are judged through the rest of the model, on its outputs (``qdq_from_onnx``)."""
    from tasks.report.sensitivity import sensitivity_report

    files, per_segment, details = {}, [], []
    for s in segments:
        i = s["index"]
        with (progress(i) if progress else contextlib.nullcontext()) as on_sample, \
                _refusal_with_report(details, per_segment, i, out_dir):
            r = qdq_from_onnx(s["onnx"], feeds_for(i), out_dir / f"qdq{i}.onnx", method=method, precision=precision,
                              min_cosine=min_cosine, eval_feeds=search_feeds_for(i) if search_feeds_for else None,
                              workdir=out_dir / f"work{i}", on_sample=on_sample, no_layers_ok=len(segments) > 1,
                              data_max=data_max, metric=metric, through=rest.after(i) if rest is not None else None,
                              random_inputs=random_inputs)
        files[f"qdq{i}"] = r.files["onnx"]
        per_segment.append(r.metrics)
        details.append({"segment": i, **r.details})
    metrics = combined_search_metrics(per_segment)
    if not metrics["quantized_layers"] + metrics["fallback_layers"]:
        raise StageError("no TensorRT segment of the model has a Conv/ConvTranspose/MatMul/Gemm node to quantize",
                         stage=STAGE, fix="keep this model at fp16/fp32")
    files.update(sensitivity_report(details, out_dir))
    return StageResult(files=files, metrics=metrics, details={"segments": details})


@contextlib.contextmanager
def _refusal_with_report(details: list[dict], per_segment: list[dict], index: int, out_dir: Path):
    """A segment's search refused (AccuracyError with the search's result): the error's result becomes the stage's as
    far as it got, with every segment's sensitivity report (sensitivity.json/png) and figures, and ``refused``
    (message, fix, file) in its details, so that the stage can keep the refusal and a failed result shows them."""
    from tasks.report.sensitivity import sensitivity_report

    try:
        yield
    except AccuracyError as e:
        r = getattr(e, "result", None)
        if r is None:
            raise
        details = [*details, {"segment": index, **r.details}]
        e.result = StageResult(files=sensitivity_report(details, out_dir),
                               metrics=combined_search_metrics([*per_segment, r.metrics]),
                               details={"segments": details, "refused": {"message": e.message, "fix": e.fix,
                                                                         "file": e.file}})
        raise


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


def search_fix(search: dict, validate_samples: int, budget_margin: float | None, searched: bool = True) -> str | None:
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
            f"search; below {HELD_ALONE} held out, up to {JUDGE_CALIBRATION} of the rest judge it too) or raise "
            f"calibration.budget_margin (now "
            f"{_margin_words(search, budget_margin)}) so that the search keeps more layers in higher precision")


def _margin_words(search: dict, budget_margin: float | None) -> str:
    """The margin in use: as given, or derived (the search's ``search_margin`` metric)."""
    if budget_margin is not None:
        return f"{budget_margin:g}"
    m = search.get("search_margin")
    return f"unset: {m:.3f} derived from the samples" if m is not None else "unset: derived from the samples"
