import numpy as np
import pytest

from tasks.common.errors import AccuracyError
from tasks.accuracy.metrics import compare, pooled_cosine, summarize
from tasks.onnxrt.ort import ort_run, ort_session
from tasks.evaluate.validate import validate_onnx
from tests.tasks.prequant.test_rewrite import quantized_models  # noqa: F401  (session fixture)


def test_compare_and_summarize_cosine_over_the_whole_set():
    a = {"y": np.array([1.0, 0.0], np.float32)}
    same = compare(a, {"y": np.array([1.0, 0.0], np.float32)})
    ortho = compare(a, {"y": np.array([0.0, 1.0], np.float32)})
    assert same["y"]["cosine"] == pytest.approx(1.0) and ortho["y"]["cosine"] == pytest.approx(0.0)
    s = summarize([same, ortho])["y"]
    assert s["cosine_worst_feed"] == pytest.approx(0.0)
    assert s["cosine"] == pytest.approx(0.5)  # (1 + 0) / sqrt(2 * 2)
    assert s["max_abs"] == pytest.approx(1.0)


def test_nan_or_shape_mismatch_is_never_accurate():
    a = {"y": np.ones(4, np.float32)}
    assert compare(a, {"y": np.full(4, np.nan, np.float32)})["y"]["cosine"] == 0.0
    r = summarize([compare(a, {"y": np.ones(5, np.float32)})])["y"]
    assert r["cosine"] == 0.0 and "shape" in r["error"]


def test_an_identical_graph_is_not_measured_and_says_so(tiny_onnx, tmp_path):
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}]
    r = validate_onnx(tiny_onnx, tiny_onnx, feeds, 0.999, "random inputs", tmp_path / "v.json", engine_skip_reason="no GPU",
                      identical=True, evidence=["random inputs inside the profiles", "only 1 samples"])
    # no cosine of the graph with itself: absent, not 1.0; the gate does not apply, and the verdict says why
    assert "cosine_min" not in r.metrics and "emulation_cosine_min" not in r.metrics
    assert r.details["passed"] and not r.details["measured"] and r.details["engine"]["status"] == "skipped"
    assert r.details["verdict"].startswith("not measured on 1 samples")
    assert "identical graph, not measured" in r.details["verdict"] and "only 1 samples" in r.details["verdict"]


def test_a_different_graph_is_measured_with_pooled_and_worst_feed_numbers(tiny_onnx, tmp_path):
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(tiny_onnx))
    w = m.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(w) * 1.001).astype(np.float32), w.name))
    other = tmp_path / "other.onnx"
    onnx.save(m, str(other))
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    r = validate_onnx(tiny_onnx, other, feeds, 0.99, "random inputs", tmp_path / "v.json")
    m_ = r.metrics
    assert 0.99 < m_["cosine_min"] < 1.0 and m_["cosine_worst_feed"] <= m_["cosine_min"] + 1e-12
    assert m_["validate_feeds"] == 3 and m_["validate_samples"] == 6
    assert 0 < m_["mean_abs_err"] <= m_["max_abs_err"]
    assert r.details["verdict"].startswith("passed: cosine_min")


def test_budget_failure_carries_the_measured_result(tiny_onnx, tmp_path):
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(tiny_onnx))
    w = m.graph.initializer[0]
    arr = numpy_helper.to_array(w).copy()
    arr[0] *= -1  # flip one output channel's filter
    w.CopyFrom(numpy_helper.from_array(arr, w.name))
    worse = tmp_path / "worse.onnx"
    onnx.save(m, str(worse))
    feeds = [{"x": np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)}]
    with pytest.raises(AccuracyError) as e:
        validate_onnx(tiny_onnx, worse, feeds, 0.999, "random", tmp_path / "v.json")
    assert e.value.result.metrics["cosine_min"] < 0.999
    assert "accuracy.min_cosine=0.999" in str(e.value)


