"""What the graph shows an input means (tasks/graph/meaning.py), and random inputs drawn in that domain
(tasks/data/inputs.py), run through the tiny models in ONNX Runtime."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP, helper as oh, numpy_helper as nh

from tasks.data.inputs import generated_feeds
from tasks.data.profiles import shape_rules
from tasks.graph.meaning import input_domains
from tasks.graph.models import graph_io

VOCAB, TYPES, D = 50, 2, 8


def _model(nodes, inputs, outputs, inits):
    g = oh.make_graph(nodes, "m", inputs, outputs, inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _run(m, feed):
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)


def tiny_transformer(mask: str):
    """Embeddings of input_ids and token_type_ids, self-attention scores masked by ``mask``: ``bool`` (Where(mask, s,
    -inf), True valid), ``padding`` (Where(key_padding_mask, -inf, s), True padded, PyTorch's convention) or ``int``
    (Hugging Face's (1 - mask) * -1e9 added to the scores)."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((VOCAB, D)).astype(np.float32), "word"),
             nh.from_array(rng.standard_normal((TYPES, D)).astype(np.float32), "types"),
             nh.from_array(np.array([1], np.int64), "ax1"), nh.from_array(np.array([2], np.int64), "ax2")]
    nodes = [oh.make_node("Gather", ["word", "input_ids"], ["we"]), oh.make_node("Gather", ["types", "token_type_ids"], ["te"]),
             oh.make_node("Add", ["we", "te"], ["h"]), oh.make_node("Transpose", ["h"], ["ht"], perm=[0, 2, 1]),
             oh.make_node("MatMul", ["h", "ht"], ["scores"])]
    if mask == "int":
        inits += [nh.from_array(np.array(1.0, np.float32), "one"), nh.from_array(np.array(-1e9, np.float32), "big")]
        nodes += [oh.make_node("Unsqueeze", ["mask", "ax1"], ["m3"]), oh.make_node("Cast", ["m3"], ["mf"], to=TP.FLOAT),
                  oh.make_node("Sub", ["one", "mf"], ["inv"]), oh.make_node("Mul", ["inv", "big"], ["fill"]),
                  oh.make_node("Add", ["scores", "fill"], ["masked"])]
        mask_t = TP.INT64
    else:
        inits.append(nh.from_array(np.array(-np.inf, np.float32), "ninf"))
        branches = ["scores", "ninf"] if mask == "bool" else ["ninf", "scores"]
        nodes += [oh.make_node("Unsqueeze", ["mask", "ax1"], ["m3"]), oh.make_node("Where", ["m3", *branches], ["masked"])]
        mask_t = TP.BOOL
    nodes.append(oh.make_node("Softmax", ["masked"], ["attn"], axis=-1))
    ins = [oh.make_tensor_value_info("input_ids", TP.INT64, ["batch", "seq"]),
           oh.make_tensor_value_info("token_type_ids", TP.INT64, ["batch", "seq"]),
           oh.make_tensor_value_info("mask", mask_t, ["batch", "seq"])]
    return _model(nodes, ins, [oh.make_tensor_value_info("attn", TP.FLOAT, ["batch", "seq", "seq"])], inits)


SEQ_PROFILE = [{n: {"min": [1, 4], "opt": [2, 16], "max": [4, 32]} for n in ("input_ids", "token_type_ids", "mask")}]


@pytest.mark.parametrize("mask, valid", [("bool", 1), ("padding", 0), ("int", 1)])
def test_a_transformer_gets_ids_inside_its_tables_and_masks_that_never_pad_everything(mask, valid):
    m = tiny_transformer(mask)
    inputs, _ = graph_io(m)
    d = input_domains(m, [t.name for t in inputs])
    assert (d["input_ids"].kind, d["input_ids"].high) == ("ids", VOCAB)
    assert (d["token_type_ids"].kind, d["token_type_ids"].high) == ("ids", TYPES)
    assert (d["mask"].kind, d["mask"].valid) == ("mask", valid)
    rules = shape_rules(inputs, SEQ_PROFILE, m)
    feeds = generated_feeds(inputs, SEQ_PROFILE, 20, 0, rules=rules)
    assert len(feeds) == 23
    for f in feeds:
        ids, types, mk = f["input_ids"], f["token_type_ids"], f["mask"]
        assert ids.dtype == np.int64 and 0 <= ids.min() and ids.max() < VOCAB and 0 <= types.min() and types.max() < TYPES
        keep = (mk == valid) if mask != "padding" else ~mk
        assert keep[:, 0].all() and keep[0].all(), mk  # valid from the start; the first row whole
        assert (np.diff(keep.astype(int), axis=1) <= 0).all()  # padding only at the end
        assert np.isfinite(_run(m, f)[0]).all()  # no row masked whole: no NaN from the softmax
    assert max(f["input_ids"].max() for f in feeds) > 1  # the vocabulary, not 0 and 1
    assert any((f["mask"] != f["mask"][:, :1]).any() for f in feeds)  # some rows padded
    if mask != "int":  # the model does go NaN on a mask that pads everything (what coin flips can draw)
        assert not np.isfinite(_run(m, {**feeds[0], "mask": np.full_like(feeds[0]["mask"], mask == "padding")})[0]).all()


def test_a_noise_level_taken_by_log_is_positive_and_lengths_bounded_by_a_range_are_valid():
    """A diffusion step: Log(sigma) scales x; a length input builds the padding mask arange(T) < lengths."""
    inits = [nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array(1, np.int64), "one"),
             nh.from_array(np.array([1], np.int64), "ax1"), nh.from_array(np.array([1, 2], np.int64), "ax12")]
    nodes = [oh.make_node("Log", ["sigma"], ["ls"]), oh.make_node("Unsqueeze", ["ls", "ax12"], ["ls3"]),
             oh.make_node("Mul", ["x", "ls3"], ["y"]),
             oh.make_node("Shape", ["x"], ["xs"]), oh.make_node("Gather", ["xs", "one"], ["t"], axis=0),
             oh.make_node("Range", ["zero", "t", "one"], ["pos"]), oh.make_node("Unsqueeze", ["lengths", "ax1"], ["l2"]),
             oh.make_node("Less", ["pos", "l2"], ["valid"]), oh.make_node("Cast", ["valid"], ["vf"], to=TP.FLOAT),
             oh.make_node("Unsqueeze", ["vf", "ax1"], ["v3"]), oh.make_node("Transpose", ["v3"], ["v3t"], perm=[0, 2, 1]),
             oh.make_node("Mul", ["y", "v3t"], ["out"])]
    ins = [oh.make_tensor_value_info("x", TP.FLOAT, ["b", "t", 4]), oh.make_tensor_value_info("sigma", TP.FLOAT, ["b"]),
           oh.make_tensor_value_info("lengths", TP.INT64, ["b"])]
    m = _model(nodes, ins, [oh.make_tensor_value_info("out", TP.FLOAT, ["b", "t", 4])], inits)
    inputs, _ = graph_io(m)
    d = input_domains(m, [t.name for t in inputs])
    assert set(d) == {"sigma", "lengths"} and d["sigma"].kind == "positive" and d["lengths"].kind == "length"
    assert d["lengths"].of == ("x", 1)  # the Range spans x's axis 1
    prof = [{"x": {"min": [1, 2, 4], "opt": [2, 8, 4], "max": [4, 16, 4]}, "sigma": {"min": [1], "opt": [2], "max": [4]},
             "lengths": {"min": [1], "opt": [2], "max": [4]}}]
    feeds = generated_feeds(inputs, prof, 10, 0, rules=shape_rules(inputs, prof, m))
    for f in feeds:
        t = f["x"].shape[1]
        assert (f["sigma"] > 0).all() and f["lengths"].dtype == np.int64
        assert (1 <= f["lengths"]).all() and (f["lengths"] <= t).all() and f["lengths"][0] == t
        assert np.isfinite(_run(m, f)[0]).all()


