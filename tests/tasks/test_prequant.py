"""Models that arrive quantized: ONNX Runtime's own quantizers make them in code (static Q/DQ with uint8 activations and
int32 bias, symmetric uint8, dynamic); the conversion TensorRT needs is checked against the model as shipped, in ONNX
Runtime, and the converted graphs build real TensorRT-RTX engines."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.prequant import _dequantize, quantization_of, trt_from_prequantized
from tests.conftest import TINY_PROFILE, make_conv_model


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
    quantize_dynamic(str(f32), str(d / "dynamic.onnx"), weight_type=QuantType.QUInt8)
    quantize_static(str(f32), str(d / "qoperator.onnx"), _Reader(), quant_format=QuantFormat.QOperator,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                    extra_options={"ActivationSymmetric": True})  # QLinearConv, per-channel int8 weights
    return {n: d / f"{n}.onnx" for n in ("static_u8", "static_u8sym", "dynamic", "qoperator")}


@pytest.fixture(scope="module")
def converted(quantized_models):
    from tasks.prequant import trt_from_prequantized

    return {n: trt_from_prequantized(onnx.load(str(quantized_models[n])))
            for n in ("static_u8", "static_u8sym", "dynamic", "qoperator")}


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
    assert converted["static_u8"][1]["high_precision_pairs"] == 3  # zero point != 128: float, clamped
    m, stats = converted["qoperator"]  # QLinearConv -> DQ, Conv, Q with the same scales, then as above
    assert stats["qlinear_rewritten"] == 2 and stats["quantized_layers"] == 2 and stats["high_precision_pairs"] == 0
    shipped = onnx.load(str(quantized_models["qoperator"]))
    a = ort.InferenceSession(shipped.SerializeToString()).run(None, {"x": x})[0]
    b = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) > 0.9999  # int32 vs float accumulation


def test_quantization_is_detected(quantized_models, tiny_onnx):
    assert quantization_of(onnx.load(str(quantized_models["static_u8"]))) == {"qdq": 6, "dynamic": 0, "qlinear": 0}
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


@pytest.mark.parametrize("name,dequantize", [("static_u8", False), ("static_u8sym", False), ("dynamic", True),
                                             ("qoperator", False)])
def test_converted_graphs_build_tensorrt_engines(converted, quantized_models, name, dequantize, tmp_path):
    from tasks.backend import Backend
    from tasks.build import engine_from_onnx

    m = converted[name][0] if not dequantize else trt_from_prequantized(onnx.load(str(quantized_models[name])), True)[0]
    onnx.save(m, str(tmp_path / "m.onnx"))
    eng = engine_from_onnx(tmp_path / "m.onnx", tmp_path / "m.engine", [TINY_PROFILE], "8.6",
                           {"optimization_level": 3, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
    assert eng.metrics["engine_bytes"] > 10_000
