"""Models that arrive quantized: ONNX Runtime's own quantizers make them in code (static Q/DQ with uint8 or int8
asymmetric activations and int32 bias, asymmetric uint8 weights, symmetric uint8, dynamic); the conversion TensorRT needs is checked against the model as shipped, in ONNX
Runtime, and the converted graphs build real TensorRT-RTX engines."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.prequant.detect import describe, quantization_of
from tasks.prequant.fixes import accuracy_fix
from tasks.prequant.qdq import dequantize
from tasks.prequant.rewrite import trt_from_prequantized
from tasks.onnxrt.ort import ort_run, ort_session
from tests.conftest import TINY_PROFILE, make_conv_model


def exact_run(model, feed) -> np.ndarray:
    """The first output of ``model`` (bytes or a path) as every accuracy figure computes it: Q/DQ as written."""
    return next(iter(ort_run(ort_session(model if isinstance(model, bytes) else Path(model)), feed).values()))


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
    from tasks.prequant.rewrite import trt_from_prequantized

    return {n: trt_from_prequantized(onnx.load(str(quantized_models[n]))) for n in STATIC + ("dynamic", "qoperator")}


def test_what_tensorrt_cannot_take_is_converted_and_the_scales_are_kept(converted, quantized_models):
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
    a = exact_run(shipped.SerializeToString(), {"x": x})
    b = exact_run(m.SerializeToString(), {"x": x})
    assert np.array_equal(a, b)  # uint8 with zero point 128 is int8 with zero point 0: exactly
    for name in ("static_u8", "static_s8", "static_u8w"):  # zero point != 128, default: the model's rounding, shifted
        m, stats = converted[name]
        assert stats["shifted_pairs"] == 3 and stats["shift_folded"] == 2  # both Convs read their int8 pair directly
        assert stats["quantized_layers"] == 2 and stats["fallback_layers"] == 0 and stats["requantized_pairs"] == 0
        assert stats.get("shifted_weights", 0) == (2 if name == "static_u8w" else 0)
        dq_out = {n.output[0] for n in m.graph.node if n.op_type == "DequantizeLinear"}
        int8_convs = [n for n in m.graph.node if n.op_type == "Conv" and n.input[1] in dq_out]
        assert len(int8_convs) == 2 and all(n.input[0] in dq_out for n in int8_convs)  # no Sub between pair and Conv
        xs = 3 * x  # beyond the calibrated range too: the model's own saturation
        a = exact_run(quantized_models[name].read_bytes(), {"x": xs})
        b = exact_run(m.SerializeToString(), {"x": xs})
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * float(np.abs(a).max()))  # float reassociation only, no code flips
        m, stats = trt_from_prequantized(onnx.load(str(quantized_models[name])), asymmetric="int8")
        assert stats["requantized_pairs"] == 2 and stats["quantized_layers"] == 2 and stats["fallback_layers"] == 0
        assert stats["high_precision_pairs"] == 1  # the output's pair feeds no layer: float, clamped to its range
        assert stats["max_step_widening"] == pytest.approx(255 / 127, abs=1e-3)  # the Relu's pair, zero point 0
        assert stats["requantized_weights"] == (2 if name == "static_u8w" else 0)
        a = exact_run(quantized_models[name].read_bytes(), {"x": x})
        b = exact_run(m.SerializeToString(), {"x": x})
        assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999, name
    stats = trt_from_prequantized(onnx.load(str(quantized_models["static_u8"])), asymmetric="float")[1]
    assert stats["requantized_pairs"] == 0 and stats["high_precision_pairs"] == 3  # model.asymmetric=float
    m, stats = converted["qoperator"]  # QLinearConv -> DQ, Conv, Q with the same scales, then as above
    assert stats["qlinear_rewritten"] == 2 and stats["quantized_layers"] == 2 and stats["high_precision_pairs"] == 0
    shipped = onnx.load(str(quantized_models["qoperator"]))
    a = exact_run(shipped.SerializeToString(), {"x": x})
    b = exact_run(m.SerializeToString(), {"x": x})
    assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) > 0.9999  # int32 vs float accumulation


def test_quantization_is_detected(quantized_models, converted, tiny_onnx):
    assert quantization_of(onnx.load(str(quantized_models["static_u8"]))) == {"qdq": 6, "dynamic": 0, "qlinear": 0}
    q = {**quantization_of(onnx.load(str(quantized_models["static_u8"]))), **converted["static_u8"][1]}
    assert describe(q) == "6 Q/DQ pairs; 3 asymmetric pairs kept exactly as shifted int8 (2 of them feeding int8 layers)"
    assert "model.asymmetric=float" in accuracy_fix(q)
    q = {**quantization_of(onnx.load(str(quantized_models["static_u8"]))),
         **trt_from_prequantized(onnx.load(str(quantized_models["static_u8"])), asymmetric="int8")[1]}
    assert describe(q) == ("6 Q/DQ pairs; 2 asymmetric pairs requantized to symmetric int8, step widened up to x2.0; "
                           "1 pair runs in float")
    assert "model.asymmetric=exact" in accuracy_fix(q)  # the way back when the requantized model misses the budget
    assert "model.asymmetric" not in accuracy_fix({"requantized_pairs": 0})
    assert quantization_of(onnx.load(str(quantized_models["dynamic"]))) == {"qdq": 0, "dynamic": 4, "qlinear": 0}
    assert quantization_of(onnx.load(str(quantized_models["qoperator"])))["qlinear"] == 2
    assert quantization_of(onnx.load(str(tiny_onnx))) == {"qdq": 0, "dynamic": 0, "qlinear": 0}


@pytest.mark.parametrize("attrs,scale_shape", [({"axis": 0}, (2,)), ({"axis": 1, "block_size": 4}, (2, 2)), ({}, ())])
def test_folded_constants_are_what_onnx_runtime_dequantizes(attrs, scale_shape):
    rng = np.random.default_rng(0)
    x = rng.integers(-2**31, 2**31 - 1, (2, 8)).astype(np.int32) if not attrs else rng.integers(-128, 127, (2, 8)).astype(np.int8)
    scale = rng.uniform(0.01, 2, scale_shape).astype(np.float32)
    zp = rng.integers(-3, 3, scale_shape).astype(x.dtype)
    inits = {n: numpy_helper.from_array(a, n) for n, a in (("x", x), ("s", scale), ("z", zp))}
    dq = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], **attrs)
    g = helper.make_graph([dq], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], list(inits.values()))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    ref = exact_run(m.SerializeToString(), {})
    assert np.array_equal(ref, dequantize(dq, inits))


@pytest.mark.parametrize("dtype,zp", [(np.uint8, 0), (np.uint8, 37), (np.uint8, 200), (np.int8, -20), (np.int8, 90)])
def test_an_asymmetric_pair_becomes_symmetric_int8_within_its_own_steps(dtype, zp):
    """One pair x -> Q -> DQ -> MatMul(1) -> y: afterwards int8 with zero point 0 and scale amax / 127, the pair's range
    kept (values it could not hold are clamped, as before), and every value within half the old plus half the new step
    of the shipped."""
    s = np.float32(0.05)
    inits = [numpy_helper.from_array(np.array(s), "s"), numpy_helper.from_array(np.array(zp, dtype), "z"),
             numpy_helper.from_array(np.ones((1, 1), np.float32), "one")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("MatMul", ["d", "one"], ["y"])]
    g = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4096, 1])], inits)
    shipped = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    shipped.ir_version = 8
    m, stats = trt_from_prequantized(onnx.ModelProto.FromString(shipped.SerializeToString()), asymmetric="int8")
    info = np.iinfo(dtype)
    lo, hi = (info.min - zp) * s, (info.max - zp) * s
    s2 = max(abs(lo), abs(hi)) / 127
    assert stats["requantized_pairs"] == 1 and stats["max_step_widening"] == pytest.approx(s2 / s, rel=1e-4)
    t = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    for n in (n for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")):
        assert t[n.input[2]].dtype == np.int8 and t[n.input[2]] == 0 and t[n.input[1]] == pytest.approx(s2)
    x = np.linspace(lo - 3, hi + 3, 4096, dtype=np.float32).reshape(-1, 1)
    a = exact_run(shipped.SerializeToString(), {"x": x})
    b = exact_run(m.SerializeToString(), {"x": x})
    assert b.min() >= lo - s2 / 2 - 1e-6 and b.max() <= hi + s2 / 2 + 1e-6  # the pair's range, on the new grid
    if lo == 0:
        assert b.min() == 0  # a folded Relu stays a Relu
    assert np.abs(a - b).max() <= (s + s2) / 2 + 1e-6


@pytest.mark.parametrize("dtype,zp", [(np.uint8, 0), (np.uint8, 37), (np.uint8, 200), (np.int8, -20), (np.int8, 90)])
@pytest.mark.parametrize("layer", ["MatMul", "Gemm", "Conv"])
def test_an_asymmetric_pair_is_kept_exactly_by_default(dtype, zp, layer):
    """x -> Q -> DQ -> layer with int8 weights: by default (model.asymmetric=exact) the pair becomes a shifted int8 pair
    whose shift the layer's bias absorbs, so the layer reads int8 codes (an int8 layer in TensorRT) and every value,
    in range and saturated, is what the model as shipped computes. (Not at exact half steps with an odd shift: round
    half to even of x/s + k and of x/s differ there, a set of measure zero for real activations.)"""
    s = np.float32(0.05)
    rng = np.random.default_rng(0)
    wq = rng.integers(-127, 128, (3, 3)).astype(np.int8)
    inits = [numpy_helper.from_array(np.array(s), "s"), numpy_helper.from_array(np.array(zp, dtype), "z"),
             numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(np.array(0.02, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz")]
    shape = [64, 3] if layer != "Conv" else [1, 3, 8, 8]
    w = "w" if layer != "Conv" else "w4"
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"])]
    if layer == "Conv":
        inits.append(numpy_helper.from_array(np.array([3, 3, 1, 1], np.int64), "wshape"))
        nodes.append(helper.make_node("Reshape", ["w", "wshape"], ["w4"]))
        nodes.append(helper.make_node("Conv", ["d", w], ["y"], pads=[0, 0, 0, 0]))
    elif layer == "Gemm":
        inits.append(numpy_helper.from_array(np.array([0.5, -1, 2], np.float32), "b"))
        nodes.append(helper.make_node("Gemm", ["d", w, "b"], ["y"], transB=1, alpha=0.5))
    else:
        nodes.append(helper.make_node("MatMul", ["d", w], ["y"]))
    g = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    shipped = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    shipped.ir_version = 8
    m, stats = trt_from_prequantized(onnx.ModelProto.FromString(shipped.SerializeToString()))
    k = zp - (128 if dtype == np.uint8 else 0)
    assert stats["shifted_pairs"] == 1 and stats["pairs"]["x"] == {"kind": "shifted", "shift_steps": k}
    t = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    for n in (n for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")):
        assert t[n.input[2]].dtype == np.int8 and not t[n.input[2]].any()
    if layer != "Conv":  # a Conv's weight comes through a Reshape: its shift stays a Sub (a float layer)
        assert stats["shift_folded"] == 1 and stats["quantized_layers"] == 1
        reader = next(n for n in m.graph.node if n.op_type == layer)
        assert reader.input[0] in {n.output[0] for n in m.graph.node if n.op_type == "DequantizeLinear"}
    info = np.iinfo(dtype)
    lo, hi = (info.min - zp) * s, (info.max - zp) * s
    x = rng.uniform(lo - 1, hi + 1, shape).astype(np.float32)  # in range and saturated at both ends
    a = exact_run(shipped.SerializeToString(), {"x": x})
    b = exact_run(m.SerializeToString(), {"x": x})
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * float(np.abs(a).max()))


@pytest.mark.parametrize("name,dequantize", [("static_u8", False), ("static_s8", False), ("static_u8w", False),
                                             ("static_u8sym", False), ("dynamic", True),
                                             ("qoperator", False)])
def test_converted_graphs_build_tensorrt_engines(converted, quantized_models, name, dequantize, tmp_path):
    from tasks.trt.backend import Backend
    from tasks.engines.build import engine_from_onnx

    m = converted[name][0] if not dequantize else trt_from_prequantized(onnx.load(str(quantized_models[name])), True)[0]
    onnx.save(m, str(tmp_path / "m.onnx"))
    eng = engine_from_onnx(tmp_path / "m.onnx", tmp_path / "m.engine", [TINY_PROFILE], "8.6",
                           {"optimization_level": 3, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
    assert eng.metrics["engine_bytes"] > 10_000


@pytest.mark.slow
def test_ppocr_det_quantized_by_quantize_static_defaults_keeps_int8_and_its_accuracy(det_path, tmp_path):
    """PP-OCRv4 det as a user quantizes it: quantize_static, QDQ, default options (uint8 asymmetric activations, weights
    stored as Constant nodes quantized like activations), calibrated on text pages. By default the asymmetric pairs keep
    the model's rounding (shifted int8, 62 of 64 layers int8: measured); model.asymmetric=int8 requantizes them (every
    layer int8, another rounding). Both build for sm_86; the default agrees with the model as shipped."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tasks.trt.backend import Backend
    from tasks.engines.build import engine_from_onnx
    from tasks.sources.export import sanitize
    from tasks.data.samples import preprocess, render_text_image

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
    exact, stats = trt_from_prequantized(sanitize(onnx.load(str(shipped)))[0])
    assert stats["quantized_layers"] >= 60 and stats["shifted_pairs"] > 200 and stats["shift_folded"] >= 60, stats
    requantized, rstats = trt_from_prequantized(sanitize(onnx.load(str(shipped)))[0], asymmetric="int8")
    assert rstats["quantized_layers"] == 64 and rstats["fallback_layers"] == 0
    assert rstats["requantized_pairs"] > 50 and rstats["requantized_weights"] > 50
    for m in (exact, requantized):
        inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
        assert all(inits[n.input[2]].dtype == np.int8 and not inits[n.input[2]].any()
                   for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear"))

    def run(model, x):
        return exact_run(model if isinstance(model, str) else model.SerializeToString(), {"x": x})

    def cos(a, b):
        return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))

    for x in pages[4:]:  # held-out pages
        ship = run(str(shipped), x)
        assert cos(run(exact, x), ship) > 0.99 and cos(run(exact, x), ship) > cos(run(requantized, x), ship)
    profile = {"x": {"min": [1, 3, 64, 64], "opt": [1, 3, 320, 320], "max": [1, 3, 640, 640]}}
    for name, m in (("exact", exact), ("requantized", requantized)):
        onnx.save(m, str(tmp_path / f"{name}.onnx"))
        eng = engine_from_onnx(tmp_path / f"{name}.onnx", tmp_path / f"{name}.engine", [profile], "8.6",
                               {"optimization_level": 3, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
        assert eng.metrics["engine_bytes"] > 1_000_000


def test_qoperator_contrib_ops_become_qdq_and_one_tensorrt_graph(tmp_path):
    """ONNX Runtime's QOperator format puts its contrib QLinear ops (com.microsoft) on Add, Mul, GlobalAveragePool,
    Sigmoid and Concat, with their constants quantized, and keeps Resize/MaxPool on uint8 data. They become DQ ->
    float op -> Q with the same scales (then the pair rules), the quantized constants fold to float, the movement ops
    run in float between pairs, nothing foreign or 8-bit-only is left, and the graph is one TensorRT subgraph."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tasks.trt.backend import Backend
    from tasks.engines.build import engine_from_onnx
    from tests.conftest import save_image_model

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.2, "w2"),
             numpy_helper.from_array(np.float32(0.7).reshape(()), "k")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "r1"], ["a"]),  # residual
             helper.make_node("Mul", ["a", "k"], ["m"]),  # a quantized constant operand
             helper.make_node("GlobalAveragePool", ["m"], ["gap"]),
             helper.make_node("Sigmoid", ["gap"], ["att"]),
             helper.make_node("Mul", ["m", "att"], ["se"]),
             helper.make_node("Concat", ["se", "r1"], ["cat"], axis=1),
             helper.make_node("Resize", ["cat", "", "scales"], ["up"], mode="nearest"),  # QOperator keeps these on
             helper.make_node("MaxPool", ["up"], ["down"], kernel_shape=[2, 2], strides=[2, 2]),  # uint8 data
             helper.make_node("Conv", ["down", "w3"], ["y"])]
    inits.append(numpy_helper.from_array(rng.standard_normal((4, 16, 1, 1)).astype(np.float32) * 0.2, "w3"))
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    f32 = save_image_model(tmp_path / "f32.onnx", "se", nodes, inits, 4, [helper.make_opsetid("", 17)])
    shipped = tmp_path / "qop.onnx"
    quantize_static(str(f32), str(shipped), _Reader(8), quant_format=QuantFormat.QOperator)
    ops = {n.op_type for n in onnx.load(str(shipped)).graph.node if n.domain == "com.microsoft"}
    assert ops >= {"QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "QLinearSigmoid", "QLinearConcat"}, ops

    g0 = onnx.load(str(shipped)).graph
    prod = {o: n for n in g0.node for o in n.output}
    resize = next(n for n in g0.node if n.op_type == "Resize")  # QLinearConcat -> Resize -> MaxPool -> QLinearConv
    assert prod[resize.input[0]].op_type == "QLinearConcat"  # on uint8 data
    m, stats = trt_from_prequantized(onnx.load(str(shipped)))
    assert not [n.op_type for n in m.graph.node if n.domain not in ("", "ai.onnx")]
    assert stats["dq_before_movement"] == 1  # Q -> DQ -> Resize -> MaxPool -> Q -> DQ: the same values, in float
    assert stats["qlinear_rewritten"] >= 8 and stats["folded_constants"] >= 1 and stats["quantized_layers"] == 3
    assert quantization_of(onnx.load(str(shipped)))["qlinear"] >= 8
    x = np.random.default_rng(9).standard_normal((2, 3, 16, 16)).astype(np.float32)
    a = exact_run(str(shipped), {"x": x})
    b = exact_run(m.SerializeToString(), {"x": x})
    assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999
    onnx.save(m, str(tmp_path / "m.onnx"))
    from tasks.data.inputs import generated_feeds
    from tasks.graph.load import load_onnx
    from tasks.graph.models import graph_io
    from tasks.partition.partition import plan_from_onnx

    ins, _ = graph_io(load_onnx(tmp_path / "m.onnx"))
    plan = plan_from_onnx(tmp_path / "m.onnx", {"min_subgraph_size": 3, "exclude_ops": [], "strict": False},
                          Backend("tensorrt_rtx"), tmp_path / "plan", [generated_feeds(ins, [TINY_PROFILE], 0, 0)])
    assert plan.metrics["trt_subgraphs"] == 1 and plan.metrics["fallback_nodes"] == 0, plan.details["fallback_nodes"]
    eng = engine_from_onnx(tmp_path / "m.onnx", tmp_path / "m.engine", [TINY_PROFILE], "8.6",
                           {"optimization_level": 0, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
    assert eng.metrics["engine_bytes"] > 10_000


@pytest.mark.parametrize("per_channel", [False, True])
def test_qoperator_classifier_head_qgemm_becomes_one_tensorrt_graph(tmp_path, per_channel):
    """A classifier in QOperator format: QLinearConv -> QLinearGlobalAveragePool -> Flatten (on uint8) -> QGemm with
    an int32 bias. QGemm becomes DQ -> Gemm -> Q with the bias in float; the whole model is one TensorRT subgraph."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tasks.trt.backend import Backend
    from tasks.data.inputs import generated_feeds
    from tasks.graph.load import load_onnx
    from tasks.graph.models import graph_io
    from tasks.partition.partition import plan_from_onnx

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal((10, 8)).astype(np.float32) * 0.3, "fc"),
             numpy_helper.from_array(rng.standard_normal(10).astype(np.float32) * 0.1, "fcb")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("GlobalAveragePool", ["r1"], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "cls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])], inits)
    f32 = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    f32.ir_version = 8
    onnx.save(f32, str(tmp_path / "f32.onnx"))
    shipped = tmp_path / "qop.onnx"
    quantize_static(str(tmp_path / "f32.onnx"), str(shipped), _Reader(8), quant_format=QuantFormat.QOperator,
                    per_channel=per_channel)
    assert "QGemm" in {n.op_type for n in onnx.load(str(shipped)).graph.node}

    m, stats = trt_from_prequantized(onnx.load(str(shipped)))
    assert not [n.op_type for n in m.graph.node if n.domain not in ("", "ai.onnx")]
    assert stats["quantized_layers"] == 2 and any(n.op_type == "Gemm" for n in m.graph.node)
    x = np.random.default_rng(9).standard_normal((2, 3, 16, 16)).astype(np.float32)
    a = exact_run(str(shipped), {"x": x})
    b = exact_run(m.SerializeToString(), {"x": x})
    assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) > 0.999
    onnx.save(m, str(tmp_path / "m.onnx"))
    prof = {"x": {"min": [1, 3, 16, 16], "opt": [2, 3, 16, 16], "max": [4, 3, 16, 16]}}
    ins, _ = graph_io(load_onnx(tmp_path / "m.onnx"))
    plan = plan_from_onnx(tmp_path / "m.onnx", {"min_subgraph_size": 3, "exclude_ops": [], "strict": False},
                          Backend("tensorrt_rtx"), tmp_path / "plan", [generated_feeds(ins, [prof], 0, 0)])
    assert plan.metrics["trt_subgraphs"] == 1 and plan.metrics["fallback_nodes"] == 0, plan.details["fallback_nodes"]
