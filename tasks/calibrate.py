"""Stage calibrate: an fp32 ONNX graph -> a Q/DQ (int8 or fp8) graph that strongly typed TensorRT(-RTX) builds.

The parts, each in its module: calibration ranges from histograms (tasks/ranges.py), the Q/DQ graphs
(tasks/qdq.py), the accuracy-budget search over per-layer scores (tasks/search.py). Here: preparing the graph (opset
>= 19 for fp16 Q/DQ scales and float8, Constant nodes folded into initializers so ORT's quantizer sees weights as
weights), scoring candidates in ONNX Runtime against the fp32 outputs on the search's held-out samples, choosing
per-tensor ranges where entropy clips, and the result.

Scores are the worst single feed's cosine of any output (``tasks.metrics.worst_feed_cosine``): stricter than the
pooled ``cosine_min`` validate gates on, on samples that neither calibrate nor validate.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import AccuracyError, ConfigError, StageError, UnavailableError
from .flops import onnx_flops
from .graph import fold_constants, fp32_from_fp16, opset_of, uniquify_node_names, with_opset
from .inputs import batch_size
from .metrics import worst_feed_cosine
from .ort import ort_runner, quiet_python_logging
from .precision import DATA_MAX, fp16_hazards_from_data
from .qdq import PRECISIONS, QUANT_OPS, Quantizer
from .ranges import DEFAULT_METHOD, METHODS, alternative_ranges, ranges_from_feeds, save_ranges
from .search import budget_search
from .util import StageResult

STAGE = "calibrate"
HIGH_PRECISIONS = ("fp16", "fp32")
MIN_OPSET = 19  # float16 Q/DQ scales (the fp16 remainder) and float8 need opset 19
RETRY_LOSS = 0.05  # a layer losing more than this share of the allowed error alone gets the other ranges tried

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
                  data_max: float = DATA_MAX) -> StageResult:
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
    """
    precision = str(precision).lower()
    choose = method is None and precision == "int8"
    method = str(method or DEFAULT_METHOD.get(precision, "entropy")).lower()
    _check_arguments(method, precision, feeds, high_precision, min_cosine)
    held_out = bool(eval_feeds)
    eval_feeds = list(eval_feeds) if eval_feeds else list(feeds)
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    t0 = time.perf_counter()

    with contextlib.ExitStack() as stack:
        work = Path(workdir) if workdir is not None else \
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trtforge-calib-")))
        work.mkdir(parents=True, exist_ok=True)
        stack.enter_context(quiet_python_logging())

        run_fp32 = ort_runner(fp32_path, stage=STAGE)
        ref = [run_fp32(f) for f in eval_feeds]
        prepared, prep_info = _prepare(fp32_path, work / "fp32_prepared.onnx", eval_feeds, ref)

        t_cal = time.perf_counter()
        cache = work / f"calibration_{method}.json"
        ranges, reused = ranges_from_feeds(prepared, feeds, method, work, on_sample)
        save_ranges(ranges, cache)
        calibration_seconds = time.perf_counter() - t_cal

        t_search = time.perf_counter()
        # the float remainder in fp16, except where the calibration data's values leave fp16's range or would cancel
        keep, cancel = fp16_hazards_from_data(onnx_model(prepared), feeds, data_max) if high_precision == "fp16" else ({}, {})
        q = Quantizer(prepared, ranges, precision, high_precision, keep, cancel)
        layers = q.layers
        if not layers and not no_layers_ok:
            raise StageError(f"the model has no {'/'.join(QUANT_OPS)} node to quantize", stage=STAGE,
                             file=str(fp32_path), fix="keep this model at fp16/fp32")

        def score_with(qz: Quantizer, names: list[str]) -> float | None:
            outs = qz.outputs(names, eval_feeds)
            return None if outs is None else worst_feed_cosine(outs, ref)

        def score(names: list[str]) -> float:
            return score_with(q, names)  # q: the quantizer of the ranges in use

        cos_all = score_with(q, layers)
        chosen, cos_chosen, cos_none, sensitivity, range_choice = list(layers), cos_all, None, [], {}
        if min_cosine is not None and cos_all is None:
            raise UnavailableError(
                f"{precision} Q/DQ graphs cannot be run by ONNX Runtime on this host ({q.run_error}), so the "
                f"accuracy budget min_cosine={min_cosine:.6g} cannot be checked", stage=STAGE, file=str(fp32_path),
                fix="set min_cosine to None to quantize every layer unchecked, use int8, or validate on a GPU")
        if min_cosine is not None and cos_all < min_cosine:
            cos_none = score([])
            if cos_none < min_cosine:
                raise AccuracyError(
                    f"the {high_precision} graph without any Q/DQ already gives cosine {cos_none:.8f}, below "
                    f"min_cosine={min_cosine:.6g}", stage=STAGE, file=str(fp32_path),
                    fix="lower accuracy.min_cosine, or quantize with the rest of the graph in fp32")
            flops = onnx_flops(q.base, {n: list(a.shape) for n, a in eval_feeds[0].items()}, layers)
            alone = {n: score([n]) for n in layers}
            if choose:
                ranges, alone, range_choice = _choose_ranges(q, alone, score_with, cos_none, float(min_cosine))
                if range_choice:
                    q = q.with_ranges(ranges)
                    cos_all = score(layers)
                    save_ranges(q.ranges, cache)
            found = budget_search(layers, score, float(min_cosine), cos_none, alone, flops, q.ops)
            chosen, cos_chosen, sensitivity = found.chosen, found.score, found.ranking
            for row in sensitivity:
                row["range"] = range_choice.get(row["node"], method) if choose else method
            if not chosen:
                best = max(sensitivity, key=lambda s: s["cosine_alone"])
                raise AccuracyError(
                    f"no layer can be quantized to {precision} within the search's target cosine {min_cosine:.6g} "
                    f"(accuracy.min_cosine plus calibration.budget_margin of the allowed error): every "
                    f"{'/'.join(QUANT_OPS)} layer quantized alone breaks it (the least sensitive, {best['node']}, gives "
                    f"{best['cosine_alone']:.6f}; all {len(layers)} together {cos_all:.6f}; worst of "
                    f"{len(eval_feeds)} held-out feeds)", stage=STAGE, file=str(fp32_path),
                    fix="lower accuracy.min_cosine, calibrate on more representative samples, try another "
                        "calibration method, or build this model at fp16")
        q.write(chosen, out_path)
        search_seconds = time.perf_counter() - t_search

        files = {"onnx": out_path}
        if workdir is not None:
            files["calibration_cache"] = cache
            files["fp32_prepared"] = prepared
        fallback = [n for n in layers if n not in set(chosen)]
        metrics = {"quantized_layers": len(chosen), "fallback_layers": len(fallback),
                   "calibration_samples": sum(batch_size(f) for f in feeds), "search_samples": sum(batch_size(f) for f in eval_feeds),
                   "calibration_seconds": calibration_seconds, "search_seconds": search_seconds,
                   "calibrate_seconds": time.perf_counter() - t0}
        if cos_chosen is not None:  # measured (never a stand-in when ONNX Runtime cannot run the graph)
            metrics["search_cosine_worst_feed"] = cos_chosen
        if cos_all is not None:
            metrics["search_cosine_all_quantized"] = cos_all
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
                "search_feeds": len(eval_feeds),
                "search_set": "held-out samples" if held_out else "the calibration samples themselves (none held out)",
                "cosine_measurable": cos_all is not None,
                "cosine_high_precision": cos_none,  # the graph without Q/DQ (measured when the budget searched)
                "cosine_note": None if cos_all is not None else f"not measurable with ONNX Runtime CPU: {q.run_error}",
                "prepare": prep_info,
                "fp32_by_data_range": keep,  # value -> max |x| on the calibration data (their nodes stay fp32)
                # value -> fp16's estimated error of the cancelling subtraction it feeds (its node stays fp32)
                "fp32_by_cancellation": cancel,
                "sensitivity": sensitivity,
                "fallback": fallback,
                "quantized": list(chosen),
            },
        )


