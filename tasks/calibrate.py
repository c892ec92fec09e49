"""Stage calibrate: an fp32 ONNX graph -> a Q/DQ (int8 or fp8) graph that strongly typed TensorRT(-RTX) builds.

Recipe (measured to build with TensorRT-RTX, see STACK.md "Precision recipes"):
  * opset >= 13 (PP-OCR ships opset 11/12), Constant nodes folded into initializers (otherwise ORT's
    quantizer sees weights as activations and biases as non-initializers);
  * Q/DQ only on the inputs of Conv/MatMul/Gemm, per-channel symmetric weights, symmetric activations,
    bias left in float;
  * ranges are calibrated ONCE (one sample per ``collect_data`` call so that feeds of different shapes
    merge into one histogram) and reused for every re-quantization of the accuracy-budget search;
  * fp8 (E4M3FN) follows the TensorRT/ModelOpt recipe: per-tensor activation scale = amax / 448 with amax
    from the calibrated range of ``method``, per-output-channel weight scale = max|w| / 448, zero points 0.
    ORT's own fp8 path is not used: it only accepts the "distribution" calibrator and sets
    scale = std(x) / std(all fp8 values), which clips (cosine 0.85 on PP-OCRv4 det), and quantizes weights
    channel by channel through the ONNX reference evaluator (~2 s per re-quantization). Instead the graph
    is quantized as int8 (same Q/DQ placement, per-channel axes) and its Q/DQ parameters are rewritten.

Accuracy budget (``min_cosine``): rank layers by the cosine of the output with only that layer quantized
(sensitivity), then keep the longest prefix of the ranking (least sensitive first) that meets the budget
on ``eval_feeds`` -- found by binary search -- followed by a short greedy pass over the next layers.
Leave-one-out ranking is deliberately not used (effects are not additive).

Entropy thresholds are computed here (vectorised, KL divergence over a 2048-bin histogram) instead of by
ORT's pure-Python loop, which takes ~90 s for PP-OCRv4 det; with ORT's default 128 bins its "entropy" is
just min/max.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import math
import tempfile
import time
from typing import Callable
from pathlib import Path

import numpy as np

from .errors import AccuracyError, ConfigError, StageError, UnavailableError
from .util import StageResult

STAGE = "calibrate"
QUANT_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
HIGH_PRECISIONS = ("fp16", "fp32")
METHODS = {"entropy": "Entropy", "minmax": "MinMax", "percentile": "Percentile"}
PRECISIONS = {"int8": "QInt8", "fp8": "QFLOAT8E4M3FN"}
DEFAULT_METHOD = {"int8": "entropy", "fp8": "minmax"}  # minmax with symmetric ranges = amax
FP8_MAX = 448.0  # largest finite float8 E4M3FN value
MIN_OPSET = 19  # float16 Q/DQ scales (the fp16 remainder) and float8 need opset 19
HIST_BINS = 2048
ENTROPY_QUANT_BINS = 128  # int8 levels of |x| (TensorRT's entropy calibrator)
ENTROPY_CANDIDATES = 512  # thresholds tried per tensor, evenly strided (TensorRT tries all 1920 for 2048 bins)
PERCENTILE = 99.999
RANGES_MEMO_SIZE = 4  # calibrated ranges kept per (model bytes, feeds, method): int8 + fp8 of one model share them
GREEDY_TRIES = 6  # layers tried one by one after the binary-searched prefix
RETRY_LOSS = 0.05  # a layer losing more than this share of the allowed error alone gets the other ranges tried
# DedicatedQDQPair: other consumers of a quantized tensor (Add, Resize, ...) keep reading the float tensor
RESIDUAL_OPS = ("Add",)  # a residual Add's skip input gets Q/DQ so TensorRT fuses the Add into the Conv before it
EXTRA_OPTIONS = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False, "DedicatedQDQPair": True,
                 "OpTypesToExcludeOutputQuantization": list(QUANT_OPS + RESIDUAL_OPS)}  # Q/DQ on the op inputs only


# ---------------------------------------------------------------- public API


def qdq_from_onnx(fp32_path: Path, feeds: list[dict[str, np.ndarray]], out_path: Path, *,
                  method: str | None = None,
                  precision: str = "int8",
                  min_cosine: float | None = None,
                  eval_feeds: list[dict[str, np.ndarray]] | None = None,
                  workdir: Path | None = None,
                  on_sample: Callable[[int, int], None] | None = None,
                  high_precision: str = "fp16",
                  no_layers_ok: bool = False) -> StageResult:
    """Quantize ``fp32_path`` to a Q/DQ graph at ``out_path``, within ``min_cosine`` if given.

    ``feeds`` calibrate the ranges (one input dict per sample, shapes may differ); the cosine to the fp32
    model (flattened float64, min over outputs and feeds) is judged on ``eval_feeds`` (default: ``feeds``).
    ``method`` chooses the activation ranges for int8 and fp8 alike (fp8 scale = amax / 448); by default entropy for
    int8 (TensorRT's calibrator) and minmax, i.e. amax = max|x|, for fp8 (its wider range needs no clipping; the
    TensorRT/ModelOpt default).
    ``high_precision``: the type of every op left without Q/DQ (layers the budget keeps out included), as ModelOpt's
    ``high_precision_dtype``: fp16 through tasks/precision.py's converter (which keeps fp32 only where fp16 cannot hold
    the values), or fp32. The budget search judges exactly the graph that is written.
    ``no_layers_ok``: a graph without any layer to quantize (one TensorRT segment of several) is written at
    ``high_precision`` instead of refused.
    """
    precision = str(precision).lower()
    # no method given (int8): entropy, and the budget search may switch a sensitive tensor to the percentile or max
    # range of the same histogram where that measurably loses less (a method the user names is used as is)
    choose_ranges = method is None and precision == "int8"
    method = str(method or DEFAULT_METHOD.get(precision, "entropy")).lower()
    if method not in METHODS:
        raise ConfigError(f"calibration method {method!r} is unknown", stage=STAGE,
                          fix=f"use one of {', '.join(METHODS)}")
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
    eval_feeds = list(eval_feeds) if eval_feeds else list(feeds)
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    t0 = time.perf_counter()

    with contextlib.ExitStack() as stack:
        if workdir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trtforge-calib-")))
        else:
            work = Path(workdir)
            work.mkdir(parents=True, exist_ok=True)
        stack.enter_context(_quiet_ort_python())

        ref = [_run(_session(fp32_path.read_bytes(), fp32_path), f) for f in eval_feeds]
        prepared, prep_info = _prepare(fp32_path, work / "fp32_prepared.onnx", eval_feeds, ref)

        t_cal = time.perf_counter()
        cache = work / f"calibration_{method}.json"
        key = _ranges_key(fp32_path, feeds, method)
        reused = key in _RANGES_MEMO
        if reused:
            ranges = copy.deepcopy(_RANGES_MEMO[key])
        else:
            ranges = _calibrate(prepared, feeds, method, work, on_sample)
            _RANGES_MEMO[key] = copy.deepcopy(ranges)
            while len(_RANGES_MEMO) > RANGES_MEMO_SIZE:
                _RANGES_MEMO.pop(next(iter(_RANGES_MEMO)))
        _save_ranges(ranges, cache)
        calibration_seconds = time.perf_counter() - t_cal

        t_search = time.perf_counter()
        q = _Quantizer(prepared, ranges, precision, high_precision)
        layers = q.layers
        if not layers and not no_layers_ok:
            raise StageError(f"the model has no {'/'.join(QUANT_OPS)} node to quantize", stage=STAGE,
                             file=str(fp32_path), fix="keep this model at fp16/fp32")

        def score(names: list[str]) -> float:
            return q.cosine(names, eval_feeds, ref)  # q: the quantizer of the ranges in use

        cos_all = score(layers)
        measurable = not math.isnan(cos_all)
        sensitivity: list[dict] = []
        chosen, cos_chosen, cos_none = list(layers), cos_all, None
        range_choice: dict[str, str] = {}
        if min_cosine is not None and not measurable:
            raise UnavailableError(
                f"{precision} Q/DQ graphs cannot be run by ONNX Runtime on this host ({q.run_error}), so the "
                f"accuracy budget min_cosine={min_cosine} cannot be checked", stage=STAGE, file=str(fp32_path),
                fix="set min_cosine to None to quantize every layer unchecked, use int8, or validate on a GPU")
        if min_cosine is not None and cos_all < min_cosine:
            cos_none = score([])
            if cos_none < min_cosine:
                raise AccuracyError(
                    f"the {high_precision} graph without any Q/DQ already gives cosine {cos_none:.8f}, below "
                    f"min_cosine={min_cosine}", stage=STAGE, file=str(fp32_path),
                    fix="lower accuracy.min_cosine, or quantize with the rest of the graph in fp32")
            flops = layer_flops(q.base, layers, eval_feeds[0])
            alone = {n: score([n]) for n in layers}
            if choose_ranges:
                ranges, alone, range_choice = _choose_ranges(q, alone, eval_feeds, ref, cos_none, float(min_cosine))
                if range_choice:
                    q = q.with_ranges(ranges)
                    cos_all = score(layers)
                    _save_ranges(ranges, cache)
            chosen, cos_chosen, sensitivity = _budget_search(layers, q.ops, score, float(min_cosine), cos_none, flops,
                                                             alone)
            for row in sensitivity:
                row["range"] = range_choice.get(row["node"], method) if choose_ranges else method
            if not chosen:
                best = max(sensitivity, key=lambda s: s["cosine_alone"])
                raise AccuracyError(
                    f"no layer can be quantized to {precision} within min_cosine={min_cosine}: cosine with every "
                    f"{'/'.join(QUANT_OPS)} layer quantized is {cos_all:.6f}, and even the least sensitive layer "
                    f"alone ({best['node']}) gives {best['cosine_alone']:.6f} (measured on {len(eval_feeds)} "
                    f"eval feeds, {len(layers)} layers tried one at a time)", stage=STAGE, file=str(fp32_path),
                    fix="lower accuracy.min_cosine, calibrate on more representative samples, try another "
                        "calibration method, or build this model at fp16")
        q.write(chosen, out_path)
        search_seconds = time.perf_counter() - t_search

        files = {"onnx": out_path}
        if workdir is not None:
            files["calibration_cache"] = cache
            files["fp32_prepared"] = prepared
        fallback = [n for n in layers if n not in set(chosen)]
        return StageResult(
            files=files,
            metrics={
                "quantized_layers": len(chosen),
                "fallback_layers": len(fallback),
                "calibrate_cosine_min": cos_chosen,  # the same ORT emulation of the written graph validate gates on
                "calibrate_cosine_all": cos_all,
                "calibration_samples": len(feeds),
                "calibration_seconds": calibration_seconds,
                "search_seconds": search_seconds,
                "calibrate_seconds": time.perf_counter() - t0,
            },
            details={
                "method": method,
                # layers whose activation range the search took from another method (percentile/minmax) than method's
                "range_choice": range_choice,
                "calibration_reused": reused,
                "precision": precision,
                "high_precision": high_precision,
                "min_cosine": min_cosine,
                "eval_samples": len(eval_feeds),
                "cosine_measurable": measurable,
                "cosine_high_precision": cos_none,  # the graph without Q/DQ (measured when the budget searched)
                "cosine_note": None if measurable else f"not measurable with ONNX Runtime CPU: {q.run_error}",
                "prepare": prep_info,
                "sensitivity": sensitivity,
                "fallback": fallback,
                "quantized": list(chosen),
            },
        )


# ---------------------------------------------------------------- search


def _budget_search(layers: list[str], ops: dict[str, str], score, budget: float, cos_none: float = 1.0,
                   flops: dict[str, float] | None = None,
                   alone: dict[str, float] | None = None) -> tuple[list[str], float, list[dict]]:
    """Rank the layers, binary-search the longest prefix of the ranking within budget, then a short greedy pass.

    Ranking: accuracy lost with only that layer quantized (``cos_none`` - its cosine; ``cos_none`` is the score with
    no layer quantized, which meets the budget) per FLOP it moves to the quantized type, least first -- the greedy
    answer to "most FLOPs quantized within the budget" when losses roughly add up. Without ``flops``: by loss.
    ``alone``: the cosine of each layer quantized alone, when already measured."""
    alone = alone if alone is not None else {n: score([n]) for n in layers}
    flops = flops or {}

    def loss_per_flop(n: str) -> float:
        return max(cos_none - alone[n], 0.0) / max(flops.get(n, 1.0), 1.0)

    ranked = sorted(layers, key=lambda n: (loss_per_flop(n), -alone[n]))
    sensitivity = [{"node": n, "op": ops.get(n), "cosine_alone": alone[n], "flops": flops.get(n)} for n in ranked]
    cache: dict[int, float] = {0: cos_none, len(ranked): score(ranked)}
    if ranked:
        cache[1] = alone[ranked[0]]

    def prefix(k: int) -> float:
        if k not in cache:
            cache[k] = score(ranked[:k])
        return cache[k]

    lo, hi = 0, len(ranked)  # prefix(lo) meets the budget; prefix(hi) does not
    if prefix(1) >= budget:
        lo = 1
    else:
        hi = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prefix(mid) >= budget:
            lo = mid
        else:
            hi = mid
    chosen, cos = list(ranked[:lo]), prefix(lo)
    if lo:  # ranked[lo] just failed as part of a prefix; try a few of the layers after it one by one
        for n in [n for n in ranked[lo + 1:] if alone[n] >= budget][:GREEDY_TRIES]:
            c = score(chosen + [n])
            if c >= budget:
                chosen.append(n)
                cos = c
    return chosen, (cos if chosen else cos_none), sensitivity


def layer_flops(model, names: list[str], feed: dict[str, np.ndarray]) -> dict[str, float]:
    """Estimated FLOPs of the nodes ``names`` at the shapes of ``feed`` (ONNX shape inference): Conv 2 * out elements
    * Cin/groups * kernel area; ConvTranspose 2 * in elements * Cout/groups * kernel area; MatMul/Gemm 2 * out
    elements * K; anything else its output elements. 0 where shapes cannot be inferred."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for inp in m.graph.input:
        if inp.name in feed:
            for d, v in zip(inp.type.tensor_type.shape.dim, feed[inp.name].shape):
                d.Clear()
                d.dim_value = int(v)
    del m.graph.value_info[:]
    try:
        m = onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:  # noqa: BLE001 - no estimate, the ranking falls back to accuracy alone
        return {}
    g = m.graph
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim]
              for v in (*g.input, *g.value_info, *g.output)}
    weights = {t.name: list(t.dims) for t in g.initializer}
    want, out = set(names), {}
    for n in g.node:
        if n.name not in want:
            continue
        o, i = math.prod(shapes.get(n.output[0], [0])), shapes.get(n.input[0], [0])
        w = weights.get(n.input[1]) if len(n.input) > 1 else None
        if n.op_type == "Conv" and w:
            out[n.name] = 2.0 * o * math.prod(w[1:])
        elif n.op_type == "ConvTranspose" and w:
            out[n.name] = 2.0 * math.prod(i) * math.prod(w[1:])
        elif n.op_type in ("MatMul", "Gemm") and i:
            trans_a = any(a.name == "transA" and a.i for a in n.attribute)
            out[n.name] = 2.0 * o * (i[0] if trans_a else i[-1])
        else:
            out[n.name] = float(o)
    return out


