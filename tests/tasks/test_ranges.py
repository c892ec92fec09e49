"""Calibration ranges from histograms of |x| (tasks/ranges.py)."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.qdq import quantized_activations
from tasks.ranges import ranges_from_feeds


def _two_convs(path):
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((2, 4, 1, 1)).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8])], [w1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_histograms_only_where_q_dq_can_go_and_the_max_of_the_rest(tmp_path):
    """Every tensor ORT's calibrator records has a range; those a layer reads through Q/DQ come from their full
    histogram (entropy, percentile), the others (here the Conv outputs) are their max |x| over every sample."""
    path = _two_convs(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"x": (rng.standard_normal((1, 3, 8, 8)) * s).astype(np.float32)} for s in (1.0, 3.0)]
    needed = quantized_activations(path)
    assert needed == {"x", "r1"}
    import onnxruntime as ort

    m = onnx.load(str(path))
    m.graph.output.extend([onnx.ValueInfoProto(name="c1")])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    c1_max = max(float(np.abs(sess.run(["c1"], f)[0]).max()) for f in feeds)
    x_max = max(float(np.abs(f["x"]).max()) for f in feeds)
    for method in ("entropy", "percentile"):
        r, _ = ranges_from_feeds(path, feeds, method, tmp_path)
        assert {"x", "r1", "c1", "y"} <= set(r.data), (method, sorted(r.data))
        assert float(r.data["c1"].range_value[1]) == np.float32(c1_max)  # the max of the rest
        assert len(r.data["x"].hist) >= 2048  # a full histogram of every sample, binned from 0
        assert 0 < float(r.data["x"].range_value[1]) <= x_max * (1 + 1e-6)
