"""Calibration ranges: the activation range of every tensor that can get Q/DQ, from histograms of |x| over the
calibration samples.

Ranges are calibrated ONCE (one sample per ``collect_data`` call so that feeds of different shapes merge into one
histogram) and reused for every re-quantization of the accuracy-budget search. Methods:

* ``entropy``: TensorRT's entropy calibration (KL divergence over a 2048-bin histogram of |x|, 128 levels), computed
  here, vectorised, instead of by ORT's pure-Python loop (~90 s for PP-OCRv4 det; with ORT's default 128 bins its
  "entropy" is just min/max);
* ``percentile``: the 99.999th percentile of |x| on the same histogram;
* ``minmax``: amax = max|x| (symmetric).

Histograms start at 0 as TensorRT's do. Ranges of the same (model, feeds, method) are memoised in the process: int8
and fp8 of one model share them.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import math
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tasks.common.errors import StageError, cause
from tasks.common.memory import release_freed_memory
from tasks.onnxrt.ort import ordered_runs, ort_session, quiet_onnxruntime, run_workers, runs_alone
from tasks.quantization.qdq import QUANT_OPS, RESIDUAL_OPS, private_model_path, quantized_activations
from tasks.schema import CALIBRATION_METHODS

STAGE = "calibrate"
METHODS = dict(zip(CALIBRATION_METHODS, ("Entropy", "MinMax", "Percentile")))  # -> ONNX Runtime's CalibrationMethod
DEFAULT_METHOD = {"int8": "entropy", "fp8": "minmax"}  # minmax with symmetric ranges = amax
HIST_BINS = 2048
ENTROPY_QUANT_BINS = 128  # int8 levels of |x| (TensorRT's entropy calibrator)
ENTROPY_CANDIDATES = 512  # thresholds tried per tensor, evenly strided (TensorRT tries all 1920 for 2048 bins)
PERCENTILE = 99.999
RANGES_MEMO_SIZE = 4  # calibrated ranges kept per (model bytes, feeds, method): int8 + fp8 of one model share them


def ranges_from_feeds(model_path: Path, feeds, method: str, work: Path,
                      on_sample: Callable[[int, int], None] | None = None) -> tuple[object, bool]:
    """The calibrated ranges (ORT TensorsData) of ``model_path`` on ``feeds`` with ``method``, and whether they came
    from this process's memo."""
    key = _ranges_key(model_path, feeds, method)
    if key in _RANGES_MEMO:
        return copy.deepcopy(_RANGES_MEMO[key]), True
    ranges = _calibrate(model_path, feeds, method, work, on_sample)
    _RANGES_MEMO[key] = copy.deepcopy(ranges)
    while len(_RANGES_MEMO) > RANGES_MEMO_SIZE:
        _RANGES_MEMO.pop(next(iter(_RANGES_MEMO)))
    return ranges, False


