"""accuracy.metric (tasks/accuracy/metric.py): the built-in metrics, a user function, their checks, and validate gating on
them with a real ONNX Runtime run of a two-class softmax classifier built here."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.accuracy.config import from_config
from tasks.accuracy.logits import final_activations, logit_report
from tasks.accuracy.metric import Metric, top1_agreement, within_tolerance
from tasks.common.errors import AccuracyError, ConfigError


def make_softmax_classifier(path: Path, feature_weight: float = 1.0, bias_gap: float = 8.0,
                            underflow: int | None = None) -> Path:
    """x[N,3,16,16] -> Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Gemm(2) -> Softmax -> prob[N,2], the
    majority class near 0.998 (a service thresholds on the minority's ~0.002). ``feature_weight`` scales how much the
    features (the quantized part) move the logits; ``underflow``: the logits scaled by 2^-k and back before the
    Softmax (the same function in fp32; in fp16 they lose most of their bits)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.2
    wf = rng.standard_normal((2, 8)).astype(np.float32) * feature_weight
    bf = np.array([bias_gap / 2, -bias_gap / 2], np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (wf, "wf"), (bf, "bf"))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], transB=1, name="fc")]
    logits = "logits"
    if underflow:
        inits += [numpy_helper.from_array(np.float32(2.0 ** -underflow), "down"),
                  numpy_helper.from_array(np.float32(2.0 ** underflow), "up")]
        nodes += [helper.make_node("Mul", ["logits", "down"], ["small"], name="scale_down"),
                  helper.make_node("Mul", ["small", "up"], ["logits_back"], name="scale_up")]
        logits = "logits_back"
    nodes.append(helper.make_node("Softmax", [logits], ["prob"], axis=-1, name="softmax"))
    g = helper.make_graph(nodes, "cls2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 16, 16])],
                          [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["batch", 2])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="trtforge-tests")
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


MINORITY = '''
import numpy as np


def _relative(outputs, references):
    r = references["prob"]
    k = np.argmin(r, axis=-1)[:, None]  # the minority class of each sample
    p, q = np.take_along_axis(outputs["prob"], k, -1), np.take_along_axis(r, k, -1)
    return float(np.max(np.abs(p - q) / np.abs(q)))


def within_5pct(outputs, references, feeds):
    rel = _relative(outputs, references)
    return rel, rel <= 0.05


def relative_error(outputs, references, feeds):  # passes unless the minority probability doubles
    rel = _relative(outputs, references)
    return rel, rel <= 1.0


def boom(outputs, references, feeds):
    raise ValueError("no labels for batch of " + str(len(feeds["x"])))


def not_a_pair(outputs, references, feeds):
    return 0.5


def label_accuracy(outputs, references, feeds, labels=None):  # validation.labels, when given
    if labels is None:
        return 1.0, True
    acc = float(np.mean(np.argmax(outputs["prob"], -1) == labels))
    return acc, acc >= 0.5
'''


def test_allclose_counts_elements_within_atol_plus_rtol_times_the_reference():
    r = np.array([1.0, 0.002, 100.0])
    c = np.array([1.00001, 0.00205, 100.5])
    assert within_tolerance(c, r, 1e-5, 0.01).tolist() == [True, False, True]  # 5e-5 > 1e-5 + 2e-5
    assert within_tolerance(np.array([np.nan, 1.0]), np.array([1.0, 1.0]), 1.0, 1.0).tolist() == [False, True]
    m = Metric(name="allclose", atol=1e-5, rtol=0.01, outputs={"b": {"rtol": 0.1}}, min_within=0.9)
    got = m.evaluate([{"a": c[None], "b": c[None]}], [{"a": r[None], "b": r[None]}], [{"x": np.zeros((1, 3))}])
    assert got["outputs"] == {"a": pytest.approx(2 / 3), "b": 1.0}  # b's own rtol lets 0.00205 in
    assert got["score"] == pytest.approx(2 / 3) and not got["passed"] and got["metric"] == "allclose"
    assert got["per_sample"] == [{"feed": 0, "sample": 0, "score": pytest.approx(2 / 3),
                                  "outputs": {"a": pytest.approx(2 / 3), "b": 1.0}}]


def test_top1_judges_the_argmax_of_the_last_axis_and_skips_outputs_without_classes():
    r = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    c = np.array([[0.8, 0.2], [0.3, 0.7], [0.4, 0.6], [0.3, 0.7]])
    assert top1_agreement(c, r).tolist() == [True, True, False, True]
    m = Metric(name="top1", min_agreement=0.75)
    got = m.evaluate([{"p": c, "s": np.ones((4, 1))}], [{"p": r, "s": np.ones((4, 1))}], [{"x": np.zeros((4, 2))}])
    assert got["outputs"] == {"p": 0.75} and got["passed"] and got["not_judged"] == ["s"]
    assert [s["score"] for s in got["per_sample"]] == [1.0, 1.0, 0.0, 1.0]  # per sample of the batch


