"""qdq_from_onnx on the real PP-OCRv4 det model (text-page calibration, ORT judging, real TensorRT-RTX
builds for sm_86/sm_89 on this CPU host) and on a tiny Conv graph built in code."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest

from tasks.calibrate import qdq_from_onnx
from tasks.errors import AccuracyError, ConfigError
from tasks.samples import preprocess, render_text_image
from tests.conftest import make_conv_model

RECIPE = {"channel_order": "BGR", "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
          "layout": "NCHW"}


def _det_path() -> Path:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")  # without importing it (that pulls cv2)
    if spec is None:
        pytest.skip("rapidocr_onnxruntime is not installed")
    return Path(spec.submodule_search_locations[0]) / "models" / "ch_PP-OCRv4_det_infer.onnx"


def _text_feeds(shapes: list[tuple[int, int]], seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": preprocess([render_text_image(h, w, rng)], RECIPE)} for h, w in shapes]


@pytest.fixture(scope="module")
def det_data():
    calib = _text_feeds([(320, 320)] * 8 + [(256, 384)] * 2, seed=0)
    evals = _text_feeds([(320, 320)] * 3, seed=1)
    return _det_path(), calib, evals


@pytest.fixture(scope="module")
def det_all(det_data, tmp_path_factory):
    path, calib, evals = det_data
    d = tmp_path_factory.mktemp("det_all")
    return qdq_from_onnx(path, calib, d / "det_int8.onnx", method="entropy", eval_feeds=evals, workdir=d / "work")


@pytest.fixture(scope="module")
def det_budget(det_data, tmp_path_factory):
    path, calib, evals = det_data
    d = tmp_path_factory.mktemp("det_budget")
    return qdq_from_onnx(path, calib, d / "det_int8_099.onnx", method="entropy", min_cosine=0.99, eval_feeds=evals)


def _build(path: Path, sm: str) -> int:
    import tensorrt_rtx_bindings as trt

    logger = trt.Logger(trt.Logger.ERROR)
    b = trt.Builder(logger)
    net = b.create_network(0)  # strongly typed by default
    p = trt.OnnxParser(net, logger)
    assert p.parse_from_file(str(path)), [p.get_error(i).desc() for i in range(p.num_errors)]
    cfg = b.create_builder_config()
    cfg.num_compute_capabilities = 1
    cfg.set_compute_capability(getattr(trt.ComputeCapability, sm), 0)
    prof = b.create_optimization_profile()
    prof.set_shape("x", (1, 3, 32, 32), (1, 3, 320, 320), (2, 3, 640, 640))
    cfg.add_optimization_profile(prof)
    engine = b.build_serialized_network(net, cfg)
    assert engine is not None and engine.nbytes > 0
    return engine.nbytes


def _qdq_counts(path: Path) -> tuple[int, set[str]]:
    """(QuantizeLinear count, op types consuming a DequantizeLinear output)."""
    g = onnx.load(str(path)).graph
    dq_out = {o for n in g.node if n.op_type == "DequantizeLinear" for o in n.output}
    consumers = {n.op_type for n in g.node if any(i in dq_out for i in n.input)}
    return sum(n.op_type == "QuantizeLinear" for n in g.node), consumers


# ---------------------------------------------------------------- PP-OCRv4 det


def test_det_all_layers_int8(det_all):
    r = det_all
    m = r.metrics
    assert m["quantized_layers"] == 62 and m["fallback_layers"] == 0
    assert m["calibration_samples"] == 10
    assert m["calibrate_cosine_min"] >= 0.95, m  # text pages; ~0.95 at 320x320 (STACK: ~0.97 full size)
    assert r.details["prepare"]["opset"] >= 13 and r.details["prepare"]["opset_in"] == 12
    n_q, consumers = _qdq_counts(r.files["onnx"])
    assert n_q > 0 and consumers <= {"Conv", "MatMul", "Gemm"}, consumers  # Q/DQ only feeds those
    assert r.files["calibration_cache"].is_file()


def test_det_budget_keeps_most_layers_int8(det_budget):
    r = det_budget
    m = r.metrics
    assert m["calibrate_cosine_min"] >= 0.99, m
    assert m["calibrate_cosine_all"] < 0.99  # the budget actually made it search
    assert m["quantized_layers"] + m["fallback_layers"] == 62
    assert m["quantized_layers"] >= 31, m
    sens = r.details["sensitivity"]
    assert len(sens) == 62 and all(s["op"] == "Conv" for s in sens)
    assert sorted(r.details["quantized"] + r.details["fallback"]) == sorted(s["node"] for s in sens)
    assert [s["cosine_alone"] for s in sens] == sorted((s["cosine_alone"] for s in sens), reverse=True)
    g = onnx.load(str(r.files["onnx"])).graph
    fallback = set(r.details["fallback"])
    dq_out = {o for n in g.node if n.op_type == "DequantizeLinear" for o in n.output}
    for n in g.node:  # fallback convs get no Q/DQ inputs, quantized ones do
        if n.name in fallback:
            assert not any(i in dq_out for i in n.input), n.name
        elif n.op_type == "Conv":
            assert n.input[1] in dq_out, n.name


def test_det_int8_graphs_build_for_sm86(det_all, det_budget):
    assert _build(det_all.files["onnx"], "SM86") > 1_000_000
    assert _build(det_budget.files["onnx"], "SM86") > 1_000_000


def test_det_fp8_builds_for_sm89(det_data, tmp_path):
    """ORT can run fp8 Q/DQ on CPU (basic graph optimisations); its fp8 ranges ('distribution') are poor."""
    path, calib, evals = det_data
    r = qdq_from_onnx(path, calib[:4], tmp_path / "det_fp8.onnx", precision="fp8", eval_feeds=evals[:1])
    assert r.details["method"] == "distribution"
    assert r.details["cosine_measurable"] and 0.0 < r.metrics["calibrate_cosine_min"] <= 1.0
    assert _build(r.files["onnx"], "SM89") > 1_000_000


# ---------------------------------------------------------------- tiny graph


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_calib")
    path = make_conv_model(d / "tiny.onnx", opset=13)
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((1, 3, h, w)).astype(np.float32)} for h, w in ((16, 16), (8, 24), (16, 16))]
    return path, feeds, d


def test_unknown_method_and_precision(tiny):
    path, feeds, d = tiny
    with pytest.raises(ConfigError, match="method"):
        qdq_from_onnx(path, feeds, d / "x.onnx", method="kl")
    with pytest.raises(ConfigError, match="precision"):
        qdq_from_onnx(path, feeds, d / "x.onnx", precision="int4")


def test_tiny_quantizes_with_mixed_shapes(tiny):
    path, feeds, d = tiny
    for method in ("minmax", "percentile", "entropy"):
        r = qdq_from_onnx(path, feeds, d / f"q_{method}.onnx", method=method)
        assert r.metrics["quantized_layers"] == 2 and r.metrics["calibrate_cosine_min"] > 0.9, (method, r.metrics)


def test_impossible_budget_raises_accuracy_error(tiny):
    path, feeds, d = tiny
    with pytest.raises(AccuracyError) as ei:
        qdq_from_onnx(path, feeds, d / "never.onnx", min_cosine=1.0)
    e = ei.value
    assert e.stage == "calibrate" and e.fix
    assert "least sensitive layer" in e.message and "every" in e.message and "0.9" in e.message
    assert not (d / "never.onnx").exists()