def alternative_ranges(ranges) -> dict[str, object]:
    """The percentile and the max range of the same histograms ({method: TensorsData}), or {} without histograms.
    (An MSE-optimal range of |x| was tried too: locally better on 32 of PP-OCRv4 det's 72 layers, whole-model worse,
    all-int8 cosine 0.96-0.98 -> 0.91-0.95: its clipping is a bias the next layers carry, not noise.)"""
    from onnxruntime.quantization.calibrate import TensorsData

    if not all(getattr(v, "hist", None) is not None for v in ranges.data.values()):
        return {}
    return {m: TensorsData(ranges.calibration_method, {k: f(v) for k, v in ranges.data.items()})
            for m, f in (("percentile", _percentile_range), ("minmax", _max_range_of))}


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
    quiet_onnxruntime()  # the calibrator's own session logs with the default logger
    try:
        with contextlib.redirect_stdout(io.StringIO()), private_model_path(model_path) as private:
            cal = create_calibrator(private, list(QUANT_OPS + RESIDUAL_OPS), augmented_model_path=str(work / "augmented.onnx"),
                                    calibrate_method=cm, extra_options=opts)
            needed = quantized_activations(model_path)
            if cm == CalibrationMethod.Percentile:
                cal.collector = _histogram_collector(cal, needed)
                # the samples in order, run a few at a time while the last one's histograms are counted (ORT's
                # collect_data runs one, then counts)
                samples = _calibration_samples(cal, feeds)
            else:  # ORT's ReduceMin/Max outputs: its own collect_data
                samples = (cal.collect_data(_OneFeed(feed)) for feed in feeds)
            for i, sample in enumerate(samples):
                if sample is not None:
                    cal.collector.collect(sample)
                del sample  # not held while the next feed runs
                if on_sample is not None:
                    on_sample(i + 1, len(feeds))
            if cm == CalibrationMethod.Percentile:  # KL search / percentile only where Q/DQ can go (ORT also
                # records e.g. Add outputs: their max |x| alone)
                hists, of = cal.collector.histogram_dict, _entropy_range if method == "entropy" else _percentile_of
                return TensorsData(CalibrationMethod.Entropy if method == "entropy" else cm,
                                   {k: of(h) if k in needed else _max_range(h) for k, h in hists.items()})
            return cal.compute_data()
    except Exception as e:
        shapes = sorted({str({k: list(v.shape) for k, v in f.items()}) for f in feeds})[:4]
        raise StageError(f"calibration ({method}) failed on feeds {', '.join(shapes)}: {type(e).__name__}: "
                         f"{cause(e)}", stage=STAGE, file=str(model_path),
                         fix="check that the feeds match the model's inputs") from e


def _calibration_samples(cal, feeds) -> Iterator[dict]:
    """Each feed's values for the collector, in order: a few feeds at a time (``run_workers``), one at a time on every
    core, without an arena and with the freed memory given back after each, when the first feed's values hold more than
    LARGE_RUN_BYTES (IS-Net at 1024x1024: 1.8 GiB a feed)."""
    if not feeds:
        return
    workers, threads = run_workers()
    run = _calibration_run(cal, threads)
    sample = run(feeds[0])
    held = sum(np.asarray(v).nbytes for vs in sample.values() for v in vs)
    alone = runs_alone(held)
    if alone:
        workers, threads = run_workers(held)
        run = _calibration_run(cal, threads, arena=False)
    yield sample
    del sample  # not held while the next feeds run
    for sample in ordered_runs(run, feeds[1:], workers):
        yield sample
        del sample
        if alone:
            release_freed_memory()


def _calibration_run(cal, threads: int, arena: bool = True) -> Callable[[dict], dict]:
    """feed -> {tensor: [its values]} of the tensors ``cal`` (ORT's HistogramCalibrater) calibrates, as its
    collect_data gives them to the collector: its augmented model without graph optimizations (as its own session
    runs it), on a session of ``threads`` threads that takes the place of its own."""
    session = cal.infer_session = ort_session(Path(cal.augmented_model_path), optimization="none", threads=threads,
                                              stage=STAGE, arena=arena)
    inputs = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    wanted = set(cal.tensors_to_calibrate)

    def run(feed: dict) -> dict:
        # a graph output that is also a graph input is copied, as collect_data does (onnxruntime issue 21922)
        return {n: [copy.copy(v) if n in inputs else v] for n, v in zip(names, session.run(None, feed)) if n in wanted}
    return run


