"""The int8 emulation computes what TensorRT's fused int8 layers compute: the codes multiplied and summed exactly, the
sum scaled in fp32, the fp16 remainder rounded to fp16 (tasks/onnxrt/codes.py, tasks/onnxrt/emulate.py).

Checked against an independent reference in numpy integer arithmetic (int64 sums of the codes) on a real Q/DQ graph
written by the calibrate stage with its fp16 remainder. With tolerances, not bit-equality: ONNX Runtime's
QuantizeLinear and float kernels differ by CPU in rare rounding ties."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from onnx import numpy_helper

from tasks.onnxrt.codes import int8_layers_from_codes
from tasks.onnxrt.emulate import emulation_label, precision_runner
from tests.conftest import make_conv_model

CHANNELS = 32  # conv2 sums 32 x 3 x 3 = 288 products per output


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The int8 graph the calibrate stage writes for x -> Conv(+bias) -> Relu -> Conv -> y, every layer int8, the rest
    fp16 (its Q/DQ scales fp16)."""
    from tasks.quantization.calibrate import qdq_from_onnx

    d = tmp_path_factory.mktemp("codes")
    src = make_conv_model(d / "f32.onnx", channels=CHANNELS)
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((1, 3, 24, 24)).astype(np.float32)} for _ in range(6)]
    r = qdq_from_onnx(src, feeds[:4], d / "int8.onnx", method="minmax", eval_feeds=feeds[4:], workdir=d / "work")
    return r.files["onnx"], feeds


def _params(path: Path) -> dict[str, np.ndarray]:
    g = onnx.load(str(path)).graph
    return {t.name: numpy_helper.to_array(t) for t in g.initializer}


def _conv_codes(q: np.ndarray, w: np.ndarray) -> np.ndarray:
    """3x3 convolution, padding 1, of int codes in int64: exact."""
    x = np.pad(q.astype(np.int64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = sliding_window_view(x, (3, 3), axis=(2, 3))  # [N, C, H, W, 3, 3]
    return np.einsum("nchwij,mcij->nmhw", win, w.astype(np.int64))


def _quantize(v: np.ndarray, scale) -> np.ndarray:
    return np.clip(np.rint(v / np.float32(scale)), -128, 127).astype(np.int64)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).astype(np.float32)


def reference(p: dict, x: np.ndarray, dequantized_in_fp16: bool = False) -> np.ndarray:
    """What TensorRT computes for the written graph, in numpy: the input rounded to fp16, each layer's codes summed in
    int64 and scaled in fp32 by activation scale x weight scale, the bias added in fp32, the layer's output rounded to
    fp16. ``dequantized_in_fp16``: instead, every dequantized activation and weight rounded to fp16 before a float
    convolution (what the emulation computed before it followed TensorRT)."""
    f32 = np.float32

    def layer(v16, s_x, w, s_w, bias=None):
        q = _quantize(v16, s_x)
        if dequantized_in_fp16:
            xd, wd = _f16(q * f32(s_x)), _f16(w.astype(f32) * s_w.astype(f32).reshape(-1, 1, 1, 1))
            y = np.einsum("nchwij,mcij->nmhw", sliding_window_view(np.pad(xd.astype(np.float64),
                          ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), axis=(2, 3)), wd.astype(np.float64)).astype(f32)
        else:
            scale = (f32(s_x) * s_w.astype(f32)).astype(f32).reshape(1, -1, 1, 1)
            y = _conv_codes(q, w).astype(f32) * scale
        if bias is not None:
            y = y + bias.astype(f32).reshape(1, -1, 1, 1)
        return _f16(y)

    c1 = layer(_f16(x), p["x_scale"], p["w1_quantized"], p["w1_scale"], p["b1"])
    r1 = np.maximum(c1, 0)
    return layer(r1, p["r1_scale"], p["w2_quantized"], p["w2_scale"])


def _within_one_fp16_step(got: np.ndarray, ref: np.ndarray) -> float:
    """The share of elements of ``got`` within one fp16 step of ``ref``."""
    step = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float32)
    return float(np.mean(np.abs(got - ref) <= step))