def test_cosine_metric_is_the_pooled_cosine_validate_always_gated_on():
    from tasks.accuracy.metrics import pooled_cosine

    rng = np.random.default_rng(0)
    refs = [{"y": rng.standard_normal((2, 5))} for _ in range(3)]
    outs = [{"y": r["y"] + 0.1 * rng.standard_normal((2, 5))} for r in refs]
    got = Metric(min_cosine=0.99).evaluate(outs, refs, [{"x": np.zeros((2, 1))}] * 3)
    assert got["score"] == pytest.approx(pooled_cosine(outs, refs)) and got["passed"] == (got["score"] >= 0.99)
    assert len(got["per_sample"]) == 6


def test_bad_settings_are_refused_with_key_value_and_fix(tmp_path):
    (tmp_path / "usermetric_cfg.py").write_text(MINORITY)
    for acc, words in (({"metric": "cosin"}, "did you mean 'cosine'"), ({"metric": "allclose", "atol": -1}, "accuracy.atol=-1"),
                       ({"metric": "allclose", "rtol": float("nan")}, "accuracy.rtol=nan"),
                       ({"metric": "top1", "min_agreement": 1.5}, "accuracy.min_agreement=1.5"),
                       ({"metric": "cosine", "outputs": {"prob": {"atol": 0.1}}}, "only accuracy.metric=allclose"),
                       ({"metric": "allclose", "outputs": {"prob": {"atol": -0.1}}}, "accuracy.outputs.prob.atol=-0.1"),
                       ({"metric": "no_such_module_xyz:f"}, "cannot be imported"),
                       ({"metric": "usermetric_cfg:nope"}, "has no function 'nope'")):
        with pytest.raises(ConfigError) as e:
            from_config(acc, [tmp_path])
        assert words in e.value.render() and "fix:" in e.value.render(), acc
        assert e.value.exit_code == 2
    m = from_config({"metric": "usermetric_cfg:within_5pct", "greater_is_better": False}, [tmp_path])
    assert m.user and m.origin == str(tmp_path / "usermetric_cfg.py")


def test_a_user_function_is_called_per_batch_and_its_failure_names_it(tmp_path):
    (tmp_path / "usermetric_call.py").write_text(MINORITY)
    refs = [{"prob": np.array([[0.998, 0.002], [0.997, 0.003]])}, {"prob": np.array([[0.999, 0.001]])}]
    outs = [{"prob": np.array([[0.998, 0.0021], [0.997, 0.003]])}, {"prob": np.array([[0.999, 0.00104]])}]
    feeds = [{"x": np.zeros((2, 3))}, {"x": np.zeros((1, 3))}]
    m = from_config({"metric": "usermetric_call:within_5pct", "greater_is_better": False}, [tmp_path])
    got = m.evaluate(outs, refs, feeds)
    assert got["score"] == pytest.approx(0.05) and got["passed"]  # the worst batch: lower is better here
    assert [(b["samples"], b["passed"]) for b in got["per_sample"]] == [(2, True), (1, True)]
    assert m.judge().worst(outs, refs, feeds) == 1.0 and m.judge().target == 1.0
    for fn, words in (("boom", "accuracy.metric=usermetric_call:boom raised ValueError: no labels for batch of 2"),
                      ("not_a_pair", "returned 0.5, not (score, passed)")):
        with pytest.raises(ConfigError) as e:
            from_config({"metric": f"usermetric_call:{fn}"}, [tmp_path]).evaluate(outs, refs, feeds)
        assert words in e.value.render() and "Traceback" not in e.value.render()
        assert e.value.file == str(tmp_path / "usermetric_call.py")


