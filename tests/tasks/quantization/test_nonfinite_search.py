"""The int8 accuracy search with an fp32 reference that is not finite (tasks/quantization/calibrate.py,
tasks/accuracy/nonfinite.py): the NaN/inf are found and reported before any judgement (output, count, feeds, the node
that made them and the inputs that reach it), the search judges the finite part of the reference and so quantizes the
layers a NaN passes through (a quantized layer turns a NaN into a finite code: no precision keeps it), and the graph
preparation is checked with the user's metric. Tiny models built here, quantized and run by ONNX Runtime for real."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.accuracy.metric import Metric
from tasks.common.errors import StageError
from tasks.graph.models import save_onnx
from tasks.onnxrt.ort import ort_runner
from tasks.quantization.calibrate import qdq_from_onnx
from tasks.quantization.prepare import check_prepared


def _save(path: Path, nodes, inputs, inits, out_shape, opset: int = 17) -> Path:
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    save_onnx(m, path)
    return path


def log_model(path: Path, op: str = "Log", negated: bool = False) -> Path:
    """y = Relu(x @ W1 + Log(sigma)) @ W2, sigma one noise level per row (a diffusion UNet's): a row whose sigma is
    <= 0 is NaN in fp32 already, and the NaN passes through the second MatMul. ``op="Reciprocal"``: 1/sigma, +inf
    at 0 in the second MatMul's input (what its calibration histogram sees), NaN at its output. ``negated``: of -sigma
    (a domain the graph does not show: random inputs stay standard normal, and about half the rows are NaN)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32) * 0.3, "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             *([helper.make_node("Neg", ["sigma"], ["neg_sigma"], name="neg")] if negated else []),
             helper.make_node(op, ["neg_sigma" if negated else "sigma"], ["l"], name=op.lower()),
             helper.make_node("Add", ["h", "l"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    return _save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16]),
                               helper.make_tensor_value_info("sigma", TensorProto.FLOAT, [4, 1])], inits, [4, 8])


def masked_attention_model(path: Path) -> Path:
    """y = Softmax(Where(mask, x @ Wq, -inf)) @ V: a row the boolean mask leaves all False is NaN (0/0), and the NaN
    passes through the MatMul with V."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.3, "wq"),
             numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32) * 0.3, "v"),
             numpy_helper.from_array(np.array(-np.inf, np.float32), "neg_inf")]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["s"], name="scores"),
             helper.make_node("Where", ["mask", "s", "neg_inf"], ["m"], name="masked_fill"),
             helper.make_node("Softmax", ["m"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="attend")]
    return _save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16]),
                               helper.make_tensor_value_info("mask", TensorProto.BOOL, [4, 16])], inits, [4, 8])


def reciprocal_model(path: Path) -> Path:
    return log_model(path, "Reciprocal")


def log_feeds(n: int, seed: int, bad: float = -1.0) -> list[dict]:
    """sigma > 0 except one row of every other feed (``bad``; -1: NaN in fp32, of a Log)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        sigma = np.abs(rng.standard_normal((4, 1))).astype(np.float32) + 0.1
        if i % 2 == 0:
            sigma[0, 0] = bad
        out.append({"x": rng.standard_normal((4, 16)).astype(np.float32), "sigma": sigma})
    return out


