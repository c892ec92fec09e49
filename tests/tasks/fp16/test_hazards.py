"""fp16_hazards_from_data on hand-built graphs: values beyond fp16's range on the user's data (a mel front end at
16-bit audio scale) and cancelling subtractions (a LayerNorm's variance as a difference of moments), and the fp16
graphs built with what it finds."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from tasks.accuracy.metrics import cosine as _cosine
from tests.tasks.fp16.test_convert import MIN_COSINE

ort = pytest.importorskip("onnxruntime")


def test_values_beyond_fp16s_range_on_the_data_keep_their_nodes_fp32(tmp_path):
    """A mel front end fed audio at 16-bit scale: naive fp16 overflows (inf); judged on the data, the filter bank and
    the power stay fp32 and the fp16 graph matches fp32. On random values in [0, 1) nothing would have overflowed."""
    import onnxruntime as ort

    from tasks.engines.build import onnx_at_precision
    from tasks.onnxrt.emulate import fp16_rounded
    from tasks.fp16.hazards import fp16_hazards_from_data
    from tests.conftest import audio_16bit, make_audio_power_model

    path = make_audio_power_model(tmp_path / "mel.onnx")
    x = audio_16bit(4)
    keep, _ = fp16_hazards_from_data(onnx.load(str(path)), [{"x": x[:2]}, {"x": x[2:]}])
    assert {"bank", "power", "power_eps"} <= set(keep) and "logmel" not in keep and "x" not in keep, keep
    assert fp16_hazards_from_data(onnx.load(str(path)), [{"x": np.random.default_rng(0).random((2, 1, 256), np.float32)}])[0] == {}

    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    def emulated(p):  # ONNX Runtime's own CPU execution computes these fp16 ops in fp32: it would hide the overflow
        return ort.InferenceSession(fp16_rounded(onnx.load(str(p))).SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    naive = onnx_at_precision(path, "fp16", tmp_path / "naive.onnx").files["onnx"]
    plain = ort.InferenceSession(str(naive), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert _cosine(ref, plain) > 0.9999  # ONNX Runtime alone: looks fine
    out = emulated(naive)
    assert not np.isfinite(out).all() or _cosine(ref, out) < 0.9  # what TensorRT would compute: inf
    r = onnx_at_precision(path, "fp16", tmp_path / "ranged.onnx", keep)
    assert {"filterbank", "power", "log"} <= set(r.details["data_range"]), r.details["data_range"]
    assert _cosine(ref, emulated(r.files["onnx"])) >= MIN_COSINE


def _layernorm_model(path, variance: str):
    """x (N, 64) -> LayerNorm over the last axis -> MatMul. variance "moments": E[x^2] - E[x]^2 (Flax's LayerNorm, as
    jax2tf exports it: ReduceSum x 1/n, Square, Sub, Max(., 0), + eps, Sqrt, Reciprocal); "centered": E[(x - mean)^2]."""
    rng = np.random.default_rng(1)
    n = 64
    inits = [nh.from_array(np.array([-1], np.int64), "axes"), nh.from_array(np.float32(1.0 / n), "inv_n"),
             nh.from_array(np.float32(1e-6), "eps"), nh.from_array(np.float32(0.0), "zero"),
             nh.from_array((rng.standard_normal((n, 16)) * 0.1).astype(np.float32), "w")]
    nodes = [oh.make_node("ReduceSum", ["x", "axes"], ["sum"]), oh.make_node("Mul", ["sum", "inv_n"], ["mean"]),
             oh.make_node("Sub", ["x", "mean"], ["centered"])]
    if variance == "moments":
        nodes += [oh.make_node("Mul", ["x", "x"], ["sq"]), oh.make_node("ReduceSum", ["sq", "axes"], ["sum_sq"]),
                  oh.make_node("Mul", ["sum_sq", "inv_n"], ["mean_sq"]), oh.make_node("Mul", ["mean", "mean"], ["sq_mean"]),
                  oh.make_node("Sub", ["mean_sq", "sq_mean"], ["var_raw"]), oh.make_node("Max", ["var_raw", "zero"], ["var"])]
    else:
        nodes += [oh.make_node("Mul", ["centered", "centered"], ["sq"]), oh.make_node("ReduceSum", ["sq", "axes"], ["sum_sq"]),
                  oh.make_node("Mul", ["sum_sq", "inv_n"], ["var"])]
    nodes += [oh.make_node("Add", ["var", "eps"], ["var_eps"]), oh.make_node("Sqrt", ["var_eps"], ["std"]),
              oh.make_node("Reciprocal", ["std"], ["inv_std"]), oh.make_node("Mul", ["centered", "inv_std"], ["normed"]),
              oh.make_node("MatMul", ["normed", "w"], ["y"])]
    g = oh.make_graph(nodes, "ln", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", n])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 16])], inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _offset_rows(rows: int) -> np.ndarray:
    """Activations far from zero with a small spread per row (an embedding's output): the mean dominates E[x^2]."""
    rng = np.random.default_rng(2)
    return (2.0 + rng.standard_normal((rows, 1)) * 0.5 + rng.standard_normal((rows, 64)) * 0.01).astype(np.float32)


def test_a_variance_taken_as_a_difference_of_moments_is_computed_in_fp32(tmp_path):
    """E[x^2] - E[x]^2 of values far from zero cancels: fp16 operands leave the variance mostly rounding error, which
    1/sqrt(var + eps) blows up (measured on Magika, a jax2tf export: cosine 0.67 naive), and so does x - mean. Judged
    on the data, the moments and the differences are computed in fp32 from the input; the MatMul stays fp16."""
    from tasks.engines.build import onnx_at_precision
    from tasks.onnxrt.emulate import fp16_rounded
    from tasks.fp16.hazards import fp16_hazards_from_data

    path = _layernorm_model(tmp_path / "ln.onnx", "moments")
    x = _offset_rows(32)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    def emulated(p):  # what TensorRT's fp16 network stores between layers
        return ort.InferenceSession(fp16_rounded(onnx.load(str(p))).SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    naive = onnx_at_precision(path, "fp16", tmp_path / "naive.onnx").files["onnx"]
    assert _cosine(ref, emulated(naive)) < 0.99
    keep, cancel = fp16_hazards_from_data(onnx.load(str(path)), [{"x": x[:8]}, {"x": x[8:]}])
    assert keep == {}
    # the variance's two moments and their difference; x - mean too (x, the graph input, is read in fp32 by it)
    assert set(cancel) == {"var_raw", "mean_sq", "sum_sq", "sq", "sq_mean", "mean", "sum", "centered"}, cancel
    assert all(v > 0.01 for v in cancel.values())
    r = onnx_at_precision(path, "fp16", tmp_path / "kept.onnx", keep, cancel)
    assert set(r.details["cancellation"]) and r.details["fp32_reasons"].get("cancellation") == len(cancel)
    assert _cosine(ref, emulated(r.files["onnx"])) >= MIN_COSINE
    fp16 = onnx.load(str(r.files["onnx"]))
    assert next(t for t in fp16.graph.initializer if t.name.startswith("w")).data_type == TP.FLOAT16  # MatMul: fp16


def test_a_centered_variance_and_data_near_zero_keep_everything_fp16(tmp_path):
    """No false alarm on activations of the usual kind (centred near zero, unit spread): neither LayerNorm form cancels."""
    from tasks.fp16.hazards import fp16_hazards_from_data

    zero_mean = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    for variance in ("centered", "moments"):
        path = _layernorm_model(tmp_path / f"{variance}.onnx", variance)
        assert fp16_hazards_from_data(onnx.load(str(path)), [{"x": zero_mean}]) == ({}, {}), variance


@pytest.mark.parametrize("mask", ["bool", "int"])
def test_a_masked_fill_before_the_softmax_keeps_nothing_fp32(tmp_path, mask):
    """Attention scores masked with Where(mask, s, -inf) or + (1 - mask) * -1e9 before the Softmax: the fill is no
    reason to keep a node fp32 (fp16 zeroes those positions alike), and the fp16 graph matches fp32 on the masks."""
    import onnxruntime as ort

    from tasks.data.inputs import generated_feeds
    from tasks.data.profiles import shape_rules
    from tasks.engines.build import onnx_at_precision
    from tasks.fp16.hazards import fp16_hazards_from_data
    from tasks.graph.models import graph_io
    from tasks.onnxrt.emulate import fp16_rounded
    from tests.tasks.graph.test_meaning import SEQ_PROFILE, tiny_transformer

    m = tiny_transformer(mask)
    path = tmp_path / "attn.onnx"
    onnx.save(m, str(path))
    inputs, _ = graph_io(m)
    feeds = generated_feeds(inputs, SEQ_PROFILE, 4, 0, rules=shape_rules(inputs, SEQ_PROFILE, m))
    for f in feeds:  # every sample padded (the range check reads each feed's first)
        f["mask"][:, -1:] = 0
    assert all((f["mask"][:, 0] == 1).all() for f in feeds)  # never padded whole
    keep, _ = fp16_hazards_from_data(m, feeds)
    assert not {"masked", "attn", "scores", "fill"} & set(keep), keep
    r = onnx_at_precision(path, "fp16", tmp_path / "fp16.onnx", keep)
    sess = ort.InferenceSession(fp16_rounded(onnx.load(str(r.files["onnx"]))).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for f in feeds:
        out, want = sess.run(None, f)[0], ref.run(None, f)[0]
        assert np.isfinite(out).all() and _cosine(want, out) >= MIN_COSINE
    big = {"input_ids": feeds[0]["input_ids"], "token_type_ids": feeds[0]["token_type_ids"], "mask": feeds[0]["mask"]}
    scaled = onnx.load(str(path))  # scores beyond fp16's range on both sides are still kept fp32
    for t in scaled.graph.initializer:
        if t.name == "word":
            t.CopyFrom(nh.from_array(nh.to_array(t) * 200.0, "word"))
    assert "scores" in fp16_hazards_from_data(scaled, [big])[0]


def test_values_too_large_to_expose_at_once_are_judged_in_parts_with_the_same_verdicts(tmp_path, monkeypatch):
    """A model whose float values take more than EXPOSED_MIB on a feed is run in parts (every exposed value stays alive
    until its run ends); each subtraction's operands and result share a part, so range and cancellation verdicts are
    those of one run exposing everything."""
    import tasks.fp16.hazards as hazards

    path = _layernorm_model(tmp_path / "ln.onnx", "moments")
    m = onnx.load(str(path))
    x = _offset_rows(32) * np.float32(3e4)  # values beyond fp16's range as well as cancelling moments
    feeds = [{"x": x[:8]}, {"x": x[8:]}]
    whole = hazards.fp16_hazards_from_data(m, feeds, underflow=True)
    assert whole[0] and whole[1], whole  # both checks have something to say
    floats = hazards._float_values(m.graph)
    subs = [n for n in m.graph.node if n.op_type in ("Sub", "Add") and len(n.input) == 2 and all(n.input)]
    assert [p for p, _ in hazards._exposed_runs(m, floats, subs, feeds)] == [floats]  # small: one part, one run per feed
    # sizes from shape inference, without a run, are those of ONNX Runtime's profile of a run
    samples = [{"x": f["x"][:1]} for f in feeds]
    static = hazards._static_sizes(m, floats, samples)
    assert static is not None and static == hazards._profiled_sizes(m, floats, samples, feeds)
    assert all(v > 0 for v in static.values())
    monkeypatch.setattr(hazards, "EXPOSED_MIB", 0)  # every group of values in a part of its own
    parts = [p for p, _ in hazards._exposed_runs(m, floats, subs, feeds)]
    assert len(parts) > 2 and sorted(sum(parts, [])) == sorted(floats)
    for n in subs:  # a subtraction's three values together
        assert len({i for i, p in enumerate(parts) for v in (*n.input, n.output[0]) if v in p}) == 1, n.output[0]
    assert hazards.fp16_hazards_from_data(m, feeds, underflow=True) == whole



def test_only_the_feeds_whose_values_do_not_fit_run_in_parts(tmp_path, monkeypatch):
    """A feed whose values fit in EXPOSED_MIB runs once with every value exposed, whatever a larger feed of the same
    check needs (PP-OCRv4 det's fp16 check: pages of 32x32 to 1280x1280, 12 runs in 3 parts, 6 now); the verdicts are
    those of every value exposed at once."""
    import tasks.fp16.hazards as hazards

    nodes = [oh.make_node("Neg", ["x"], ["n"]), oh.make_node("Abs", ["n"], ["a"]),
             oh.make_node("Sub", ["x", "a"], ["d"]), oh.make_node("Mul", ["d", "d"], ["y"])]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [1, "n"])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [1, "n"])])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    rng = np.random.default_rng(0)
    small = {"x": rng.standard_normal((1, 16)).astype(np.float32) * 4e4}  # beyond fp16's range: a verdict to keep
    large = {"x": rng.standard_normal((1, 1 << 19)).astype(np.float32)}  # 2 MiB a value
    feeds = [small, large, small]
    whole = hazards.fp16_hazards_from_data(m, feeds, underflow=True)
    assert whole[0], whole
    monkeypatch.setattr(hazards, "EXPOSED_MIB", 1)
    floats = hazards._float_values(m.graph)
    subs = [n for n in m.graph.node if n.op_type == "Sub"]
    runs = hazards._exposed_runs(m, floats, subs, feeds)
    assert runs[0] == (floats, [small, small]) and len(runs) > 2  # the small feeds: one run each, every value
    assert all(fs == [large] for _, fs in runs[1:]) and sorted(sum((p for p, _ in runs[1:]), [])) == sorted(floats)
    assert hazards.fp16_hazards_from_data(m, feeds, underflow=True) == whole
