"""ONNX Runtime's quantize_dynamic of 1-D convolutions (speech and TTS models: Conv1d, [N, C, T] activations) dequantized
with model.dequantize_dynamic=true: constant weights and weights computed in the graph (weight-normed Conv1d, which
quantize_dynamic quantizes at run time with a DynamicQuantizeLinear of their own, uint8 like the activations). The
float graph is checked against the model as shipped in ONNX Runtime and placed by the real TensorRT-RTX parser."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from tasks.accuracy.metrics import cosine
from tasks.data.inputs import generated_feeds
from tasks.graph.models import graph_io
from tasks.onnxrt.ort import ort_run, ort_session
from tasks.partition.partition import plan_from_onnx
from tasks.prequant.rewrite import trt_from_prequantized
from tasks.trt.backend import Backend

PROFILE = {"x": {"min": [1, 4, 16], "opt": [2, 4, 64], "max": [4, 4, 128]}}


def conv1d_model(path, weight_norm: bool):
    """x[n, 4, t] -> Conv1d(4->8, k3) -> Relu -> grouped strided Conv1d(8->6, groups 2, k5) -> y; with weight_norm each
    weight is computed in the graph as v * g (as a weight-normed Conv1d exports), so it is not a constant."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) * 0.1, "b1")]
    nodes = []
    for name, shape in (("w1", (8, 4, 3)), ("w2", (6, 4, 5))):
        v = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if weight_norm:
            inits += [numpy_helper.from_array(v, name + "_v"),
                      numpy_helper.from_array(np.abs(rng.standard_normal((shape[0], 1, 1))).astype(np.float32), name + "_g")]
            nodes.append(helper.make_node("Mul", [name + "_v", name + "_g"], [name]))
        else:
            inits.append(numpy_helper.from_array(v, name))
    bias = [] if weight_norm else ["b1"]  # quantize_dynamic reshapes a bias by its weight's shape: a constant's only
    nodes += [helper.make_node("Conv", ["x", "w1", *bias], ["c1"], pads=[1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
              helper.make_node("Conv", ["r1", "w2"], ["y"], group=2, strides=[2], pads=[2, 2], dilations=[1])]
    g = helper.make_graph(nodes, "conv1d", [helper.make_tensor_value_info("x", T.FLOAT, ["n", 4, "t"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["n", 6, "t2"])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


@pytest.mark.parametrize("weight_norm", [False, True], ids=["constant_weights", "weights_in_graph"])
def test_1d_conv_integer_dequantizes_to_one_tensorrt_graph_matching_the_shipped_model(tmp_path, weight_norm):
    from onnxruntime.quantization import quantize_dynamic

    f32 = conv1d_model(tmp_path / "float.onnx", weight_norm)
    quantize_dynamic(str(f32), str(tmp_path / "dynamic.onnx"), op_types_to_quantize=["Conv"])
    shipped = onnx.load(str(tmp_path / "dynamic.onnx"))
    ops = [n.op_type for n in shipped.graph.node]
    assert ops.count("ConvInteger") == 2, ops
    dql_of = {n.output[0]: n for n in shipped.graph.node if n.op_type == "DynamicQuantizeLinear"}
    for n in (n for n in shipped.graph.node if n.op_type == "ConvInteger"):
        assert n.input[0] in dql_of  # uint8 activations, quantized at run time
        assert (n.input[1] in dql_of) == weight_norm  # weights in the graph: uint8 too, quantized at run time

    deq, stats = trt_from_prequantized(shipped, dequantize_dynamic=True)
    assert stats["dequantized_dynamic"] == 2 and stats["dynamic_left"] == 0, stats
    assert not {"ConvInteger", "DynamicQuantizeLinear"} & {n.op_type for n in deq.graph.node}
    onnx.save(deq, str(tmp_path / "float_from_dynamic.onnx"))

    # the float graph computes what the model as shipped approximates: within dynamic quantization's error of it
    rng = np.random.default_rng(1)
    shipped_s, float_s = ort_session(tmp_path / "dynamic.onnx"), ort_session(tmp_path / "float_from_dynamic.onnx")
    cosines = []
    for t in (16, 64, 127):
        feed = {"x": rng.standard_normal((2, 4, t)).astype(np.float32)}
        a, b = ort_run(shipped_s, feed)["y"], ort_run(float_s, feed)["y"]
        assert a.shape == b.shape
        cosines.append(cosine(a, b))
    assert min(cosines) >= 0.999, cosines

    ins, _ = graph_io(deq)
    feeds = [generated_feeds(ins, [PROFILE], 0, 0)]
    r = plan_from_onnx(tmp_path / "float_from_dynamic.onnx", {"min_subgraph_size": 1, "exclude_ops": [], "strict": False},
                       Backend("tensorrt_rtx"), tmp_path / "plan", feeds)
    assert r.metrics["trt_subgraphs"] == 1 and r.details["fallback_nodes"] == [], (r.metrics, r.details["fallback_nodes"])


def with_int32_bias(m: onnx.ModelProto, own_product: bool = False) -> onnx.ModelProto:
    """quantize_dynamic's Conv with a float bias added after the output scale, rewritten to the form older ONNX Runtime
    quantizers (and models shipped with them, e.g. Kokoro TTS) wrote: the bias rounded at run time to the int32
    product's scale and added before the Cast, Add(ConvInteger, Reshape(Cast(Floor(Div(b, scale_x * scale_w))))).
    ``own_product``: the Div's scale_x * scale_w computed by a Mul of its own (ddddocr's older recognizer)."""
    g = m.graph
    by_out = {o: n for n in g.node for o in n.output}
    for add in [n for n in g.node if n.op_type == "Add" and n.input[0] in by_out and by_out[n.input[0]].op_type == "Mul"]:
        mul = by_out[add.input[0]]
        cast = by_out[mul.input[0]]
        conv = by_out[cast.input[0]]
        reshape = by_out[add.input[1]]
        b, shape, scale = reshape.input[0], reshape.input[1], mul.input[1]
        p = conv.output[0] + "_b"
        own = [helper.make_node("Mul", list(by_out[scale].input)[::-1], [p + "_scale"])] if own_product else []
        nodes = [*own, helper.make_node("Div", [b, p + "_scale" if own else scale], [p + "_div"]), helper.make_node("Floor", [p + "_div"], [p + "_floor"]),
                 helper.make_node("Cast", [p + "_floor"], [p + "_int"], to=T.INT32),
                 helper.make_node("Reshape", [p + "_int", shape], [p + "_reshaped"]),
                 helper.make_node("Add", [conv.output[0], p + "_reshaped"], [p + "_added"])]
        for n in nodes[::-1]:
            g.node.insert(list(g.node).index(cast), n)
        cast.input[0] = p + "_added"
        mul.output[0] = add.output[0]
        g.node.remove(add)
        g.node.remove(reshape)
    return m


@pytest.mark.parametrize("own_product", [False, True])
def test_1d_conv_integer_with_an_int32_bias_before_the_scale_dequantizes(tmp_path, own_product):
    """A Conv1d whose bias is quantized at run time to the output's int32 scale and added before the Cast (80 of a
    shipped TTS model's 87 ConvIntegers; all 21 of ddddocr's older recognizer, whose bias scale is a Mul of its own)
    becomes a float Conv with that bias, within dynamic quantization's error of the model as shipped."""
    from onnxruntime.quantization import quantize_dynamic

    quantize_dynamic(str(conv1d_model(tmp_path / "float.onnx", False)), str(tmp_path / "dynamic.onnx"),
                     op_types_to_quantize=["Conv"])
    shipped = with_int32_bias(onnx.load(str(tmp_path / "dynamic.onnx")), own_product)
    onnx.save(shipped, str(tmp_path / "int32_bias.onnx"))
    conv = next(n for n in shipped.graph.node if n.op_type == "ConvInteger" and n.output[0].startswith("c1"))
    assert [n.op_type for n in shipped.graph.node if conv.output[0] in n.input] == ["Add"]  # the bias before the Cast

    deq, stats = trt_from_prequantized(shipped, dequantize_dynamic=True)
    assert stats["dequantized_dynamic"] == 2 and stats["dynamic_left"] == 0, stats
    ops = [n.op_type for n in deq.graph.node]
    assert not {"ConvInteger", "DynamicQuantizeLinear", "Floor"} & set(ops), ops
    convs = [n for n in deq.graph.node if n.op_type == "Conv"]
    assert sorted(len(n.input) for n in convs) == [2, 3]  # the bias is the float Conv's own, b1
    assert "b1" in next(n for n in convs if len(n.input) == 3).input
    onnx.save(deq, str(tmp_path / "float_from_dynamic.onnx"))

    rng = np.random.default_rng(2)
    shipped_s, float_s = ort_session(tmp_path / "int32_bias.onnx"), ort_session(tmp_path / "float_from_dynamic.onnx")
    exact = ort_session(tmp_path / "float.onnx")
    for t in (16, 100):
        feed = {"x": rng.standard_normal((2, 4, t)).astype(np.float32)}
        a, b, f = ort_run(shipped_s, feed)["y"], ort_run(float_s, feed)["y"], ort_run(exact, feed)["y"]
        assert cosine(a, b) >= 0.999, cosine(a, b)
        assert cosine(b, f) >= 0.9995, cosine(b, f)  # the float model it was quantized from (weights rounded to 8 bits)


def test_what_is_left_native_is_said_with_the_reason(tmp_path):
    """A ConvInteger whose weight zero point is computed in the graph is not the quantize_dynamic pattern: it stays
    native (never dequantized with a guessed zero point) and the reason is recorded."""
    from onnxruntime.quantization import quantize_dynamic

    quantize_dynamic(str(conv1d_model(tmp_path / "float.onnx", False)), str(tmp_path / "dynamic.onnx"),
                     op_types_to_quantize=["Conv"])
    m = onnx.load(str(tmp_path / "dynamic.onnx"))
    conv = next(n for n in m.graph.node if n.op_type == "ConvInteger")
    m.graph.node.insert(0, helper.make_node("Identity", [conv.input[3]], [conv.input[3] + "_copy"]))
    conv.input[3] += "_copy"
    deq, stats = trt_from_prequantized(m, dequantize_dynamic=True)
    assert stats["dequantized_dynamic"] == 1 and stats["dynamic_left"] == 2, stats  # its ConvInteger and its DQL
    assert list(stats["dynamic_left_why"].values()) == ["its weight zero point is not a constant"], stats


def test_with_the_flag_set_nothing_recommends_it_and_what_was_left_is_said(tmp_path):
    """Dynamic quantization model.dequantize_dynamic=true cannot dequantize (here: every ConvInteger of a Conv1d chain
    with a weight zero point computed in the graph) stays native; the partition's fragmentation warning and the int8
    refusal say what was left and why, and never recommend the flag that is already set."""
    from onnxruntime.quantization import quantize_dynamic

    from tasks.common.errors import ConfigError
    from tasks.prequant.detect import precision_for, quantization_of

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(6):
        inits.append(numpy_helper.from_array((rng.standard_normal((4, 4, 3)) * 0.3).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="out"))
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", T.FLOAT, ["n", 4, "t"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["n", 4, "t"])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "float.onnx"))
    quantize_dynamic(str(tmp_path / "float.onnx"), str(tmp_path / "dynamic.onnx"), op_types_to_quantize=["Conv"])
    m = onnx.load(str(tmp_path / "dynamic.onnx"))
    for conv in [n for n in m.graph.node if n.op_type == "ConvInteger"]:
        m.graph.node.insert(0, helper.make_node("Identity", [conv.input[3]], [conv.input[3] + "_copy"]))
        conv.input[3] += "_copy"
    q = quantization_of(m)
    deq, stats = trt_from_prequantized(m, dequantize_dynamic=True)
    assert stats["dequantized_dynamic"] == 0 and stats["dynamic_left"] == 12, stats
    onnx.save(deq, str(tmp_path / "left.onnx"))

    ins, _ = graph_io(deq)
    r = plan_from_onnx(tmp_path / "left.onnx", {"min_subgraph_size": 1, "exclude_ops": [], "strict": False},
                       Backend("tensorrt_rtx"), tmp_path / "plan", [generated_feeds(ins, [PROFILE], 0, 0)],
                       stats["dynamic_left_why"])
    warning = next(w for w in r.details["warnings"] if "fragmented" in w)
    assert "model.dequantize_dynamic=true left native" in warning, warning
    assert "6 because its weight zero point is not a constant" in warning, warning
    assert "builds them as float layers" not in warning and "dynamic_left_why" in warning, warning

    with pytest.raises(ConfigError) as e:
        precision_for({**q, **stats}, "int8")
    assert "model.dequantize_dynamic=true left 12" in e.value.message, e.value.message
    assert "set model.dequantize_dynamic=true" not in e.value.fix and "precision=fp16" in e.value.fix, e.value.fix