def _histogram_collector(cal, needed: set[str]):
    """ORT's histogram of |x|, with every histogram starting at 0 as TensorRT's does (2048 bins over [0, amax]), for
    the ``needed`` tensors (those that can get Q/DQ); the others ORT's calibrator records (Add outputs, ...) get only
    their max |x| (one bin over [0, amax]): PP-OCRv4 det needs histograms of 69 of the 243 tensors.

    ORT bins a tensor's first sample over [min|x|, max|x|]: for a nearly constant tensor (|x| within a few float32
    steps of one value, e.g. a bias-like Add input of a Caffe2-era ResNet-50) numpy cannot make 2048 distinct bins
    there and calibration stops ("Too many bins for data range"); and the entropy search assumes bins from 0."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    class AbsHistogram(HistogramCollector):
        def collect(self, name_to_arr):
            tiny = np.finfo(np.float32).tiny * 2 * self.num_bins  # below this |x| is no range at all: all zeros
            for name, arrs in name_to_arr.items():
                for a in (arrs if isinstance(arrs, list) else [arrs]):
                    if name not in needed and a.size:  # max |x| alone, without a copy (NaN/inf: as below)
                        amax = max(float(a.max()), -float(a.min()))
                        if np.isfinite(amax):
                            self._add_max(name, a.size, amax if amax >= tiny else 0.0)
                            continue
                    a = np.abs(np.ravel(a))  # a copy: _add may scale it in place
                    amax = float(a.max()) if a.size else 0.0
                    if not np.isfinite(amax):  # NaN or inf somewhere (a Log of 0, a 1/0 of the fp32 model: no
                        # int8 code holds them, and an infinite range would grow the bins without end): the range of
                        # the finite values
                        a = a[np.isfinite(a)]
                        amax = float(a.max()) if a.size else 0.0
                    if amax < tiny:
                        a, amax = np.zeros(1, np.float32), 0.0
                    if name in needed:
                        self._add(name, a, amax)
                    else:
                        self._add_max(name, a.size, amax)

        def _add_max(self, name: str, count: int, amax: float) -> None:
            old = self.histogram_dict.get(name)
            hist = np.array([count + (int(old[0].sum()) if old is not None else 0)], np.int64)
            top = max(amax, float(old[1][-1]) if old is not None else 0.0)
            lo = min(amax, float(old[2])) if old is not None else amax
            self.histogram_dict[name] = (hist, np.array([0.0, top if top > 0 else 1.0], np.float32),
                                         np.float32(lo), np.float32(max(top, amax)))

        def _add(self, name: str, a: np.ndarray, amax: float) -> None:
            """ORT's histogram update (bins of a fixed width from 0, more bins appended when |x| grows), counted with
            one bincount instead of np.histogram's binary search over explicit edges (~10x faster per tensor)."""
            old = self.histogram_dict.get(name)
            zeros = 0
            if old is not None and old[3] == 0 and amax > 0:  # only zeros so far: start the bins over [0, amax]
                zeros, old = int(old[0].sum()), None
            if old is None:
                edges = np.linspace(0.0, amax if amax > 0 else 1.0, self.num_bins + 1).astype(np.float32)
                hist = np.zeros(self.num_bins, np.int64)
                hist[0] = zeros
                lo = hi = amax
            else:
                hist, edges, lo, hi = old
                if amax > edges[-1]:
                    width = float(edges[1] - edges[0])
                    more = np.arange(float(edges[-1]) + width, amax + width, width, dtype=np.float64)
                    edges = np.concatenate([edges, more.astype(np.float32)])
                    hist = np.concatenate([hist, np.zeros(more.size, np.int64)])
            width = float(edges[1] - edges[0])
            # the bin of each |x| (x / width truncated, the last bin holding what lies beyond it), scaled in place and
            # clipped before the integer cast: two passes over the tensor fewer than computing it in int64
            if a.dtype == np.float32:
                np.divide(a, np.float32(width), out=a)
                np.minimum(a, np.float32(hist.size - 1), out=a)
                idx = a.astype(np.intp)
            else:
                idx = np.minimum((a / width).astype(np.int64, copy=False), hist.size - 1)
                idx = idx[idx >= 0]
            hist = hist + np.bincount(idx, minlength=hist.size)[: hist.size]
            self.histogram_dict[name] = (hist, edges, np.float32(min(lo, amax)), np.float32(max(hi, amax)))

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


def save_ranges(ranges, path: Path) -> None:
    """The ranges as ORT's calibration JSON (``load_tensors_data`` reads it), each tensor's range alone: the
    histograms behind them are not kept (their JSON took a second of PP-OCRv4 det's calibrate)."""
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, save_tensors_data

    save_tensors_data(TensorsData(ranges.calibration_method, {
        k: TensorData(lowest=v.range_value[0], highest=v.range_value[1]) for k, v in ranges.data.items()}), path)