def test_a_graphs_edges_index_its_nodes():
    """A message-passing step: x [N, F] gathered at edge_index [2, E]; the edges point at nodes that exist."""
    inits = [nh.from_array(np.array(0, np.int64), "src"), nh.from_array(np.array(1, np.int64), "dst")]
    nodes = [oh.make_node("Gather", ["edge_index", "src"], ["s"], axis=0), oh.make_node("Gather", ["edge_index", "dst"], ["t"], axis=0),
             oh.make_node("Gather", ["x", "s"], ["xs"], axis=0), oh.make_node("Gather", ["x", "t"], ["xt"], axis=0),
             oh.make_node("Sub", ["xs", "xt"], ["msg"])]
    ins = [oh.make_tensor_value_info("x", TP.FLOAT, ["nodes", 4]), oh.make_tensor_value_info("edge_index", TP.INT64, [2, "edges"])]
    m = _model(nodes, ins, [oh.make_tensor_value_info("msg", TP.FLOAT, ["edges", 4])], inits)
    inputs, _ = graph_io(m)
    d = input_domains(m, ["x", "edge_index"])
    assert list(d) == ["edge_index"] and d["edge_index"].of == ("x", 0)
    prof = [{"x": {"min": [2, 4], "opt": [10, 4], "max": [40, 4]}, "edge_index": {"min": [2, 1], "opt": [2, 20], "max": [2, 80]}}]
    feeds = generated_feeds(inputs, prof, 6, 0, rules=shape_rules(inputs, prof, m))
    assert all(f["edge_index"].max() < f["x"].shape[0] for f in feeds)
    assert max(f["edge_index"].max() for f in feeds) > 1
    for f in feeds:
        _run(m, f)