def qdq_for_segments(segments: list[dict], feeds_for: Callable[[int], list[Feed]],
                     search_feeds_for: Callable[[int], list[Feed]] | None, out_dir: Path, *, method: str | None,
                     precision: str, min_cosine: float | None,
                     progress: Callable[[int], contextlib.AbstractContextManager] | None = None,
                     data_max: float = DATA_MAX) -> StageResult:
    """``qdq_from_onnx`` for each TensorRT segment of a model (``segments``: index, onnx), each on what that segment
    sees of the calibration and search samples; the layer counts summed, each search cosine the lowest segment's
    (absent when no segment measured it), and the sensitivity report of all. A segment without a layer to quantize
    (one of several) is written at the high precision; a model with none at all is refused."""
    from .report import sensitivity_report

    files, metrics, details = {}, {"quantized_layers": 0, "fallback_layers": 0}, []
    for s in segments:
        i = s["index"]
        with (progress(i) if progress else contextlib.nullcontext()) as on_sample:
            r = qdq_from_onnx(s["onnx"], feeds_for(i), out_dir / f"qdq{i}.onnx", method=method, precision=precision,
                              min_cosine=min_cosine, eval_feeds=search_feeds_for(i) if search_feeds_for else None,
                              workdir=out_dir / f"work{i}", on_sample=on_sample, no_layers_ok=len(segments) > 1,
                              data_max=data_max)
        files[f"qdq{i}"] = r.files["onnx"]
        for k in ("quantized_layers", "fallback_layers"):
            metrics[k] += r.metrics[k]
        for k in ("search_cosine_worst_feed", "search_cosine_all_quantized"):  # absent when not measured
            if k in r.metrics:
                metrics[k] = min(metrics.get(k, 1.0), r.metrics[k])
        metrics.update(calibration_samples=r.metrics["calibration_samples"], search_samples=r.metrics["search_samples"])
        details.append({"segment": i, **r.details})
    if not metrics["quantized_layers"] + metrics["fallback_layers"]:
        raise StageError("no TensorRT segment of the model has a Conv/ConvTranspose/MatMul/Gemm node to quantize",
                         stage=STAGE, fix="keep this model at fp16/fp32")
    files.update(sensitivity_report(details, out_dir))
    return StageResult(files=files, metrics=metrics, details={"segments": details})


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


