"""Weight-only int8 written as arithmetic: int8 constant -> Cast -> Mul(scale), as torch exporters
write a weight stored quantized. TensorRT refuses the int8 constant anywhere but before a DequantizeLinear; the build
expresses it as one and builds at fp32, fp16 and int8 (real TensorRT-RTX builds)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.flows.test_build_flow import build


def make_weight_only_model(path: Path) -> Path:
    """x[n, 16] -> MatMul(W1) -> Relu -> MatMul(Transpose(W2)) -> Relu -> Gemm(W3, transB) -> y, each weight int8 codes
    -> Cast -> Mul(per-output-channel scale) (W2 as a Linear's [out, in] weight behind a Transpose), and one uint8
    weight with zero point 128 written Cast -> Sub(128) -> Mul(scale)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def weight(name, shape, axis, dtype=np.int8, zp=None):
        lo, hi = (-127, 128) if dtype == np.int8 else (1, 256)
        q = rng.integers(lo, hi, shape).astype(dtype)
        s_shape = [1] * len(shape)
        s_shape[axis] = shape[axis]
        s = (rng.random(s_shape) * 0.02 + 0.005).astype(np.float32)
        inits.extend([numpy_helper.from_array(q, f"{name}_q"), numpy_helper.from_array(s, f"{name}_s")])
        nodes.append(helper.make_node("Cast", [f"{name}_q"], [f"{name}_c"], to=TensorProto.FLOAT))
        cur = f"{name}_c"
        if zp is not None:
            inits.append(numpy_helper.from_array(np.array(zp, np.float32), f"{name}_z"))
            nodes.append(helper.make_node("Sub", [cur, f"{name}_z"], [f"{name}_u"]))
            cur = f"{name}_u"
        nodes.append(helper.make_node("Mul", [cur, f"{name}_s"], [name]))
        return name

    w1 = weight("w1", (16, 32), 1)
    w2 = weight("w2", (24, 32), 0)  # [out, in]: a Linear's weight
    w3 = weight("w3", (8, 24), 0, np.uint8, 128.0)
    nodes += [helper.make_node("MatMul", ["x", w1], ["h1"]), helper.make_node("Relu", ["h1"], ["r1"]),
              helper.make_node("Transpose", [w2], ["w2t"], perm=[1, 0]),
              helper.make_node("MatMul", ["r1", "w2t"], ["h2"]), helper.make_node("Relu", ["h2"], ["r2"]),
              helper.make_node("Gemm", ["r2", w3], ["y"], transB=1)]
    g = helper.make_graph(nodes, "woq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


@pytest.fixture(scope="module")
def woq_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("woq")
    (d / "model").mkdir()
    src = make_weight_only_model(d / "woq.onnx")
    (d / "model" / "woq.yaml").write_text(f"name: woq\nsource: {src}\n"
                                          "profiles:\n  - x: {min: [1, 16], opt: [8, 16], max: [32, 16]}\n")
    return d


def test_tensorrt_refuses_the_pattern_as_written(woq_dir, tmp_path):
    """The premise: the model as shipped does not build (no test that cannot fail)."""
    from tasks.trt.backend import Backend
    from tasks.common.errors import StageError

    with pytest.raises(StageError, match="Quantized constant"):
        Backend("tensorrt_rtx").build_engine(str(woq_dir / "woq.onnx"),
                                             [{"x": {"min": [1, 16], "opt": [8, 16], "max": [32, 16]}}], "8.6")


def test_the_pattern_is_exactly_a_dequantize_linear(woq_dir):
    import onnx

    from tasks.onnxrt.ort import ort_runner
    from tasks.prequant.weight_only import dequantize_cast_weights

    model = onnx.load(str(woq_dir / "woq.onnx"))
    stats = dequantize_cast_weights(model)
    assert stats["dequantize_linear"] == 3 and stats["folded"] == 0, stats
    ops = [n.op_type for n in model.graph.node]
    assert "Cast" not in ops and ops.count("DequantizeLinear") == 3 and "Transpose" not in ops
    x = {"x": np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)}
    want = ort_runner(str(woq_dir / "woq.onnx"))(x)["y"]
    got = ort_runner(model.SerializeToString(), optimization="basic")(x)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_a_weight_only_int8_model_builds_at_every_precision(prefect_harness, woq_dir, tmp_path, precision):
    data = []
    if precision == "int8":  # calibration samples as a user holds them (samples on axis 0)
        np.savez(tmp_path / "cal.npz", x=np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32))
        data = [f"calibration.data={tmp_path / 'cal.npz'}"]
    s = build(["model=woq", f"precision={precision}", "stages.benchmark=false", *data], woq_dir, tmp_path)
    assert s["status"] == "ok", s.get("error")
    assert s["metrics"]["cosine_min"] >= 0.99, s["metrics"]
    assert s["metrics"]["trt_subgraphs"] == 1 and s["metrics"]["fallback_nodes"] == 0
    assert not s["stages"]["partition"].get("note")  # no fallback needed
    assert "3 as int8 -> DequantizeLinear" in s["stages"]["export"]["note"]
    assert s["stages"]["validate"]["reference"] == "the model as shipped"
    share = s["metrics"]["flops_share"]
    if precision == "int8":
        assert share["int8"] > 0.5 and s["stages"]["calibrate"]["status"] == "ok"
        assert "kept for 3 of its 3 weights" in s["stages"]["calibrate"]["note"]  # the model's own weight scales
    else:  # weight-only: the layers compute float from int8 weights
        assert share[precision] > 0.99 and s["stages"]["calibrate"]["status"] == "skipped"


def test_an_embedding_table_stored_int8_stays_int8_and_builds(tmp_path):
    """int8 table -> Cast -> Mul(scale per row) -> Gather (a word embedding stored quantized): int8 ->
    DequantizeLinear(axis 0) -> Gather, which TensorRT-RTX builds (the table stays int8), and the values are the same."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from tasks.trt.backend import Backend
    from tasks.onnxrt.ort import ort_runner
    from tasks.prequant.weight_only import dequantize_cast_weights

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-127, 128, (500, 32)).astype(np.int8), "table_q"),
             numpy_helper.from_array((rng.random((500, 1)) * 0.01 + 1e-3).astype(np.float32), "table_s")]
    nodes = [helper.make_node("Cast", ["table_q"], ["table_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["table_f", "table_s"], ["table"]),
             helper.make_node("Gather", ["table", "ids"], ["y"])]
    g = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 32])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "emb.onnx"))
    stats = dequantize_cast_weights(m)
    assert stats["weight_only"]["table"] == {"as": "dequantize_linear", "dtype": "int8", "axis": 0}
    onnx.save(m, str(tmp_path / "dq.onnx"))
    ids = {"ids": rng.integers(0, 500, (2, 7)).astype(np.int64)}
    np.testing.assert_array_equal(ort_runner(str(tmp_path / "dq.onnx"), optimization="basic")(ids)["y"],
                                  ort_runner(str(tmp_path / "emb.onnx"))(ids)["y"])
    assert Backend("tensorrt_rtx").build_engine(str(tmp_path / "dq.onnx"),
                                                [{"ids": {"min": [1, 4], "opt": [2, 8], "max": [4, 16]}}], "8.6")