def test_the_data_notes_say_what_was_inferred():
    from tasks.data.datasets import split_data

    m = tiny_transformer("bool")
    inputs, _ = graph_io(m)
    rules = shape_rules(inputs, SEQ_PROFILE, m)
    s = split_data(inputs=inputs, profiles=SEQ_PROFILE, rules=rules, calibrate=True, search=True, validate=True)
    for ds in (s.calibration, s.search, s.validation):
        note = next(n for n in ds.notes if "domain the graph shows" in n)
        assert "input_ids: ids in [0, 50), as it indexes an embedding table of 50 rows" in note, note
        assert "mask: masks valid (True) from the start" in note and "selects a Where" in note
    assert s.validation.key["rules"]["domains"]["input_ids"]["high"] == VOCAB  # part of the cache key


def test_a_float_compared_with_zero_is_no_mask_and_an_image_keeps_its_noise():
    """A hand-written leaky ReLU, Where(x > 0, x, 0.1 x), and x / 255: x is an image, not a mask nor positive."""
    inits = [nh.from_array(np.array(0.0, np.float32), "zero"), nh.from_array(np.array(0.1, np.float32), "slope"),
             nh.from_array(np.array(255.0, np.float32), "s")]
    nodes = [oh.make_node("Div", ["x", "s"], ["xs"]), oh.make_node("Greater", ["xs", "zero"], ["pos"]),
             oh.make_node("Mul", ["xs", "slope"], ["neg"]), oh.make_node("Where", ["pos", "xs", "neg"], ["y"])]
    m = _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, ["n", 3])],
               [oh.make_tensor_value_info("y", TP.FLOAT, ["n", 3])], inits)
    assert input_domains(m, ["x"]) == {}


def tiny_speech(sink: str):
    """A TTS length regulator: each token's duration round(sigmoid(x) * base / speed), clipped to >= 1, summed: the
    audio's length, made by ``sink`` (``range``: Range(0, total); ``fill``: ConstantOfShape(total)); x[1, T] stands for
    the duration predictor's logits (a network's output: its values are no size the graph shows)."""
    inits = [nh.from_array(np.array([4.0], np.float32), "base"), nh.from_array(np.array(1.0, np.float32), "lo"),
             nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array(1, np.int64), "one_i"),
             nh.from_array(np.array([0], np.int64), "ax0")]
    nodes = [oh.make_node("Div", ["base", "speed"], ["per"]), oh.make_node("Sigmoid", ["x"], ["p"]),
             oh.make_node("Mul", ["p", "per"], ["dur_f"]),
             oh.make_node("Round", ["dur_f"], ["dr"]), oh.make_node("Clip", ["dr", "lo"], ["dc"]),
             oh.make_node("Cast", ["dc"], ["d"], to=TP.INT64), oh.make_node("ReduceSum", ["d"], ["total"], keepdims=0)]
    if sink == "range":
        nodes += [oh.make_node("Range", ["zero", "total", "one_i"], ["audio_i"]),
                  oh.make_node("Cast", ["audio_i"], ["audio"], to=TP.FLOAT)]
    else:
        nodes += [oh.make_node("Unsqueeze", ["total", "ax0"], ["shape"]),
                  oh.make_node("ConstantOfShape", ["shape"], ["audio"],
                               value=nh.from_array(np.array([0.5], np.float32)))]
    ins = [oh.make_tensor_value_info("x", TP.FLOAT, [1, "t"]), oh.make_tensor_value_info("speed", TP.FLOAT, [1])]
    return _model(nodes, ins, [oh.make_tensor_value_info("audio", TP.FLOAT, ["samples"])], inits)