def _choose_ranges(q: Quantizer, alone: dict[str, float], score_with, cos_none: float, budget: float):
    """Per activation tensor, the range that measurably loses least: for every layer that alone loses more than
    RETRY_LOSS of the budget's allowed error with the entropy range, the percentile and the max range of the same
    histogram are tried for its inputs (that layer alone quantized, as the sensitivity is measured) and the best kept.
    Entropy's KL criterion clips tensors whose rare large values carry the signal (PP-OCRv4 det's first pointwise
    Conv alone: cosine 0.62 with entropy, 0.98 with the 99.999th percentile). Returns the merged ranges, the updated
    cosine-alone of each layer and {layer: method} for the layers that changed."""
    from onnxruntime.quantization.calibrate import TensorsData

    retry = [n for n in q.layers if cos_none - alone[n] > RETRY_LOSS * (1.0 - budget)]
    alts = alternative_ranges(q.ranges) if retry else {}
    if not alts:
        return q.ranges, alone, {}
    quantizers = {m: q.with_ranges(r) for m, r in alts.items()}
    alone, pick = dict(alone), {}
    for n in retry:
        for m, qm in quantizers.items():
            c = score_with(qm, [n])
            if c is not None and c > alone[n]:
                alone[n], pick[n] = c, m
    data, taken = dict(q.ranges.data), set()
    for n in sorted(pick, key=lambda n: alone[n]):  # a tensor read by several layers: the most sensitive one decides
        for t in q.activations(n):
            if t not in taken:
                data[t], _ = alts[pick[n]].data[t], taken.add(t)
    return TensorsData(q.ranges.calibration_method, data), alone, pick
