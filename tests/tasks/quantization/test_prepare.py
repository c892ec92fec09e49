"""Preparing a graph for quantization (tasks/quantization/prepare.py): the Q/DQ graph is valid wherever the float one is."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.accuracy.metrics import cosine
from tasks.onnxrt.ort import ort_run, ort_session
from tasks.quantization.calibrate import qdq_from_onnx


def _shared_bias_model(path):
    """x[N, 4, T] -> three Conv1d layers that share one bias initializer ``b`` (tf2onnx shares equal constants), their
    outputs named ``b1``, ``b2``, ``b3``: the names ONNX Runtime's quantizer gives its own copies of a shared bias."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(4).astype(np.float32) * 0.1, "b")]
    nodes, x = [], "x"
    for i in (1, 2, 3):
        inits.append(numpy_helper.from_array(rng.standard_normal((4, 4, 3)).astype(np.float32) * 0.3, f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}", "b"], [f"b{i}"], pads=[1, 1], name=f"conv{i}"),
                  helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    g = helper.make_graph(nodes, "shared_bias", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 32])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 4, 32])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_layers_sharing_a_bias_give_a_valid_qdq_graph(tmp_path):
    path = _shared_bias_model(tmp_path / "shared_bias.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 4, 32)).astype(np.float32)} for _ in range(6)]
    r = qdq_from_onnx(path, feeds[:4], tmp_path / "q.onnx", method="minmax", eval_feeds=feeds[4:],
                      workdir=tmp_path / "work")
    assert r.metrics["quantized_layers"] == 3, r.metrics
    q = onnx.load(str(tmp_path / "q.onnx"))
    inits = {t.name for t in q.graph.initializer}
    biases = [n.input[2] for n in q.graph.node if n.op_type == "Conv"]
    assert all(b in inits for b in biases) and len(set(biases)) == 3, biases  # each layer its own bias, a constant
    ref, got = ort_session(path), ort_session(tmp_path / "q.onnx")
    for f in feeds[4:]:  # ONNX Runtime runs the Q/DQ graph, and it computes the model
        assert cosine(ort_run(got, f)["r3"], ort_run(ref, f)["r3"]) > 0.99