def mask_feeds(n: int, seed: int) -> list[dict]:
    """Random masks, with one row all False in every other feed."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        mask = rng.random((4, 16)) < 0.7
        mask[:, 0] = True
        if i % 2 == 0:
            mask[1] = False
        out.append({"x": rng.standard_normal((4, 16)).astype(np.float32), "mask": mask})
    return out


@pytest.mark.parametrize("model, feeds_of, node, op, inputs", [
    (log_model, log_feeds, "log", "Log", ["sigma"]),
    (masked_attention_model, mask_feeds, "masked_fill", "Where", ["x", "mask"]),
    (reciprocal_model, lambda n, seed: log_feeds(n, seed, bad=0.0), "reciprocal", "Reciprocal", ["sigma"]),
])
def test_nan_of_the_reference_keeps_no_layer_out_of_int8(tmp_path, model, feeds_of, node, op, inputs):
    path = model(tmp_path / "m.onnx")
    r = qdq_from_onnx(path, feeds_of(16, 0), tmp_path / "q.onnx", min_cosine=0.99, eval_feeds=feeds_of(4, 1),
                      workdir=tmp_path / "work", random_inputs=True)
    # the layer the NaN passes through is int8 too: its NaN is no error of any precision
    assert r.metrics["fallback_layers"] == 0 and r.metrics["quantized_layers"] == 2, r.details["fallback"]
    assert r.metrics["search_cosine_all_quantized"] > 0.99, r.metrics
    found = r.details["nonfinite"]
    assert found["reference"]["y"]["count"] > 0 and found["reference"]["y"]["feeds"][0] == 0, found
    assert found["origins"]["y"] == {"node": node, "op": op, "inputs": inputs}, found["origins"]
    warning, = found["warnings"]
    assert f"node {node!r}" in warning and f"input(s) {', '.join(inputs)}" in warning, warning
    assert "calibration.data" in warning and "higher precision" not in warning, warning
    assert "finite part of the fp32 reference" in found["note"], found["note"]
    # the written graph: NaN where the reference is NaN only by its own arithmetic; the rest within the budget
    run, ref = ort_runner(tmp_path / "q.onnx"), ort_runner(path)
    f = feeds_of(2, 7)[1]  # a feed without NaN in fp32
    assert np.isfinite(ref(f)["y"]).all()
    got, want = run(f)["y"].ravel(), ref(f)["y"].ravel()
    assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) > 0.99


def test_finite_reference_has_no_nonfinite_report(tmp_path):
    path = log_model(tmp_path / "m.onnx")
    feeds = [{**f, "sigma": np.abs(f["sigma"]) + 0.1} for f in log_feeds(8, 0)]
    r = qdq_from_onnx(path, feeds, tmp_path / "q.onnx", min_cosine=0.99, eval_feeds=feeds[:2],
                      workdir=tmp_path / "work")
    assert "nonfinite" not in r.details
    assert "nonfinite_reference_elements" not in r.details["prepare"]


def test_graph_preparation_is_checked_with_the_users_metric(tmp_path):
    """An output 1% off everywhere keeps cosine 1 but fails allclose: the preparation check judges with the metric the
    user chose, says so, and does not advise re-exporting at another opset (the graph needs no conversion)."""
    path = log_model(tmp_path / "m.onnx")
    model = onnx.load(str(path))
    model.opset_import[0].version = 19
    save_onnx(model, path)
    feeds = [{**f, "sigma": np.abs(f["sigma"]) + 0.1} for f in log_feeds(2, 0)]
    run = ort_runner(path)
    ref = [{k: v * 1.01 for k, v in run(f).items()} for f in feeds]
    info = {"opset_in": 19, "opset": 19}
    check_prepared(path, path, feeds, ref, dict(info), Metric().judge())  # cosine: the same direction, passes
    with pytest.raises(StageError) as e:
        check_prepared(path, path, feeds, ref, dict(info), Metric(name="allclose", atol=1e-4, rtol=1e-4).judge())
    assert "accuracy.metric=allclose" in e.value.message and "opset" not in e.value.fix, (e.value.message, e.value.fix)


def test_graph_preparation_leaves_out_the_nan_of_the_reference(tmp_path):
    """The prepared graph judged where the reference is finite: a NaN of the reference is not a change (allclose)."""
    path = log_model(tmp_path / "m.onnx")
    feeds = log_feeds(2, 0)
    run = ort_runner(path)
    ref = [run(f) for f in feeds]
    assert not np.isfinite(ref[0]["y"]).all()
    info = {"opset_in": 17, "opset": 17}
    check_prepared(path, path, feeds, ref, info, Metric(name="allclose").judge())
    assert info["nonfinite_reference_elements"] == int((~np.isfinite(ref[0]["y"])).sum()) and \
        info["allclose_to_input"] == 1.0, info


def test_local_errors_of_a_layer_whose_fp32_output_holds_nan_are_of_its_finite_part(tmp_path):
    """The search ranks layers by their own output error: a layer whose fp32 output holds NaN (fc2, on the rows of a
    Log of sigma <= 0) has the error of its finite part, not NaN (which no ranking can order)."""
    from tasks.quantization.qdq import Quantizer
    from tasks.quantization.ranges import ranges_from_feeds
    from tasks.quantization.sensitivity import local_errors

    path = log_model(tmp_path / "m.onnx")
    feeds = log_feeds(8, 0)
    (tmp_path / "work").mkdir()
    ranges, _ = ranges_from_feeds(path, feeds, "entropy", tmp_path / "work", None)
    q = Quantizer(path, ranges, "int8", "fp16", {}, {}, {}, {})
    for worst in (False, True):
        errs = local_errors({"entropy": q}, path, feeds, worst=worst)["entropy"]
        assert set(errs) == {"fc1", "fc2"} and all(np.isfinite(v) and 0 < v < 1 for v in errs.values()), errs