def stride2_model(path):
    """y = x + Resize(MaxPool(x), x2): the fp32 model itself only runs on even H and W (a stride-2 network)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Resize", ["p", "", "scales"], ["u"], mode="nearest"),
             helper.make_node("Add", ["x", "u"], ["y"])]
    graph = helper.make_graph(nodes, "stride2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "h", "w"])],
                              initializer=[numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_a_shape_the_fp32_model_cannot_run_is_a_warning_naming_the_key(tmp_path):
    m = stride2_model(tmp_path / "s2.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal(s).astype(np.float32)} for s in ([1, 3, 8, 8], [1, 3, 9, 7], [2, 3, 16, 12])]
    r = validate_onnx(m, m, feeds, 0.99, "random", tmp_path / "v.json")
    assert r.details["passed"] and r.metrics["validate_feeds"] == 2
    assert r.details["left_out"] == [{"x": [1, 3, 9, 7]}]
    w = next(w for w in r.details["warnings"] if "fp32 model itself" in w)
    assert "1 of 3 input shapes" in w and "[1, 3, 9, 7]" in w and "model.shape_multiple" in w and "Add node" in w
    with pytest.raises(Exception, match="fails on every validation input"):
        validate_onnx(m, m, feeds[1:2], 0.99, "random", tmp_path / "v2.json")


def test_a_quantized_reference_is_computed_as_written(quantized_models, tmp_path):  # noqa: F811
    """A model as shipped quantized is the reference as its Q/DQ are written (never ONNX Runtime's integer kernels,
    which differ by CPU): its figure is the one ONNX Runtime gives with every graph optimization off, to 1e-6."""
    shipped, fp32 = quantized_models["static_u8"], quantized_models["static_u8"].with_name("f32.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)} for _ in range(2)]
    r = validate_onnx(shipped, fp32, feeds, 0.999, "random", tmp_path / "a.json", reference_label="the model as shipped")
    plain = ort_session(shipped, optimization="none")
    as_written = pooled_cosine([ort_run(ort_session(fp32), f) for f in feeds], [ort_run(plain, f) for f in feeds])
    assert abs(r.metrics["cosine_min"] - as_written) < 1e-6 and r.metrics["cosine_min"] < 0.99999
    with pytest.raises(AccuracyError) as e:  # the float model is ~0.9996 from its quantized version: below this budget
        validate_onnx(shipped, fp32, feeds, 0.99999, "random", tmp_path / "b.json", reference_label="the model as shipped")
    assert "to the model as shipped" in str(e.value) and "reference_spread" not in r.details, str(e.value)

def _length_model(path, offset: float):
    """y = [0, 1, ..., floor(sum(x) + offset) - 1] as float: an output whose length the model computes from values, as
    a TTS model's audio from its predicted durations."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Add", ["s", "offset"], ["t"]),
             helper.make_node("Floor", ["t"], ["f"]),
             helper.make_node("Cast", ["f"], ["n"], to=TensorProto.INT64),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT)]
    inits = [numpy_helper.from_array(np.array(offset, np.float32), "offset"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")]
    g = helper.make_graph(nodes, "length", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, str(path))
    return path


def test_an_output_whose_length_differs_is_said_to_be_another_decision_not_precision(tmp_path):
    """A candidate that computes another length on some feeds: the verdict says the shapes differ, why a cosine of 0
    says nothing about precision there, and points at a metric that compares outputs of different lengths."""
    from tasks.evaluate.validate import gate

    ref, cand = _length_model(tmp_path / "ref.onnx", 0.0), _length_model(tmp_path / "cand.onnx", 1.0)
    feeds = [{"x": np.full(4, v, np.float32)} for v in (2.0, 3.0, 4.0)]
    with pytest.raises(AccuracyError) as ei:
        validate_onnx(ref, cand, feeds, 0.99, "test feeds", tmp_path / "validation.json")
    result = ei.value.result
    with pytest.raises(AccuracyError) as ei:
        gate(result)
    msg = ei.value.message
    assert "output 'y' has cosine 0.000000" in msg, msg
    assert "on some feeds its shape differs from the reference's (shape [" in msg and "another discrete decision" in msg
    assert "accuracy.metric=module:function" in ei.value.fix, ei.value.fix
