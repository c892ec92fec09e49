"""fp16 under the accuracy budget: the faithful emulation inside control flow, the search that keeps
the few nodes fp16 cannot hold (an autoregressive decoding Loop whose argmax flips), and the underflow guard."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from tasks.onnxrt.emulate import fp16_rounded
from tasks.common.errors import AccuracyError
from tasks.fp16.search import error_growth, fp16_candidates, fp16_within_budget
from tasks.accuracy.metrics import worst_feed_cosine
from tasks.fp16.convert import fp16_from_onnx
from tasks.fp16.hazards import fp16_hazards_from_data

D, STEPS = 16, 12


def _session(m: onnx.ModelProto):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def accumulating_loop(steps: int = 50, inc: float = 1e-4) -> onnx.ModelProto:
    """y = (x + steps * inc), the adds in a Loop: fp16 rounds each step's sum (1 + 1e-4 is 1 in fp16)."""
    body = h.make_graph(
        [h.make_node("Add", ["s_in", "inc"], ["s_add"], name="body_add"),
         h.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
         h.make_node("Identity", ["s_add"], ["s_out"], name="body_out")], "body",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("s_in", T.FLOAT, [1, 4])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []), h.make_tensor_value_info("s_out", T.FLOAT, [1, 4])],
        [nh.from_array(np.full([1, 4], inc, np.float32), "inc")])
    g = h.make_graph(
        [h.make_node("Mul", ["x", "one"], ["x1"], name="pre"),
         h.make_node("Loop", ["n", "c", "x1"], ["s"], body=body, name="loop"),
         h.make_node("Mul", ["s", "one"], ["y"], name="post")], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 4])], [h.make_tensor_value_info("y", T.FLOAT, [1, 4])],
        [nh.from_array(np.array(steps, np.int64), "n"), nh.from_array(np.array(True), "c"),
         nh.from_array(np.ones([1, 4], np.float32), "one")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def decoder(seed: int = 0) -> onnx.ModelProto:
    """A table-structure recognizer's class in small: an encoder (MatMul, Relu, MatMul), then an autoregressive
    decoding Loop that scores two tokens whose logits differ by 1e-4 of their size (fp16 rounds them equal and ArgMax
    takes the first; fp32 the second), feeds the chosen token's embedding back into its state, and emits the state of
    every step; a Softmax over the steps' logits after it."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal([D, D]) / 4).astype(np.float32)
    w2 = (rng.standard_normal([D, D]) / 4).astype(np.float32)
    emb = np.stack([-np.ones(D), np.ones(D)]).astype(np.float32) * 0.5
    body = h.make_graph(
        [h.make_node("ReduceSum", ["h_in"], ["s"], keepdims=1, name="body_sum"),  # [1, 1]
         h.make_node("Mul", ["s", "tie"], ["logits"], name="body_logits"),  # [1, 2]: s * [1, 1 + 1e-4]
         h.make_node("Softmax", ["logits"], ["probs"], axis=-1, name="body_softmax"),
         h.make_node("ArgMax", ["probs"], ["tok"], axis=-1, keepdims=0, name="body_argmax"),  # [1]
         h.make_node("Gather", ["emb", "tok"], ["e"], axis=0, name="body_gather"),  # [1, D]
         h.make_node("Add", ["h_in", "e"], ["h_out"], name="body_feedback"),
         h.make_node("Identity", ["h_out"], ["h_scan"], name="body_scan"),
         h.make_node("Identity", ["logits"], ["l_scan"], name="body_lscan"),
         h.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")], "decode",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("h_in", T.FLOAT, [1, D])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []), h.make_tensor_value_info("h_out", T.FLOAT, [1, D]),
         h.make_tensor_value_info("h_scan", T.FLOAT, [1, D]), h.make_tensor_value_info("l_scan", T.FLOAT, [1, 2])],
        [nh.from_array(np.array([[1.0, 1.0 + 1e-4]], np.float32), "tie"), nh.from_array(emb, "emb")])
    g = h.make_graph(
        [h.make_node("MatMul", ["x", "w1"], ["a"], name="enc_mm1"),
         h.make_node("Relu", ["a"], ["r"], name="enc_relu"),
         h.make_node("MatMul", ["r", "w2"], ["b"], name="enc_mm2"),
         h.make_node("Add", ["b", "bias"], ["h0"], name="enc_bias"),
         h.make_node("Loop", ["n", "c", "h0"], ["h_last", "states", "logit_seq"], body=body, name="decode_loop"),
         h.make_node("Softmax", ["logit_seq"], ["token_probs"], axis=-1, name="out_softmax"),
         h.make_node("Reshape", ["states", "shape"], ["seq"], name="out_reshape")], "decoder",
        [h.make_tensor_value_info("x", T.FLOAT, [1, D])],
        [h.make_tensor_value_info("seq", T.FLOAT, [STEPS, D]), h.make_tensor_value_info("token_probs", T.FLOAT, [STEPS, 1, 2])],
        [nh.from_array(w1, "w1"), nh.from_array(w2, "w2"), nh.from_array(np.full([1, D], 1.0, np.float32), "bias"),
         nh.from_array(np.array(STEPS, np.int64), "n"), nh.from_array(np.array(True), "c"),
         nh.from_array(np.array([STEPS, D], np.int64), "shape")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _feeds(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal([1, D]) * 0.5).astype(np.float32)} for _ in range(n)]


def test_emulation_rounds_inside_a_loop_body():
    m = accumulating_loop()
    m16, _ = fp16_from_onnx(m)
    x = np.ones([1, 4], np.float32)
    got = _session(fp16_rounded(m16)).run(None, {"x": x})[0]
    want = np.float16(1.0)
    for _ in range(50):
        want = np.float16(want + np.float16(1e-4))
    ref = _session(m).run(None, {"x": x})[0]
    assert np.all(got == np.float32(want)) and float(want) == 1.0  # every step's sum rounded, as fp16 stores it
    assert np.allclose(ref, 1.005, atol=1e-5)  # fp32 accumulates


def _cosine(model16, fp32, feeds):
    from tasks.onnxrt.emulate import precision_runner

    run = precision_runner(model16)[0]
    ref = _session(fp32)
    names = [o.name for o in fp32.graph.output]
    return worst_feed_cosine([run(f) for f in feeds], [dict(zip(names, ref.run(names, f))) for f in feeds])


def test_fp16_search_keeps_the_decoding_loop_fp32(tmp_path):
    m = decoder()
    path = tmp_path / "decoder.onnx"
    onnx.save(m, str(path))
    held, unseen = _feeds(4, 1), _feeds(6, 2)
    plain, _ = fp16_from_onnx(m)
    assert _cosine(plain, m, unseen) < 0.9  # one step's argmax flips in fp16 and the sequence diverges

    growth = error_growth(m, plain, fp16_candidates(plain), held[0])
    assert max(growth, key=growth.get) == "decode_loop"  # the loop adds the error, its inputs are near fp32

    r = fp16_within_budget(path, tmp_path / "out.onnx", held, 0.9925,
                           convert=lambda keep: fp16_from_onnx(m, keep_nodes=keep))
    kept = r.details["fp16_search"]["kept"]
    assert "decode_loop" in kept and r.metrics["fallback_layers"] == len(kept) <= 2
    assert r.metrics["search_cosine_fp16"] < 0.9 <= 0.9925 <= r.metrics["search_cosine_bound"]  # pooled less its SE
    assert r.metrics["search_cosine_bound"] <= r.metrics["search_cosine"] and 0.99 <= r.metrics["search_cosine_worst_feed"]
    assert r.details["fp16_search"]["search_statistic"].startswith("pooled cosine less 1 standard error")
    assert r.metrics["search_samples"] == 4 and r.metrics["search_runs"] <= 4 * 8  # a few whole-model runs
    out = onnx.load(str(r.files["onnx"]))
    assert r.details["accuracy"] == kept and r.details["fp32_reasons"].get("accuracy") == len(kept)
    assert "enc_mm1" in fp16_candidates(out) and "decode_loop" not in fp16_candidates(out)  # the encoder stays fp16
    assert _cosine(out, m, unseen) >= 0.99  # on samples the search never saw


def test_fp16_search_that_cannot_meet_the_budget_says_so(tmp_path):
    from tasks.accuracy.metric import Metric, SearchJudge

    m = decoder()
    path = tmp_path / "decoder.onnx"
    onnx.save(m, str(path))
    # a metric no graph meets (the user's, judged by its worst sample): the search gives up with its figure and remedy
    never = SearchJudge(Metric(name="mine:never"), "mine:never score", 0.9, lambda outputs, refs, feed: 0.5)
    with pytest.raises(AccuracyError) as e:
        fp16_within_budget(path, tmp_path / "out.onnx", _feeds(3, 1), 0.9, metric=never,
                           convert=lambda keep: fp16_from_onnx(m, keep_nodes=keep), samples_text="held-out samples")
    msg = e.value.render()
    assert "0.500000" in msg and "worst sample over 3 held-out samples" in msg and "precision=fp32" in msg
    assert "mine:never score" in msg
    assert not (tmp_path / "out.onnx").exists()


def test_fp16_search_judges_by_the_accuracy_metric(tmp_path):
    """accuracy.metric reaches the fp16 search as it reaches int8's: top1 (the argmax of each decoding step's token
    probabilities) judged on its worst sample finds the Loop; an allclose tolerance fp16 cannot hold anywhere fails
    where cosine (met by the graph as converted) keeps nothing."""
    from tasks.accuracy.metric import Metric

    m = decoder()
    path = tmp_path / "decoder.onnx"
    onnx.save(m, str(path))
    held = _feeds(4, 1)

    def convert(keep):
        return fp16_from_onnx(m, keep_nodes=keep)

    top1 = Metric(name="top1", min_agreement=0.99).judge(0.5)
    r = fp16_within_budget(path, tmp_path / "top1.onnx", held, top1.target, convert=convert, metric=top1)
    assert r.metrics["search_metric"] == "top1" and "search_cosine_bound" not in r.metrics
    assert r.metrics["search_score_fp16"] < 0.9 < top1.target == 0.995 <= r.metrics["search_score_worst_feed"] == 1.0
    assert "decode_loop" in r.details["fp16_search"]["kept"] and r.metrics["fallback_layers"] <= 2

    enc = onnx.shape_inference.infer_shapes(m)  # the encoder alone: fp16 is near fp32 everywhere
    enc = onnx.utils.Extractor(enc).extract_model(["x"], ["h0"])
    enc_path = tmp_path / "encoder.onnx"
    onnx.save(enc, str(enc_path))
    r = fp16_within_budget(enc_path, tmp_path / "enc_cos.onnx", held, 0.995,
                           convert=lambda keep: fp16_from_onnx(enc, keep_nodes=keep))
    assert r.metrics["search_cosine_bound"] >= 0.995 and r.metrics["fallback_layers"] == 0 and r.metrics["search_runs"] == 4
    tight = Metric(name="allclose", atol=1e-7, rtol=1e-6, min_within=1.0).judge(0.5)
    with pytest.raises(AccuracyError) as e:
        fp16_within_budget(enc_path, tmp_path / "enc_tight.onnx", held, tight.target,
                           convert=lambda keep: fp16_from_onnx(enc, keep_nodes=keep), metric=tight)
    assert "allclose share of elements within tolerance" in e.value.render()


def scaled_down() -> onnx.ModelProto:
    """x * 1e-3 * 1e-4 (a scaled-down intermediate, ~1e-7: subnormal in fp16, where its precision is gone; both scales
    are normal fp16 values), Tanh, scaled back up by dividing by them, then a MatMul."""
    rng = np.random.default_rng(0)
    g = h.make_graph(
        [h.make_node("Mul", ["x", "s1"], ["a"], name="down1"),
         h.make_node("Mul", ["a", "s2"], ["small"], name="down2"),
         h.make_node("Tanh", ["small"], ["t"], name="tanh"),
         h.make_node("Div", ["t", "s2"], ["b"], name="up2"),
         h.make_node("Div", ["b", "s1"], ["back"], name="up1"),
         h.make_node("MatMul", ["back", "w"], ["y"], name="mm")], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [4, D])], [h.make_tensor_value_info("y", T.FLOAT, [4, D])],
        [nh.from_array(np.array(1e-3, np.float32), "s1"), nh.from_array(np.array(1e-4, np.float32), "s2"),
         nh.from_array(rng.standard_normal([D, D]).astype(np.float32), "w")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_values_below_fp16_normal_range_keep_their_nodes_fp32():
    m = scaled_down()
    feeds = [{"x": np.random.default_rng(i).standard_normal([4, D]).astype(np.float32)} for i in range(2)]
    over, cancel, tiny = fp16_hazards_from_data(m, feeds, underflow=True)
    assert set(tiny) == {"small", "t"} and not over and min(tiny.values()) > 0.1  # ~1e-7 values: ~20% off in fp16
    guarded, stats = fp16_from_onnx(m, over, cancel, tiny)
    assert set(stats["data_underflow"]) == {"down2", "tanh", "up2"}  # making or reading them
    assert "mm" in fp16_candidates(guarded)  # the rest stays fp16
    plain, _ = fp16_from_onnx(m)
    assert _cosine(plain, m, feeds) < 0.99 < 0.9999 < _cosine(guarded, m, feeds)
    assert fp16_hazards_from_data(m, feeds) == (over, cancel)  # without the flag: the two dicts as before