def test_labels_reach_a_user_function_batch_by_batch(tmp_path):
    from tasks.accuracy.labels import labels_per_feed, load_labels

    (tmp_path / "usermetric_labels.py").write_text(MINORITY)
    np.save(tmp_path / "labels.npy", np.array([0, 1, 1]))
    feeds = [{"x": np.zeros((2, 3))}, {"x": np.zeros((1, 3))}]
    labels = labels_per_feed(load_labels(str(tmp_path / "labels.npy"), 3), feeds)
    assert [x.tolist() for x in labels] == [[0, 1], [1]]
    outs = [{"prob": np.array([[0.9, 0.1], [0.8, 0.2]])}, {"prob": np.array([[0.3, 0.7]])}]
    m = from_config({"metric": "usermetric_labels:label_accuracy"}, [tmp_path])
    got = m.evaluate(outs, outs, feeds, labels)
    assert [(b["score"], b["passed"]) for b in got["per_sample"]] == [(0.5, True), (1.0, True)] and got["score"] == 0.5
    assert m.evaluate(outs, outs, feeds)["score"] == 1.0  # no labels: the keyword is not passed
    with pytest.raises(ConfigError, match="holds 3 labels but validation.data holds 4 samples"):
        load_labels(str(tmp_path / "labels.npy"), 4)


def test_search_judges_share_the_metric_and_keep_a_margin():
    assert Metric(min_cosine=0.99).judge(0.25).target == pytest.approx(0.9925)
    assert Metric(name="top1", min_agreement=0.9).judge(0.5).target == pytest.approx(0.95)
    j = Metric(name="allclose", atol=0.0, rtol=0.1).judge(0.5)  # tolerances halved for the search
    assert j.target == 1.0
    assert j.value({"y": np.array([1.06])}, {"y": np.array([1.0])}, {}) == 0.0
    assert Metric(name="allclose", atol=0.0, rtol=0.1).judge(0.0).value({"y": np.array([1.06])}, {"y": np.array([1.0])}, {}) == 1.0


def test_validate_gates_on_the_metric_and_reports_the_logits(tmp_path):
    """The classifier against itself with its logits nudged: cosine passes (saturated softmax), allclose at rtol 0.01
    fails naming the metric, and the logits are reported under the output with the level that gated."""
    import onnx
    from onnx import numpy_helper

    from tasks.accuracy.logits import with_outputs
    from tasks.onnxrt.ort import ort_runner
    from tasks.evaluate.validate import validate_onnx

    ref = make_softmax_classifier(tmp_path / "ref.onnx", feature_weight=5.0, bias_gap=3.5)
    m = onnx.load(str(ref))
    b = next(t for t in m.graph.initializer if t.name == "bf")
    b.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(b) + np.float32([0.0, 0.03]), "bf"))  # logits moved
    cand = tmp_path / "cand.onnx"
    onnx.save(m, str(cand))
    finals = final_activations(ref)
    assert finals == {"prob": {"op": "Softmax", "logits": "logits"}}
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)} for _ in range(2)]
    logits = {"finals": finals, "reference": ort_runner(with_outputs(ref, ["logits"]).SerializeToString()),
              "candidate": ort_runner(with_outputs(cand, ["logits"]).SerializeToString())}
    r = validate_onnx(ref, cand, feeds, 0.99, "random", tmp_path / "v.json", logits=logits)
    assert r.details["passed"] and r.metrics["cosine_min"] > 0.9999
    acc = r.details["accuracy"]
    assert acc["metric"] == "cosine" and acc["gated_by"] == "outputs"
    assert acc["logits"]["prob"]["op"] == "Softmax" and acc["logits"]["prob"]["cosine"] < 1.0
    assert "gated by the outputs; logits (reported, not gating" in r.details["verdict"]
    metric = Metric(name="allclose", atol=1e-5, rtol=0.01)
    with pytest.raises(AccuracyError) as e:
        validate_onnx(ref, cand, feeds, 0.99, "random", tmp_path / "v2.json", metric=metric, logits=logits)
    text = e.value.render()
    assert "accuracy.metric=allclose fails" in text and "accuracy.rtol=0.01" in text and "output 'prob'" in text
    got = e.value.result.details["accuracy"]
    assert got["outputs"]["prob"] == 0.5 and len(got["per_sample"]) == 4  # the minority class of every sample is out
    assert e.value.result.metrics["accuracy_metric"] == "allclose"
    # gating on the logits: cosine on the probabilities passes, the logits' cosine does not reach 0.9999999
    strict = Metric(min_cosine=0.9999999, gate_logits=True)
    with pytest.raises(AccuracyError) as e:
        validate_onnx(ref, cand, feeds, 0.9999999, "random", tmp_path / "v3.json", metric=strict, logits=logits)
    got = e.value.result.details["accuracy"]
    assert got["outputs"]["prob"] >= 0.9999999  # the probabilities pass; their logits gate
    assert got["gated_by"] == "logits of 'prob' (the input of its Softmax)"
    assert "logits of 'prob'" in e.value.render() and "accuracy.metric=cosine fails" in e.value.render()
    assert logit_report(strict, finals, [logits["candidate"](f) for f in feeds],
                        [logits["reference"](f) for f in feeds])["prob"]["passed"] is False