@pytest.mark.parametrize("sink", ["range", "fill"])
def test_an_input_whose_value_sets_an_output_s_length_is_drawn_near_1_so_the_shapes_stay_bounded(sink):
    """speed divides the durations that set the audio's length: drawn in [1/SIZE_SPAN, SIZE_SPAN] (not near 0, which
    makes the output, and the memory to run it, without bound); the data notes say why."""
    from tasks.graph.meaning import SIZE_SPAN

    m = tiny_speech(sink)
    inputs, _ = graph_io(m)
    d = input_domains(m, ["x", "speed"])
    assert list(d) == ["speed"] and d["speed"].kind == "size"
    assert ("Range" if sink == "range" else "ConstantOfShape") in d["speed"].why
    assert "Div -> Mul -> Round -> Clip -> Cast -> ReduceSum" in d["speed"].why
    prof = [{"x": {"min": [1, 4], "opt": [1, 16], "max": [1, 32]}, "speed": {"min": [1], "opt": [1], "max": [1]}}]
    rules = shape_rules(inputs, prof, m)
    feeds = generated_feeds(inputs, prof, 200, 0, rules=rules)
    speeds = np.concatenate([f["speed"] for f in feeds])
    assert (speeds >= 1 / SIZE_SPAN).all() and (speeds <= SIZE_SPAN).all() and speeds.std() > 0.1
    for f in feeds[:20]:  # the length the model makes stays within SIZE_SPAN of its length at speed 1
        p = 1 / (1 + np.exp(-f["x"]))
        at_1 = np.clip(np.round(p * 4.0), 1, None).sum()
        assert _run(m, f)[0].size <= SIZE_SPAN * at_1 + p.size
    from tasks.data.datasets import split_data
    s = split_data(inputs=inputs, profiles=prof, rules=rules, calibrate=False, search=False, validate=True)
    note = next(n for n in s.validation.notes if "domain the graph shows" in n)
    assert "speed: values near 1 (log-uniform in [0.67, 1.5]: shapes bounded), as its value sets the size of" in note


def test_user_ids_outside_the_table_the_graph_shows_are_refused_before_any_work(tmp_path):
    """calibration.data whose token ids pass the embedding's rows: bad input (exit 2) naming the input, the ids found,
    the table and the fix, instead of ONNX Runtime failing on the Gather mid-stage."""
    from tasks.common.errors import ConfigError
    from tasks.data.inputs import load_data

    m = tiny_transformer("bool")
    inputs, _ = graph_io(m)
    rules = shape_rules(inputs, SEQ_PROFILE, m)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (3, 16)).astype(np.int64)
    feed = {"input_ids": ids, "token_type_ids": np.zeros_like(ids), "mask": np.ones((3, 16), bool)}
    np.savez(tmp_path / "ok.npz", **feed)
    assert load_data(str(tmp_path / "ok.npz"), inputs, SEQ_PROFILE, "calibration.data", rules=rules)[0]
    ids[1, 3] = VOCAB + 7
    np.savez(tmp_path / "bad.npz", **{**feed, "input_ids": ids})
    with pytest.raises(ConfigError) as e:
        load_data(str(tmp_path / "bad.npz"), inputs, SEQ_PROFILE, "calibration.data", rules=rules)
    assert e.value.exit_code == 2
    assert f"input 'input_ids' holds ids from 0 to {VOCAB + 7}, outside [0, {VOCAB}): it indexes an embedding table" \
        in e.value.message and f"[0, {VOCAB})" in e.value.fix