def _xlogx(x: np.ndarray) -> np.ndarray:
    """x log x, 0 where x is 0."""
    return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)


def _percentile_range(td) -> tuple:
    """ORT's symmetric percentile (PERCENTILE of |x|) on a TensorData's histogram, keeping the histogram."""
    return _percentile_of((td.hist, td.bins, None, np.asarray(td.bins)[-1]))


def _max_range_of(td) -> tuple:
    """(-max|x|, max|x|) of a TensorData's histogram of |x| (its last edge), keeping the histogram."""
    edges = np.asarray(td.bins)
    return (-edges[-1:].reshape(()).copy(), edges[-1:].reshape(()).copy(), td.hist, td.bins)


def _percentile_of(hist_entry) -> tuple:
    """ORT's symmetric percentile calibration (PERCENTILE of |x|) on a histogram entry: the edge where the cumulative
    share reaches it, at most the recorded max |x|."""
    hist, edges = np.asarray(hist_entry[0]), np.asarray(hist_entry[1])
    cdf = np.cumsum(hist / max(hist.sum(), 1))
    amax = min(float(edges[min(int(np.searchsorted(cdf, PERCENTILE / 100.0)), edges.size - 1)]), float(hist_entry[3]))
    return (np.array(-amax, dtype=edges.dtype), np.array(amax, dtype=edges.dtype), hist_entry[0], hist_entry[1])


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
    (ENTROPY_CANDIDATES of them, TensorRT tries every bin). The range is symmetric: (-amax, amax).

    Every candidate at once from cumulative sums of the bins (a level's mass and non-empty bins are differences of
    them; sum p log p from a cumulative sum of x log x): KL = sum p log p - sum_levels mass log(mass / used / |Q|),
    0.002 s per tensor instead of 0.02 s for the loop over candidates (tests/tasks/quantization/test_ranges.py checks the two agree)."""
    hist, edges = hist_entry[0], hist_entry[1]
    bins = np.asarray(hist, dtype=np.float64).copy()
    n, nq = bins.size, ENTROPY_QUANT_BINS
    amax = float(edges[-1])
    if n > nq and bins.sum() > 0:
        bins[0] = bins[1]
        cand = np.arange(nq, n + 1, max(1, math.ceil((n - nq) / ENTROPY_CANDIDATES)))
        c = np.concatenate([[0.0], np.cumsum(bins)])  # c[i] = sum(bins[:i])
        nzc = np.concatenate([[0], np.cumsum(bins != 0)])  # non-empty bins before i
        cl = np.concatenate([[0.0], np.cumsum(_xlogx(bins))])
        total = c[-1]
        tail, last = total - c[cand], bins[cand - 1]  # sum(bins[i:]), bin i-1
        b = -((-(np.arange(nq + 1)[None, :] * cand[:, None])) // nq)  # level l of i: bins ceil(l i / nq) .. of l + 1
        mass, used = c[b[:, 1:]] - c[b[:, :-1]], nzc[b[:, 1:]] - nzc[b[:, :-1]]
        plogp = (cl[cand - 1] + _xlogx(last + tail)) / total - np.log(total)
        with np.errstate(divide="ignore", invalid="ignore"):
            logq = np.where(used > 0, np.log(np.where(used > 0, mass / np.maximum(used, 1), 1.0)), 0.0) \
                - np.log(c[cand])[:, None]
            # each bin's own mass on its level's q, the tail on bin i-1's
            plogq = ((mass * logq).sum(axis=1) + tail * logq[np.arange(cand.size), ((cand - 1) * nq) // cand]) / total
        kl = np.where((tail > 0) & (last == 0), np.inf, plogp - plogq)  # p > 0 where q = 0
        valid = np.flatnonzero(c[cand] > 0)  # Q has mass
        if valid.size:
            best = valid[valid.size - 1 - int(np.argmin(kl[valid][::-1]))]  # the largest i on ties (inf ties too)
            amax = float(edges[cand[best]])
    dtype = np.asarray(edges).dtype
    return (np.array(-amax, dtype=dtype), np.array(amax, dtype=dtype), hist, edges)
