"""The search's boundary rule on a graph built in code: a layer kept in high precision between quantized neighbours
is found (quantizing it removes a boundary on either side); one next to another float layer or the graph's edge is
not."""
from __future__ import annotations

from onnx import TensorProto, helper

from tasks.quantization.boundaries import isolated_restored, neighbours


def _graph():
    """x -> conv1 -> Relu -> conv2 -> HardSwish -> Reshape -> conv3 -> Add(conv3, conv2's output) -> conv4 -> y"""
    n = helper.make_node
    nodes = [n("Conv", ["x", "w1"], ["c1"], name="conv1"), n("Relu", ["c1"], ["r1"], name="relu1"),
             n("Conv", ["r1", "w2"], ["c2"], name="conv2"), n("HardSwish", ["c2"], ["h2"], name="hs2"),
             n("Reshape", ["h2", "shape"], ["s2"], name="reshape2"), n("Conv", ["s2", "w3"], ["c3"], name="conv3"),
             n("Add", ["c3", "h2"], ["a3"], name="add3"), n("Conv", ["a3", "w4"], ["y"], name="conv4")]
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])])


LAYERS = ["conv1", "conv2", "conv3", "conv4"]


def test_neighbours_are_found_through_pointwise_ops_and_data_movement():
    near = neighbours(_graph(), LAYERS)
    assert near == {"conv1": {"<graph input>", "conv2"}, "conv2": {"conv1", "conv3", "conv4"},
                    "conv3": {"conv2", "conv4"}, "conv4": {"conv2", "conv3", "<graph output>"}}


def test_a_float_layer_between_quantized_ones_is_isolated():
    g = _graph()
    assert isolated_restored(g, LAYERS, ["conv1", "conv3", "conv4"]) == ["conv2"]
    assert isolated_restored(g, LAYERS, ["conv1", "conv4"]) == []  # conv2 and conv3 are float neighbours
    # conv1 reads the graph's input and conv4 feeds its output: quantizing them moves a boundary, removes none
    assert isolated_restored(g, LAYERS, ["conv2", "conv3"]) == []
    assert isolated_restored(g, LAYERS, ["conv1", "conv2", "conv4"]) == ["conv3"]
    assert isolated_restored(g, LAYERS, ["conv1", "conv3"]) == []
