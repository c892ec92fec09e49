"""What a model surely needs in memory before it runs (tasks/graph/footprint.py): its weights as stored, external data
included, and the largest step at a profile's max shapes where shape inference knows it."""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.graph.footprint import estimate_of, largest_step, weights_bytes


def chain(path, layers: int = 3, width: int = 64, external: bool = False):
    """x[n, width] -> MatMul x layers -> y, seeded weights."""
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), f"w{i}"))
        out = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [cur, f"w{i}"], [out], name=f"mm{i}"))
        cur = out
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", width])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    if external:
        onnx.save(m, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    else:
        onnx.save(m, str(path))
    return m


def test_weights_count_the_file_and_its_external_data(tmp_path):
    chain(tmp_path / "m.onnx", 3, 64, external=True)
    light = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    size, side = weights_bytes(tmp_path / "m.onnx", light)
    assert [f.name for f in side] == ["m.onnx.data"]
    assert size == (tmp_path / "m.onnx").stat().st_size + (tmp_path / "m.onnx.data").stat().st_size
    assert size >= 3 * 64 * 64 * 4  # every weight, stored beside the graph
    assert weights_bytes(tmp_path / "m.onnx")[0] == (tmp_path / "m.onnx").stat().st_size  # not read yet: the file


def test_the_largest_step_is_a_node_s_inputs_and_outputs_at_the_profile_s_max_shapes(tmp_path):
    m = chain(tmp_path / "m.onnx", 2, 64)
    profiles = [{"x": {"min": [1, 64], "opt": [8, 64], "max": [1000, 64]}},
                {"x": {"min": [1, 64], "opt": [8, 64], "max": [5000, 64]}}]
    step = largest_step(m, profiles)
    assert step.profile == 1 and step.bytes == 2 * 5000 * 64 * 4  # one input and one output of [5000, 64] fp32
    assert step.shape == (5000, 64)


def test_a_step_whose_shape_inference_cannot_know_counts_nothing():
    """A size set by an input's value (ConstantOfShape of it): unknown before it runs, so no bound is claimed."""
    n = helper.make_tensor_value_info("n", TensorProto.INT64, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    m = helper.make_model(helper.make_graph([helper.make_node("ConstantOfShape", ["n"], ["y"])], "g", [n], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    step = largest_step(m, [{}], {"n": [1]})
    assert step is not None and (step.tensor, step.bytes) == ("n", 8)  # the input itself, never the output it sizes


def test_a_sparse_ten_gigabyte_weight_file_is_counted_without_being_read(tmp_path):
    """A 10 GB external data file (sparse: no disk, never read) counts at its size."""
    t = onnx.TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[50_000, 50_000])
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(10**10))):
        e = t.external_data.add()
        e.key, e.value = k, v
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 50_000])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 50_000])
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [t]),
                          opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, str(tmp_path / "big.onnx"))
    with open(tmp_path / "w.bin", "wb") as f:
        os.truncate(f.fileno(), 10**10)
    est = estimate_of(tmp_path / "big.onnx", onnx.load(str(tmp_path / "big.onnx"), load_external_data=False), 0,
                      [{"x": {"min": [1, 50_000], "opt": [1, 50_000], "max": [2, 50_000]}}])
    assert est.weights >= 10**10 and est.total >= 2 * 10**10
    assert est.step == 2 * 2 * 50_000 * 4  # x and y at [2, 50000]; the weight is counted with the weights
    assert "big.onnx and 1 external data file" in est.parts()