def test_the_written_graph_is_int8_with_an_fp16_remainder(written):
    path, _ = written
    g = onnx.load(str(path)).graph
    dq_scales = {n.input[1] for n in g.node if n.op_type == "DequantizeLinear"}
    types = {t.data_type for t in g.initializer if t.name in dq_scales}
    assert types == {onnx.TensorProto.FLOAT16} and len(dq_scales) == 4, types  # x, w1, r1, w2


def test_int8_layers_match_integer_arithmetic(written):
    path, feeds = written
    p = _params(path)
    run, how = precision_runner(path)
    assert "2 int8 layers on their codes" in how, how
    for feed in feeds:
        ref = reference(p, feed["x"])
        got = run(feed)["y"]
        assert _within_one_fp16_step(got, ref) >= 0.999
        assert np.linalg.norm(got - ref) <= 1e-4 * np.linalg.norm(ref)


def test_the_reference_tells_fp16_dequantized_values_apart(written):
    """The check above can fail: rounding the dequantized values to fp16 before the convolution moves far more than
    0.1% of the outputs by more than one fp16 step."""
    path, feeds = written
    p = _params(path)
    for feed in feeds[:2]:
        exact, rounded = reference(p, feed["x"]), reference(p, feed["x"], dequantized_in_fp16=True)
        assert _within_one_fp16_step(rounded, exact) < 0.99


def test_the_rewrite_computes_on_codes_and_the_label_says_so(written):
    path, _ = written
    m, count = int8_layers_from_codes(onnx.load(str(path)))
    assert count == 2
    ops = [n.op_type for n in m.graph.node]
    assert "DequantizeLinear" not in ops and ops.count("Conv") == 2
    codes = [t for t in m.graph.initializer if t.name.endswith("_codes_f32")]
    for t in codes:  # the weights are the integer codes
        w = numpy_helper.to_array(t)
        assert np.array_equal(w, np.rint(w)) and np.abs(w).max() <= 127
    label = emulation_label("int8")
    assert "codes multiplied and summed exactly" in label and "scaled in fp32" in label
    assert "products summed in fp32" not in label


def _matmul_gemm_model(path: Path) -> Path:
    """x[n,16] -> MatMul(w1[16,32]) -> Relu -> Gemm(w2[8,32], b2, transB=1, alpha=0.5) -> y[n,8]."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal((8, 32)).astype(np.float32) * 0.3, "w2"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) * 0.1, "b2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1, alpha=0.5, name="gemm")]
    g = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_matmul_and_gemm_layers_match_integer_arithmetic(tmp_path):
    """MatMul (weight scale per output column) and Gemm (transB, alpha, bias) as TensorRT computes them: int64 sums of
    the codes, scaled in fp32 by activation scale x weight scale (x alpha), the bias added, the output rounded to fp16."""
    from tasks.quantization.calibrate import qdq_from_onnx

    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((64, 16)).astype(np.float32)} for _ in range(6)]
    src = _matmul_gemm_model(tmp_path / "f32.onnx")
    r = qdq_from_onnx(src, feeds[:4], tmp_path / "int8.onnx", method="minmax", eval_feeds=feeds[4:],
                      workdir=tmp_path / "work")
    p = _params(r.files["onnx"])
    run, how = precision_runner(r.files["onnx"])
    assert "2 int8 layers on their codes" in how, how
    f32 = np.float32
    for feed in feeds:
        q1 = _quantize(_f16(feed["x"]), p["x_scale"])
        h = _f16((q1 @ p["w1_quantized"].astype(np.int64)).astype(f32) *
                 (f32(p["x_scale"]) * p["w1_scale"].astype(f32)).astype(f32))
        q2 = _quantize(np.maximum(h, 0), p["r_scale"])
        scale = (f32(p["r_scale"]) * p["w2_scale"].astype(f32) * f32(0.5)).astype(f32)
        ref = _f16((q2 @ p["w2_quantized"].astype(np.int64).T).astype(f32) * scale + p["b2"].astype(f32))
        got = run(feed)["y"]
        assert _within_one_fp16_step(got, ref) >= 0.999
        assert np.linalg.norm(got - ref) <= 1e-4 * np.linalg.norm(ref)
