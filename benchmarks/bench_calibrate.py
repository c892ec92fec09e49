"""Calibrate stage vs the raw ONNX Runtime quantization call, PP-OCRv4 det, same data and settings.

trtforge's calibrate computes ranges once (entropy: its own vectorised KL search over a 2048-bin histogram) and writes
a Q/DQ graph on Conv/MatMul/Gemm inputs (symmetric, per-channel weights, bias in float). The raw call is
onnxruntime.quantization.quantize_static with the same samples, op types and options on the same prepared graph
(opset 13, constants folded). Rows: every layer quantized (no accuracy search), per method; the budget search is
timed separately (the raw library has no equivalent).

    .venv/bin/python benchmarks/bench_calibrate.py [--samples 8] [--size 640] [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.calibrate import qdq_from_onnx  # noqa: E402
from tasks.export import onnx_from_model  # noqa: E402
from tasks.samples import preprocess, render_text_image  # noqa: E402

DET = "pkg://rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
RECIPE = {"channel_order": "BGR", "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
          "layout": "NCHW"}


class Reader:
    """CalibrationDataReader over the same feeds, one sample per call."""

    def __init__(self, feeds):
        self.feeds = list(feeds)

    def get_next(self):
        return self.feeds.pop(0) if self.feeds else None


def raw_quantize_static(prepared: Path, out: Path, feeds, method: str, bins: int | None) -> float:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    cm = {"entropy": CalibrationMethod.Entropy, "minmax": CalibrationMethod.MinMax,
          "percentile": CalibrationMethod.Percentile}[method]
    extra = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False}
    if bins and method != "minmax":
        extra["CalibNumBins"] = bins
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_static(str(prepared), str(out), Reader(feeds), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["Conv", "MatMul", "Gemm"], per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, calibrate_method=cm,
                        extra_options=extra)
    return time.perf_counter() - t0


def cosine(a: Path, b: Path, feeds) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    sa = ort.InferenceSession(str(a), so, providers=["CPUExecutionProvider"])
    sb = ort.InferenceSession(str(b), so, providers=["CPUExecutionProvider"])
    worst = 1.0
    for f in feeds:
        x, y = sa.run(None, f)[0].ravel().astype(np.float64), sb.run(None, f)[0].ravel().astype(np.float64)
        worst = min(worst, float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))))
    return worst


def main() -> int:
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" warnings
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--size", type=int, default=640)
    ap.add_argument("--quick", action="store_true", help="skip ORT's 2048-bin entropy (about 90 s) and the budget search")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    feeds = [{"x": preprocess([render_text_image(args.size, args.size, rng)], RECIPE)} for _ in range(args.samples)]
    held = [{"x": preprocess([render_text_image(args.size, args.size, rng)], RECIPE)} for _ in range(2)]
    with tempfile.TemporaryDirectory(prefix="trtforge-bench-cal-") as tmp:
        tmp = Path(tmp)
        fp32 = onnx_from_model({"format": "onnx", "source": DET}, [], tmp / "det.onnx").files["onnx"]
        rows = []
        prepared = None
        for method in ("entropy", "minmax", "percentile"):
            t0 = time.perf_counter()
            r = qdq_from_onnx(fp32, feeds, tmp / f"ours_{method}.onnx", method=method, min_cosine=None,
                              eval_feeds=held, workdir=tmp / f"work_{method}")
            ours = time.perf_counter() - t0
            prepared = r.files["fp32_prepared"]
            cal = r.metrics["calibration_seconds"]
            ours_cos = r.metrics["calibrate_cosine_all"]
            raw = raw_quantize_static(prepared, tmp / f"raw_{method}.onnx", feeds, method, None)
            raw_cos = cosine(prepared, tmp / f"raw_{method}.onnx", held)
            rows.append((f"{method}: trtforge qdq_from_onnx vs quantize_static (ORT default bins)", ours, raw, ours_cos, raw_cos))
            if method == "entropy" and not args.quick:
                raw2 = raw_quantize_static(prepared, tmp / "raw_entropy2048.onnx", feeds, method, 2048)
                rows.append(("entropy, 2048 bins on both (the same setting)", ours, raw2, ours_cos,
                             cosine(prepared, tmp / "raw_entropy2048.onnx", held)))
            rows.append(("  of which trtforge calibration (ranges only)", cal, None, None, None))
        search = None
        if not args.quick:
            t0 = time.perf_counter()
            r = qdq_from_onnx(fp32, feeds, tmp / "budget.onnx", method="entropy", min_cosine=0.99, eval_feeds=held,
                              workdir=tmp / "work_budget")
            search = (time.perf_counter() - t0, r.metrics["quantized_layers"], r.metrics["calibrate_cosine_min"])
    print(f"PP-OCRv4 det, {args.samples} text-image samples at 1x3x{args.size}x{args.size}, 2 held-out for cosine, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'what':<70} {'trtforge s':>10} {'raw s':>8} {'ratio':>6} {'cos ours':>9} {'cos raw':>8}")
    for what, ours, raw, c1, c2 in rows:
        cells = [f"{ours:>10.2f}", f"{raw:>8.2f}" if raw else f"{'':>8}", f"{ours / raw:>5.2f}x" if raw else f"{'':>6}",
                 f"{c1:>9.4f}" if c1 is not None else f"{'':>9}", f"{c2:>8.4f}" if c2 is not None else f"{'':>8}"]
        print(f"{what:<70} " + " ".join(cells))
    if search:
        print(f"accuracy budget 0.99 (sensitivity ranking + search, no raw equivalent): {search[0]:.1f} s total, "
              f"{search[1]}/62 layers int8, cosine {search[2]:.4f}")
    print("trtforge's time includes preparing the graph (opset 13, constant folding) and its accuracy check; "
          "ORT's default entropy (128 bins) has one candidate range, i.e. it is min/max.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