# ---------------------------------------------------------------- model preparation


def _prepare(src: Path, dst: Path, feeds, ref) -> tuple[Path, dict]:
    """opset >= 13, Constants folded into initializers, every node named; checked against the original."""
    import onnx

    from .graph import fold_constants, fp32_from_fp16, uniquify_node_names

    model = onnx.load(str(src))
    info: dict = {"opset_in": _opset(model)}
    if fp32_from_fp16(model):  # calibrated in fp32; the Q/DQ graph's remainder is made fp16 again on the way out
        info["fp16_upcast"] = True
    if info["opset_in"] < MIN_OPSET:
        try:
            from onnx import version_converter

            model = version_converter.convert_version(model, MIN_OPSET)
            info["opset_upgrade"] = "version_converter"
        except Exception as e:  # noqa: BLE001 - fall back to relabelling the default domain
            for o in model.opset_import:
                if o.domain in ("", "ai.onnx"):
                    o.version = MIN_OPSET
            info["opset_upgrade"] = f"relabelled ({type(e).__name__}: {str(e)[:120]})"
    info["opset"] = _opset(model)
    if model.ir_version >= 4:
        info["constants_folded"] = fold_constants(model.graph)
    uniquify_node_names(model.graph)
    onnx.save(model, str(dst))
    sess = _session(dst.read_bytes(), dst)
    cos = min(_cosine(_run(sess, f), r) for f, r in zip(feeds, ref))
    info["cosine_to_input"] = cos
    if cos < 0.99999:
        raise StageError(f"preparing the graph for quantization (opset {info['opset_in']} -> {info['opset']}, "
                         f"constant folding) changed its outputs: cosine {cos:.6f}", stage=STAGE, file=str(src),
                         fix="export the model at opset >= 13")
    return dst, info


