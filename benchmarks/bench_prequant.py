"""Models that arrive quantized: what each `model.asymmetric` mode keeps of the model as shipped, PP-OCRv4 det/rec/cls.

Each model is quantized the way a user does it, with ONNX Runtime's `quantize_static` (QDQ; uint8 asymmetric
activations), once with the defaults (MinMax, per-tensor weights) and once well calibrated (Percentile, per-channel
weights), on rendered text pages or crops; scores are min cosines over held-out ones, all in ONNX Runtime (the graph
TensorRT is handed, not an engine). Columns:

- shipped vs fp32: how much the user's own quantization loses;
- ORT kernels vs exact: the shipped model run by ONNX Runtime's own integer kernels (Q/DQ fused into QLinearConv,
  chosen by this CPU's instruction set) vs computed as written in float (what every trtforge figure uses): how far
  this host's integer kernels are from the model's arithmetic (it differs by CPU; no build reports it);
- exact / int8 / float vs shipped: trtforge's converted graph (`trt_from_prequantized`) for each mode; exact is the
  default;
- int8 layers: Conv/MatMul/Gemm layers reading int8 activations and int8 weights in the exact graph.

    .venv/bin/python benchmarks/bench_prequant.py [--models det rec cls] [--calib 16] [--eval 8]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks.accuracy import cosine  # noqa: E402

FILES = {"det": ("ch_PP-OCRv4_det_infer.onnx", 320, 320), "rec": ("ch_PP-OCRv4_rec_infer.onnx", 48, 320),
         "cls": ("ch_ppocr_mobile_v2.0_cls_infer.onnx", 48, 192)}
from tasks.schema import ASYMMETRIC_MODES as MODES  # noqa: E402


def run(model, x: np.ndarray, kernels: bool = False) -> np.ndarray:
    from tasks.onnxrt import ort_session

    data = model if isinstance(model, Path) else model.SerializeToString()
    return ort_session(data, exact=not kernels).run(None, {"x": x})[0]


def measure(which: str, well: bool, n_calib: int, n_eval: int, workdir: Path) -> dict:
    import onnx
    import onnx.version_converter
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    from tasks.sources import sanitize
    from tasks.prequant import trt_from_prequantized
    from tasks.data import preprocess, render_text_image

    name, h, w = FILES[which]
    src = Path(importlib.util.find_spec("rapidocr_onnxruntime").submodule_search_locations[0]) / "models" / name
    recipe = {"channel_order": "RGB", "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
              "layout": "NCHW"}
    if which != "det":
        recipe = {**recipe, "mean": [0.5] * 3, "std": [0.5] * 3}
    rng = np.random.default_rng(0)
    pages = [preprocess([render_text_image(h, w, rng)], recipe) for _ in range(n_calib + n_eval)]

    class Reader:
        it = iter([{"x": p} for p in pages[:n_calib]])

        def get_next(self):
            return next(self.it, None)

    f32, shipped = workdir / f"{which}{well}.f32.onnx", workdir / f"{which}{well}.qdq.onnx"
    m = sanitize(onnx.load(str(src)))[0]
    if well:  # per-channel weights need opset 13
        m = onnx.version_converter.convert_version(m, 13)
    onnx.save(m, str(f32))
    with contextlib.redirect_stdout(io.StringIO()):  # ORT prints its calibration progress
        quantize_static(str(f32), str(shipped), Reader(), quant_format=QuantFormat.QDQ, per_channel=well,
                        calibrate_method=CalibrationMethod.Percentile if well else CalibrationMethod.MinMax)
    held = pages[n_calib:]
    ship = [run(shipped, x) for x in held]
    row = {"model": which, "quantized": "Percentile, per-channel" if well else "defaults (MinMax, per-tensor)",
           "shipped vs fp32": min(cosine(s, run(f32, x)) for s, x in zip(ship, held)),
           "ORT kernels vs exact": min(cosine(s, run(shipped, x, kernels=True)) for s, x in zip(ship, held))}
    for mode in MODES:
        conv, stats = trt_from_prequantized(sanitize(onnx.load(str(shipped)))[0], asymmetric=mode)
        row[f"{mode} vs shipped"] = min(cosine(run(conv, x), s) for s, x in zip(ship, held))
        if mode == "exact":
            row["int8 layers"] = f"{stats['quantized_layers']}/{stats['quantized_layers'] + stats['fallback_layers']}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(FILES), choices=list(FILES))
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--eval", type=int, default=8)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    cols = ["model", "quantized", "shipped vs fp32", "ORT kernels vs exact", *(f"{m} vs shipped" for m in MODES), "int8 layers"]
    print("| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols), flush=True)
    with tempfile.TemporaryDirectory() as d:
        for which in a.models:
            for well in (False, True):
                r = measure(which, well, a.calib, a.eval, Path(d))
                print("| " + " | ".join(f"{r[c]:.4f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
