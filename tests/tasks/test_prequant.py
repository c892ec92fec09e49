"""Models that arrive quantized: ONNX Runtime's own quantizers make them in code (static Q/DQ with uint8 or int8
asymmetric activations and int32 bias, asymmetric uint8 weights, symmetric uint8, dynamic); the conversion TensorRT needs is checked against the model as shipped, in ONNX
Runtime, and the converted graphs build real TensorRT-RTX engines."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.prequant import _dequantize, accuracy_fix, describe, quantization_of, trt_from_prequantized
from tests.conftest import TINY_PROFILE, make_conv_model


STATIC = ("static_u8", "static_s8", "static_u8w", "static_u8sym")


class _Reader:
    def __init__(self, n: int = 4):
        self.it = iter([{"x": np.random.default_rng(i).standard_normal((1, 3, 16, 16)).astype(np.float32)} for i in range(n)])

    def get_next(self):
        return next(self.it, None)


@pytest.fixture(scope="session")
def quantized_models(session_tmp) -> dict[str, Path]:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    d = session_tmp / "prequant"
    d.mkdir(exist_ok=True)
    f32 = make_conv_model(d / "f32.onnx")
    quantize_static(str(f32), str(d / "static_u8.onnx"), _Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)  # asymmetric, int32 bias
    quantize_static(str(f32), str(d / "static_u8sym.onnx"), _Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})  # zero point 128
    quantize_static(str(f32), str(d / "static_s8.onnx"), _Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)  # int8 with zero points
    quantize_static(str(f32), str(d / "static_u8w.onnx"), _Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8)  # asymmetric uint8 weights too
    quantize_dynamic(str(f32), str(d / "dynamic.onnx"), weight_type=QuantType.QUInt8)
    quantize_static(str(f32), str(d / "qoperator.onnx"), _Reader(), quant_format=QuantFormat.QOperator,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                    extra_options={"ActivationSymmetric": True})  # QLinearConv, per-channel int8 weights
    return {n: d / f"{n}.onnx" for n in STATIC + ("dynamic", "qoperator")}


@pytest.fixture(scope="module")
def converted(quantized_models):
    from tasks.prequant import trt_from_prequantized

    return {n: trt_from_prequantized(onnx.load(str(quantized_models[n]))) for n in STATIC + ("dynamic", "qoperator")}


def test_what_tensorrt_cannot_take_is_converted_and_the_scales_are_kept(converted, quantized_models):
    import onnxruntime as ort

    for name, (m, stats) in converted.items():
        g = m.graph
        inits = {i.name: i for i in g.initializer}
        for n in g.node:
            if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
                zp = inits[n.input[2]]
                assert zp.data_type == onnx.TensorProto.INT8 and not onnx.numpy_helper.to_array(zp).any(), (name, n.name)
                if n.input[0] in inits:
                    assert inits[n.input[0]].data_type == onnx.TensorProto.INT8  # no int32 bias DQ is left
    m, stats = converted["static_u8sym"]
    assert stats["int8_from_uint8"] == 6 and stats["high_precision_pairs"] == 0 and stats["quantized_layers"] == 2
    shipped = onnx.load(str(quantized_models["static_u8sym"]))
    scales = {i.name: onnx.numpy_helper.to_array(i) for i in shipped.graph.initializer if i.name.endswith("_scale")}
    ours = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
    kept = [k for k in scales if k in ours]  # all but the int32 bias's, folded into a float bias
    assert len(kept) == len(scales) - 1 and all(np.array_equal(ours[k], scales[k]) for k in kept)  # the model's scales
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16)).astype(np.float32)
    a = ort.InferenceSession(shipped.SerializeToString()).run(None, {"x": x})[0]
    b = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    assert np.array_equal(a, b)  # uint8 with zero point 128 is int8 with zero point 0: exactly
    for name in ("static_u8", "static_s8", "static_u8w"):  # zero point != 128: requantized to symmetric int8
        m, stats = converted[name]
        assert stats["requantized_pairs"] == 2 and stats["quantized_layers"] == 2 and stats["fallback_layers"] == 0
        assert stats["high_precision_pairs"] == 1  # the output's pair feeds no layer: float, clamped to its range
        assert stats["max_step_widening"] == pytest.approx(255 / 127, abs=1e-3)  # the Relu's pair, zero point 0
        assert stats["requantized_weights"] == (2 if name == "static_u8w" else 0)
        a = ort.InferenceSession(quantized_models[name].read_bytes()).run(None, {"x": x})[0]
        b = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
        assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999, name
    stats = trt_from_prequantized(onnx.load(str(quantized_models["static_u8"])), asymmetric="float")[1]
    assert stats["requantized_pairs"] == 0 and stats["high_precision_pairs"] == 3  # model.asymmetric=float
    m, stats = converted["qoperator"]  # QLinearConv -> DQ, Conv, Q with the same scales, then as above
    assert stats["qlinear_rewritten"] == 2 and stats["quantized_layers"] == 2 and stats["high_precision_pairs"] == 0
    shipped = onnx.load(str(quantized_models["qoperator"]))
    a = ort.InferenceSession(shipped.SerializeToString()).run(None, {"x": x})[0]
    b = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) > 0.9999  # int32 vs float accumulation


def test_quantization_is_detected(quantized_models, converted, tiny_onnx):
    assert quantization_of(onnx.load(str(quantized_models["static_u8"]))) == {"qdq": 6, "dynamic": 0, "qlinear": 0}
    q = {**quantization_of(onnx.load(str(quantized_models["static_u8"]))), **converted["static_u8"][1]}
    assert describe(q) == ("6 Q/DQ pairs; 2 asymmetric pairs requantized to symmetric int8, step widened up to x2.0; "
                           "1 pair runs in float")
    assert "model.asymmetric=float" in accuracy_fix(q)  # the way back when the requantized model misses the budget
    assert "model.asymmetric" not in accuracy_fix({**q, "requantized_pairs": 0})
    assert quantization_of(onnx.load(str(quantized_models["dynamic"]))) == {"qdq": 0, "dynamic": 4, "qlinear": 0}
    assert quantization_of(onnx.load(str(quantized_models["qoperator"])))["qlinear"] == 2
    assert quantization_of(onnx.load(str(tiny_onnx))) == {"qdq": 0, "dynamic": 0, "qlinear": 0}


@pytest.mark.parametrize("attrs,scale_shape", [({"axis": 0}, (2,)), ({"axis": 1, "block_size": 4}, (2, 2)), ({}, ())])
def test_folded_constants_are_what_onnx_runtime_dequantizes(attrs, scale_shape):
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    x = rng.integers(-2**31, 2**31 - 1, (2, 8)).astype(np.int32) if not attrs else rng.integers(-128, 127, (2, 8)).astype(np.int8)
    scale = rng.uniform(0.01, 2, scale_shape).astype(np.float32)
    zp = rng.integers(-3, 3, scale_shape).astype(x.dtype)
    inits = {n: numpy_helper.from_array(a, n) for n, a in (("x", x), ("s", scale), ("z", zp))}
    dq = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], **attrs)
    g = helper.make_graph([dq], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], list(inits.values()))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    assert np.array_equal(ref, _dequantize(dq, inits))


@pytest.mark.parametrize("dtype,zp", [(np.uint8, 0), (np.uint8, 37), (np.uint8, 200), (np.int8, -20), (np.int8, 90)])
def test_an_asymmetric_pair_becomes_symmetric_int8_within_its_own_steps(dtype, zp):
    """One pair x -> Q -> DQ -> MatMul(1) -> y: afterwards int8 with zero point 0 and scale amax / 127, the pair's range
    kept (values it could not hold are clamped, as before), and every value within half the old plus half the new step
    of the shipped."""
    import onnxruntime as ort

    s = np.float32(0.05)
    inits = [numpy_helper.from_array(np.array(s), "s"), numpy_helper.from_array(np.array(zp, dtype), "z"),
             numpy_helper.from_array(np.ones((1, 1), np.float32), "one")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("MatMul", ["d", "one"], ["y"])]
    g = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4096, 1])], inits)
    shipped = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    shipped.ir_version = 8
    m, stats = trt_from_prequantized(onnx.ModelProto.FromString(shipped.SerializeToString()))
    info = np.iinfo(dtype)
    lo, hi = (info.min - zp) * s, (info.max - zp) * s
    s2 = max(abs(lo), abs(hi)) / 127
    assert stats["requantized_pairs"] == 1 and stats["max_step_widening"] == pytest.approx(s2 / s, rel=1e-4)
    t = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    for n in (n for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")):
        assert t[n.input[2]].dtype == np.int8 and t[n.input[2]] == 0 and t[n.input[1]] == pytest.approx(s2)
    x = np.linspace(lo - 3, hi + 3, 4096, dtype=np.float32).reshape(-1, 1)
    a = ort.InferenceSession(shipped.SerializeToString()).run(None, {"x": x})[0]
    b = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    assert b.min() >= lo - s2 / 2 - 1e-6 and b.max() <= hi + s2 / 2 + 1e-6  # the pair's range, on the new grid
    if lo == 0:
        assert b.min() == 0  # a folded Relu stays a Relu
    assert np.abs(a - b).max() <= (s + s2) / 2 + 1e-6


@pytest.mark.parametrize("name,dequantize", [("static_u8", False), ("static_s8", False), ("static_u8w", False),
                                             ("static_u8sym", False), ("dynamic", True),
                                             ("qoperator", False)])
def test_converted_graphs_build_tensorrt_engines(converted, quantized_models, name, dequantize, tmp_path):
    from tasks.backend import Backend
    from tasks.build import engine_from_onnx

    m = converted[name][0] if not dequantize else trt_from_prequantized(onnx.load(str(quantized_models[name])), True)[0]
    onnx.save(m, str(tmp_path / "m.onnx"))
    eng = engine_from_onnx(tmp_path / "m.onnx", tmp_path / "m.engine", [TINY_PROFILE], "8.6",
                           {"optimization_level": 3, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
    assert eng.metrics["engine_bytes"] > 10_000


@pytest.mark.slow
def test_ppocr_det_quantized_by_quantize_static_defaults_keeps_int8_and_its_accuracy(det_path, tmp_path):
    """PP-OCRv4 det as a user quantizes it: quantize_static, QDQ, default options (uint8 asymmetric activations, weights
    stored as Constant nodes quantized like activations), calibrated on text pages. After conversion every layer is int8
    with symmetric Q/DQ, the engine builds for sm_86, and the converted model is as close to fp32 as the shipped one."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tasks.backend import Backend
    from tasks.build import engine_from_onnx
    from tasks.export import sanitize
    from tasks.samples import preprocess, render_text_image

    recipe = {"channel_order": "RGB", "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
              "layout": "NCHW"}
    rng = np.random.default_rng(0)
    pages = [preprocess([render_text_image(320, 320, rng)], recipe) for _ in range(6)]

    class Pages:
        it = iter([{"x": p} for p in pages[:4]])

        def get_next(self):
            return next(self.it, None)

    shipped = tmp_path / "det_qdq.onnx"
    quantize_static(str(det_path), str(shipped), Pages(), quant_format=QuantFormat.QDQ)
    m, stats = trt_from_prequantized(sanitize(onnx.load(str(shipped)))[0])
    assert stats["quantized_layers"] == 64 and stats["fallback_layers"] == 0
    assert stats["requantized_pairs"] > 50 and stats["requantized_weights"] > 50
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    assert all(inits[n.input[2]].dtype == np.int8 and not inits[n.input[2]].any()
               for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear"))

    def run(model, x):
        return ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString()).run(None, {"x": x})[0]

    def cos(a, b):
        return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))

    for x in pages[4:]:  # held-out pages
        ref, ship, conv = run(str(det_path), x), run(str(shipped), x), run(m, x)
        assert cos(conv, ship) > 0.9 and cos(conv, ref) > cos(ship, ref) - 0.05, (cos(conv, ship), cos(conv, ref), cos(ship, ref))
    onnx.save(m, str(tmp_path / "conv.onnx"))
    profile = {"x": {"min": [1, 3, 64, 64], "opt": [1, 3, 320, 320], "max": [1, 3, 640, 640]}}
    eng = engine_from_onnx(tmp_path / "conv.onnx", tmp_path / "det.engine", [profile], "8.6",
                           {"optimization_level": 3, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
    assert eng.metrics["engine_bytes"] > 1_000_000