def _opset(model) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


# ---------------------------------------------------------------- calibration


class _OneFeed:
    """A CalibrationDataReader that yields one sample, so differently shaped samples are never stacked."""

    def __init__(self, feed: dict[str, np.ndarray]):
        self._left = [feed]

    def get_next(self):
        return self._left.pop() if self._left else None

    def __iter__(self):
        return iter(self.get_next, None)

    def __len__(self):
        return len(self._left)

    def set_range(self, start_index: int, end_index: int):  # pragma: no cover - API completeness
        pass


def _calibrate(model_path: Path, feeds, method: str, work: Path, on_sample=None):
    """Ranges of the inputs of every Conv/MatMul/Gemm (the same for int8 and fp8)."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData, create_calibrator

    if method in ("entropy", "percentile"):  # both on ORT's histogram of |x| (2048 bins, grown as |x| grows)
        cm, opts = CalibrationMethod.Percentile, {"num_bins": HIST_BINS, "percentile": PERCENTILE, "symmetric": True}
    else:
        cm, opts = CalibrationMethod.MinMax, {"symmetric": True}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cal = create_calibrator(model_path, list(QUANT_OPS + RESIDUAL_OPS), augmented_model_path=str(work / "augmented.onnx"),
                                    calibrate_method=cm, extra_options=opts)
            if cm == CalibrationMethod.Percentile:
                cal.collector = _histogram_collector(cal)
            for i, feed in enumerate(feeds):
                cal.collect_data(_OneFeed(feed))
                if on_sample is not None:
                    on_sample(i + 1, len(feeds))
            if method == "entropy":  # KL search only where Q/DQ can go (ORT also records e.g. Add outputs)
                hists, needed = cal.collector.histogram_dict, _quantized_activations(model_path)
                return TensorsData(CalibrationMethod.Entropy, {k: _entropy_range(h) if k in needed else _max_range(h)
                                                              for k, h in hists.items()})
            return cal.compute_data()
    except Exception as e:
        shapes = sorted({str({k: list(v.shape) for k, v in f.items()}) for f in feeds})[:4]
        raise StageError(f"calibration ({method}) failed on feeds {', '.join(shapes)}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:300] if str(e) else ''}", stage=STAGE, file=str(model_path),
                         fix="check that the feeds match the model's inputs") from e


def _histogram_collector(cal):
    """ORT's histogram of |x|, with every histogram starting at 0 as TensorRT's does (2048 bins over [0, amax]).

    ORT bins a tensor's first sample over [min|x|, max|x|]: for a nearly constant tensor (|x| within a few float32
    steps of one value, e.g. a bias-like Add input of a Caffe2-era ResNet-50) numpy cannot make 2048 distinct bins
    there and calibration stops ("Too many bins for data range"); and the entropy search assumes bins from 0."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    class AbsHistogram(HistogramCollector):
        def collect(self, name_to_arr):
            tiny = np.finfo(np.float32).tiny * 2 * self.num_bins  # below this |x| is no range at all: all zeros
            out = {}
            for name, arrs in name_to_arr.items():
                out[name] = []
                for a in (arrs if isinstance(arrs, list) else [arrs]):
                    a = np.ravel(a)
                    if a.size and np.nanmax(np.abs(a)) < tiny:
                        a = np.zeros_like(a)
                    out[name].append(np.append(a, np.zeros(1, a.dtype)))  # one 0: the first bin edge is 0
            return self.collect_absolute_value(out)

    return AbsHistogram(method=cal.method, symmetric=cal.symmetric, num_bins=cal.num_bins,
                        num_quantized_bins=cal.num_quantized_bins, percentile=cal.percentile, scenario=cal.scenario)


_RANGES_MEMO: dict[str, object] = {}


def _ranges_key(model_path: Path, feeds, method: str) -> str:
    """Content hash of the fp32 model, the calibration feeds (names, dtypes, shapes, bytes) and the method."""
    h = hashlib.sha256(Path(model_path).read_bytes())
    h.update(method.encode())
    for feed in feeds:
        for name in sorted(feed):
            a = np.ascontiguousarray(feed[name])
            h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def _save_ranges(ranges, path: Path) -> None:
    from onnxruntime.quantization.calibrate import save_tensors_data

    save_tensors_data(ranges, path)


def _quantized_activations(model_path: Path) -> set[str]:
    """Activations that can get Q/DQ: the float inputs of Conv/ConvTranspose/MatMul/Gemm and residual skip inputs."""
    import onnx

    g = onnx.load(str(model_path), load_external_data=False).graph
    inits = {t.name for t in g.initializer}
    names = {i for n in g.node if n.op_type in QUANT_OPS for i in n.input[:2] if i not in inits}
    by_name = {n.name: n for n in g.node}
    return names | {by_name[a].input[k] for a, k in residual_adds(g).items()}


def _choose_ranges(q: "_Quantizer", alone: dict[str, float], feeds, ref, cos_none: float, budget: float):
    """Per activation tensor, the range that measurably loses least: for every layer that alone loses more than
    RETRY_LOSS of the budget's allowed error with the entropy range, the percentile and the max range of the same
    histogram are tried for its inputs (that layer alone quantized, as the sensitivity is measured) and the best kept.
    Entropy's KL criterion clips tensors whose rare large values carry the signal (PP-OCRv4 det's first pointwise
    Conv alone: cosine 0.62 with entropy, 0.98 with the 99.999th percentile). Returns the merged ranges, the updated
    cosine-alone of each layer and {layer: method} for the layers that changed."""
    from onnxruntime.quantization.calibrate import TensorsData

    retry = [n for n in q.layers if cos_none - alone[n] > RETRY_LOSS * (1.0 - budget)]
    if not retry or not all(getattr(v, "hist", None) is not None for v in q.ranges.data.values()):
        return q.ranges, alone, {}
    alts = {m: TensorsData(q.ranges.calibration_method, {k: f(v) for k, v in q.ranges.data.items()})
            for m, f in (("percentile", _percentile_range), ("minmax", _max_range_of))}
    quantizers = {m: q.with_ranges(r) for m, r in alts.items()}
    alone, pick = dict(alone), {}
    for n in retry:
        for m, qm in quantizers.items():
            c = qm.cosine([n], feeds, ref)
            if c > alone[n]:
                alone[n], pick[n] = c, m
    data, taken = dict(q.ranges.data), set()
    for n in sorted(pick, key=lambda n: alone[n]):  # a tensor read by several layers: the most sensitive one decides
        for t in q.activations(n):
            if t not in taken:
                data[t], _ = alts[pick[n]].data[t], taken.add(t)
    return TensorsData(q.ranges.calibration_method, data), alone, pick


def _percentile_range(td) -> tuple:
    """ORT's symmetric percentile (PERCENTILE of |x|) on a TensorData's histogram, keeping the histogram."""
    hist, edges = np.asarray(td.hist), np.asarray(td.bins)
    cdf = np.cumsum(hist / max(hist.sum(), 1))
    amax = min(float(edges[min(int(np.searchsorted(cdf, PERCENTILE / 100.0)), edges.size - 1)]), float(edges[-1]))
    return (np.array(-amax, dtype=edges.dtype), np.array(amax, dtype=edges.dtype), td.hist, td.bins)


def _max_range_of(td) -> tuple:
    """(-max|x|, max|x|) of a TensorData's histogram of |x| (its last edge), keeping the histogram."""
    edges = np.asarray(td.bins)
    return (-edges[-1:].reshape(()).copy(), edges[-1:].reshape(()).copy(), td.hist, td.bins)


def _max_range(hist_entry) -> tuple:
    """(-max|x|, max|x|) from a histogram entry's recorded min and max."""
    amax = max(abs(float(hist_entry[2])), abs(float(hist_entry[3])))
    dtype = np.asarray(hist_entry[1]).dtype
    return (np.array(-amax, dtype=dtype), np.array(amax, dtype=dtype), hist_entry[0], hist_entry[1])


def _entropy_range(hist_entry) -> tuple:
    """TensorRT's entropy calibration on a histogram of |x|: for each candidate threshold bin i (128 .. all bins),
    P = the first i bins with everything above folded into bin i-1, Q = those bins merged into 128 quantization
    levels and spread back over P's non-empty bins; amax = the edge of the i with the least KL(P || Q) (the largest i
    on ties). As in NVIDIA's reference implementation (pytorch-quantization ``_compute_amax_entropy``) the first bin
    is set to the second's count so exact zeros (ReLU) do not dominate, and thresholds are tried with a stride
    (ENTROPY_CANDIDATES of them, TensorRT tries every bin). The range is symmetric: (-amax, amax)."""
    hist, edges = hist_entry[0], hist_entry[1]
    bins = np.asarray(hist, dtype=np.float64).copy()
    n, nq = bins.size, ENTROPY_QUANT_BINS
    amax = float(edges[-1])
    if n > nq and bins.sum() > 0:
        bins[0] = bins[1]
        tail = np.concatenate([np.cumsum(bins[::-1])[::-1], [0.0]])  # tail[i] = sum(bins[i:])
        best_kl, best_i = math.inf, n
        for i in range(nq, n + 1, max(1, math.ceil((n - nq) / ENTROPY_CANDIDATES))):
            ref = bins[:i]
            p = ref.copy()
            p[-1] += tail[i]
            nz = ref != 0
            level = (np.arange(i) * nq) // i
            mass = np.bincount(level, weights=ref, minlength=nq)
            used = np.bincount(level, weights=nz, minlength=nq)
            q = np.where(nz, mass[level] / np.maximum(used[level], 1), 0.0)
            if p.sum() <= 0 or q.sum() <= 0:
                continue
            p, q = p / p.sum(), q / q.sum()
            m = p > 0
            kl = math.inf if (q[m] == 0).any() else float(np.sum(p[m] * np.log(p[m] / q[m])))
            if kl <= best_kl:
                best_kl, best_i = kl, i
        amax = float(edges[best_i])
    dtype = np.asarray(edges).dtype
    return (np.array(-amax, dtype=dtype), np.array(amax, dtype=dtype), hist, edges)


# ---------------------------------------------------------------- quantization + evaluation


class _Quantizer:
    """Q/DQ graphs of one shape-inferred in-memory copy of the model with fixed ranges (no re-calibration).

    ORT's quantizer runs once, on every layer (~0.4 s for PP-OCRv4 det); the graph for a subset of layers is
    derived from it by pointing the other layers back to their float inputs and dropping the Q/DQ nodes left
    unused -- the same graph as quantizing only that subset (per-tensor activation ranges, dedicated Q/DQ
    pairs per consumer), without re-running the quantizer for every candidate of the budget search.
    """

    def __init__(self, model_path: Path, ranges, precision: str, high_precision: str = "fp16"):
        from onnx import numpy_helper
        from onnxruntime.quantization.quant_utils import QuantType, load_model_with_shape_infer, update_opset_version

        qt = getattr(QuantType, PRECISIONS[precision])
        self.qtype = QuantType.QInt8  # fp8: quantized as int8, then rewritten by _to_fp8
        self.ranges = ranges
        self.precision = precision
        self.high_precision = high_precision
        self.base = update_opset_version(load_model_with_shape_infer(Path(model_path)), qt, qt)  # fp8: opset 19
        self._weights = {t.name: t for t in self.base.graph.initializer}
        self._fp8_weights: dict[tuple[str, int | None], tuple[np.ndarray, np.ndarray]] = {}
        self._amax = {k: _amax(v) for k, v in ranges.data.items()} if precision == "fp8" else {}
        self._np = numpy_helper
        self.residual = residual_adds(self.base.graph)  # Add name -> index of its skip input
        nodes = [n for n in self.base.graph.node if n.op_type in QUANT_OPS or n.name in self.residual]
        self.layers = [n.name for n in nodes]
        self.ops = {n.name: n.op_type for n in nodes}
        self._float_inputs = {n.name: list(n.input) for n in nodes}
        self._full = None
        self.run_error: str | None = None

    def with_ranges(self, ranges) -> "_Quantizer":
        """The quantizer of the same model with other ranges: shares the loaded, shape-inferred model and the weight
        caches (neither depends on ranges); only the all-layers Q/DQ graph is made again, when first needed."""
        import copy

        q = copy.copy(self)
        q.ranges, q._full, q.run_error = ranges, None, None
        q._amax = {k: _amax(v) for k, v in ranges.data.items()} if self.precision == "fp8" else {}
        return q

    def activations(self, name: str) -> list[str]:
        """The calibrated tensors that get Q/DQ when layer ``name`` is quantized (a residual Add: its skip input)."""
        ins = self._float_inputs[name]
        ins = [ins[self.residual[name]]] if name in self.residual else ins
        return [i for i in ins if i in self.ranges.data]

    def model(self, names: list[str]):
        """The graph that ships: the Q/DQ graph of ``names`` with every other op at ``high_precision``."""
        m = self.qdq(names)
        if self.high_precision == "fp16":
            from .precision import fp16_from_onnx

            m, _ = fp16_from_onnx(m)  # it sorts the graph first (ORT's quantizer appends its Q/DQ nodes)
        return m

    def qdq(self, names: list[str]):
        """The Q/DQ graph with exactly the layers ``names`` quantized (derived from the all-layers graph), in fp32."""
        import onnx

        m = onnx.ModelProto()
        if not names:
            m.CopyFrom(self.base)
            return m
        if self._full is None:
            self._full = self.quantize(self.layers)
        m.CopyFrom(self._full)
        keep = set(names)
        restore = {n: self._float_inputs[n] for n in self.layers if n not in keep}
        if restore:
            g = m.graph
            for node in g.node:
                if node.name in restore:
                    del node.input[:]
                    node.input.extend(restore[node.name])
            have = {t.name for t in g.initializer}
            needed = {i for ins in restore.values() for i in ins}
            g.initializer.extend(t for name, t in self._weights.items() if name in needed and name not in have)
            _drop_dead_qdq(g)
            used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
            _keep_only(g.initializer, lambda t: t.name in used or t.name in self._weights)
        return m

    def quantize(self, names: list[str]):
        """ORT's QDQQuantizer on ``names`` (int8; rewritten as fp8 for precision fp8)."""
        import onnx
        from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

        m = onnx.ModelProto()
        m.CopyFrom(self.base)
        qz = QDQQuantizer(m, True, False, self.qtype, self.qtype, self.ranges, list(names), [],
                          list(QUANT_OPS + RESIDUAL_OPS), dict(EXTRA_OPTIONS))
        m = qz.quantize_model()
        if self.precision == "fp8":
            self._to_fp8(m)
        return _float_for_other_consumers(m, self.residual)

    def _fp8_weight(self, name: str, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(float8 weight, float32 scale): per-channel along ``axis`` (per-tensor if None), max|w| / 448."""
        key = (name, axis)
        if key not in self._fp8_weights:
            from ml_dtypes import float8_e4m3fn

            w = self._np.to_array(self._weights[name]).astype(np.float32)
            if axis is None:
                scale = np.array(_fp8_scale(float(np.abs(w).max(initial=0.0))), dtype=np.float32)
                q = (w / scale).astype(float8_e4m3fn)
            else:
                ax = axis % w.ndim
                amax = np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != ax), initial=0.0)
                scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
                shape = [1] * w.ndim
                shape[ax] = -1
                q = (w / scale.reshape(shape)).astype(float8_e4m3fn)
            self._fp8_weights[key] = (q, scale)
        return self._fp8_weights[key]

    def _to_fp8(self, model) -> None:
        """Rewrite an int8 Q/DQ graph (in place) as float8 E4M3FN with amax / 448 scales and zero points 0."""
        from ml_dtypes import float8_e4m3fn
        from onnx import TensorProto

        np_ = self._np
        g = model.graph
        inits = {t.name: i for i, t in enumerate(g.initializer)}
        new: dict[str, np.ndarray] = {}
        for n in g.node:
            if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
                continue
            src, scale_name = n.input[0], n.input[1]
            zp_name = n.input[2] if len(n.input) > 2 else ""
            axis = next((a.i for a in n.attribute if a.name == "axis"), None)
            if n.op_type == "DequantizeLinear" and src in inits:  # weight_quantized -> DQ
                w_name = src[: -len("_quantized")] if src.endswith("_quantized") else None
                if w_name not in self._weights:
                    raise StageError(f"fp8: cannot find the float weight behind quantized initializer {src!r}",
                                     stage=STAGE)
                per_channel = np_.to_array(g.initializer[inits[scale_name]]).ndim > 0
                q, scale = self._fp8_weight(w_name, axis if per_channel else None)
                if per_channel and axis is None:
                    raise StageError(f"fp8: per-channel DequantizeLinear {n.name!r} has no axis", stage=STAGE)
                new[src], new[scale_name] = q, scale
            else:  # activation Q (or its DQ, which shares the scale/zero point initializers)
                if n.op_type == "DequantizeLinear":
                    continue
                if src not in self._amax:
                    raise StageError(f"fp8: no calibrated range for activation {src!r}", stage=STAGE)
                new[scale_name] = np.array(_fp8_scale(self._amax[src]), dtype=np.float32)
            if zp_name:
                new[zp_name] = np.zeros(np.shape(new[scale_name]), dtype=float8_e4m3fn)
        for name, arr in new.items():
            g.initializer[inits[name]].CopyFrom(np_.from_array(arr, name))
        for vi in list(g.value_info) + list(g.output):  # shape inference may have typed Q outputs as int8
            t = vi.type.tensor_type
            if t.elem_type == TensorProto.INT8:
                t.elem_type = TensorProto.FLOAT8E4M3FN
        left = [n.name for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[1] not in new]
        if left:
            raise StageError(f"fp8: Q/DQ nodes {left[:3]} were not rewritten", stage=STAGE)

    def cosine(self, names: list[str], feeds, ref) -> float:
        if self.run_error is not None:
            return math.nan
        data = self.model(names).SerializeToString()
        try:
            sess = _session(data, None, raise_as=None, basic=self.precision == "fp8")
            return min(_cosine(_run(sess, f), r) for f, r in zip(feeds, ref))
        except Exception as e:  # noqa: BLE001 - fp8 Q/DQ may not run on ORT CPU: reported, not hidden
            return self._failed(e)

    def _failed(self, e: Exception) -> float:
        if self.precision == "int8":
            raise StageError(f"ONNX Runtime cannot run the int8 Q/DQ graph: {str(e).splitlines()[0][:300]}",
                             stage=STAGE) from e
        self.run_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return math.nan

    def write(self, names: list[str], path: Path) -> None:
        import onnx

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        onnx.save(self.model(names), str(tmp))
        tmp.replace(path)


def _amax(tensor_data) -> float:
    lo, hi = tensor_data.range_value
    return float(np.abs(np.concatenate([np.ravel(lo), np.ravel(hi)]).astype(np.float64)).max(initial=0.0))


def _fp8_scale(amax: float) -> float:
    """amax / 448; 1 for all-zero (or non-finite) ranges -- any positive scale represents zeros exactly."""
    return amax / FP8_MAX if math.isfinite(amax) and amax > 0 else 1.0


def residual_adds(g) -> dict[str, int]:
    """Adds of a Conv/ConvTranspose output and another activation (a residual connection): Add name -> index of the
    skip input. TensorRT fuses such an Add into the convolution when the skip input is quantized (ModelOpt puts Q/DQ
    there, not on the convolution's own output). Adds whose both or neither inputs come from a convolution, or with a
    constant input, are left alone."""
    producer = {o: n for n in g.node for o in n.output}
    consts = {t.name for t in g.initializer}
    out = {}
    for n in g.node:
        if n.op_type not in RESIDUAL_OPS or len(n.input) != 2 or any(i in consts or i not in producer for i in n.input):
            continue
        conv = [producer[i].op_type in ("Conv", "ConvTranspose") for i in n.input]
        if sum(conv) == 1:
            out[n.name] = conv.index(False)
    return out


def _float_for_other_consumers(model, residual: dict[str, int] | None = None):
    """ORT's quantizer can route a shared activation's other consumers (e.g. Resize) through the DQ even with
    DedicatedQDQPair: point them back to the float tensor so Q/DQ feeds only Conv/MatMul/Gemm inputs and the skip
    input of the residual Adds in ``residual`` (Add name -> skip input index)."""
    residual = residual or {}
    g = model.graph
    q_src = {n.output[0]: n.input[0] for n in g.node if n.op_type == "QuantizeLinear"}
    dq_src = {n.output[0]: q_src[n.input[0]] for n in g.node
              if n.op_type == "DequantizeLinear" and n.input[0] in q_src}
    for n in g.node:
        if n.op_type in QUANT_OPS or n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for i, name in enumerate(n.input):
            if name in dq_src and residual.get(n.name) != i:
                n.input[i] = dq_src[name]
    _positive_scales(g)
    _drop_dead_qdq(g)
    return model


def _drop_dead_qdq(g) -> None:
    """Remove Q/DQ nodes left without consumers (a DQ first, then the Q that fed it)."""
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        if not _keep_only(g.node, lambda n: n.op_type not in ("QuantizeLinear", "DequantizeLinear")
                          or n.output[0] in used):
            return


def _keep_only(items, keep) -> int:
    """Filter a repeated protobuf field in place (one rebuild, not O(n^2) removes); returns how many went."""
    kept = [x for x in items if keep(x)]
    gone = len(items) - len(kept)
    if gone:
        copies = [type(x)() for x in kept]
        for c, x in zip(copies, kept):
            c.CopyFrom(x)
        del items[:]
        items.extend(copies)
    return gone


def _positive_scales(g) -> None:
    """All-zero weight channels (or all-zero activations) get scale 0 from ORT's fp8 path; TensorRT's parser
    rejects non-positive scales. Any positive scale represents zeros exactly, so use 1."""
    from onnx import numpy_helper

    scales = {n.input[1] for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
    for i, t in enumerate(g.initializer):
        if t.name in scales:
            a = numpy_helper.to_array(t)
            if a.dtype.kind == "f" and (a <= 0).any():
                g.initializer[i].CopyFrom(numpy_helper.from_array(np.where(a > 0, a, 1).astype(a.dtype), t.name))


def _session(data: bytes, path: Path | None, raise_as=StageError, basic: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle ORT threads: no busy-waiting
    if basic:  # ORT's full optimisation fuses Q/DQ into QLinearConv, which has no float8 kernel
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    try:
        return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        if raise_as is None:
            raise
        raise raise_as(f"ONNX Runtime cannot load the model: {str(e).splitlines()[0][:300]}", stage=STAGE,
                       file=str(path) if path else None) from e


def _run(sess, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return sess.run(None, feed)


def _cosine(outs: list[np.ndarray], refs: list[np.ndarray]) -> float:
    """Min over outputs of the flattened float64 cosine (two all-zero outputs count as equal)."""
    worst = 1.0
    for a, b in zip(outs, refs):
        a = np.asarray(a, dtype=np.float64).ravel()
        b = np.asarray(b, dtype=np.float64).ravel()
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        if na == 0 and nb == 0:
            c = 1.0
        elif na == 0 or nb == 0 or not np.isfinite(na) or not np.isfinite(nb):
            c = 0.0
        else:
            c = float(a @ b / (na * nb))
        worst = min(worst, c)
    return worst


@contextlib.contextmanager
def _quiet_ort_python():
    """ORT's quantization tools log warnings ("consider pre-processing", bias not an initializer) per call."""
    logger = logging.getLogger()
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)
