"""validate with an fp32 reference that is not finite (tasks/accuracy/nonfinite.py): found and reported before any
judgement; NaN at the same places in the fp16 build: compared on the finite part, and said; NaN caused by random
inputs: the message names the inputs and asks for validation.data; NaN at other places: the failure says so instead of
advising a higher precision. Tiny models built here, converted by the real fp16 conversion, run in ONNX Runtime."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tasks.common.errors import AccuracyError
from tasks.evaluate import validate_onnx
from tasks.fp16 import fp16_from_onnx
from tasks.graph.models import save_onnx


def _save(path: Path, nodes, inputs, inits=()) -> Path:
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
                          initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    save_onnx(m, path)
    return path


def masked_model(path: Path) -> Path:
    """y = Where(mask, x * 3 + 1, NaN): NaN where the mask is false, by design (as a GNN's masked target)."""
    inits = [numpy_helper.from_array(np.array(3.0, np.float32), "three"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(np.nan, np.float32), "nan")]
    nodes = [helper.make_node("Mul", ["x", "three"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "one"], ["a"], name="add"),
             helper.make_node("Where", ["mask", "a", "nan"], ["y"], name="where")]
    return _save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16]),
                               helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 16])], inits)


def log_model(path: Path) -> Path:
    """y = Log(sigma) * 2 + sigma @ W: NaN for sigma < 0, -inf at 0 (a diffusion UNet's noise level); the MatMul is
    the fp16 work (Log stays fp32 in an fp16 build)."""
    w = np.random.default_rng(7).standard_normal((16, 16)).astype(np.float32) * 0.25
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"), numpy_helper.from_array(w, "w")]
    nodes = [helper.make_node("Log", ["sigma"], ["l"], name="log"), helper.make_node("Mul", ["l", "two"], ["l2"], name="mul"),
             helper.make_node("MatMul", ["sigma", "w"], ["p"], name="proj"),
             helper.make_node("Add", ["l2", "p"], ["y"], name="add")]
    return _save(path, nodes, [helper.make_tensor_value_info("sigma", TensorProto.FLOAT, [1, 16])], inits)


def fp16_of(fp32: Path, out: Path) -> Path:
    save_onnx(fp16_from_onnx(onnx.load(str(fp32)))[0], out)
    return out


def test_same_place_nan_is_compared_on_the_finite_part(tmp_path):
    ref = masked_model(tmp_path / "masked.onnx")
    cand = fp16_of(ref, tmp_path / "masked16.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 16)).astype(np.float32), "mask": rng.random((1, 16)) > 0.3}
             for _ in range(4)]
    r = validate_onnx(ref, cand, feeds, 0.999, "validation.data=masked.npz", tmp_path / "v.json")
    assert r.details["passed"] and r.metrics["cosine_min"] > 0.999
    masked = sum(int((~f["mask"]).sum()) for f in feeds)
    nf = r.details["nonfinite"]
    assert nf["reference"]["y"]["nan"] == masked and nf["reference"]["y"]["feeds"] == [0, 1, 2, 3]
    assert r.details["outputs"]["y"]["nonfinite_both"] == masked
    assert f"compared on the finite part ({masked} of 64 elements non-finite in both" in r.details["verdict"]
    assert any(f"'y' is not finite: {masked} of 64 elements (NaN {masked}) on feed 0" in w for w in nf["warnings"])
    assert not any("random inputs caused it" in w for w in nf["warnings"])


def test_random_inputs_that_make_the_reference_nan_are_named_and_data_asked_for(tmp_path):
    ref = log_model(tmp_path / "log.onnx")
    cand = fp16_of(ref, tmp_path / "log16.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"sigma": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(3)]
    r = validate_onnx(ref, cand, feeds, 0.99, "random inputs", tmp_path / "v.json", random_inputs=True)
    (warning,) = r.details["nonfinite"]["warnings"]
    assert "node 'log' (Log)" in warning and "the random values of input(s) sigma (those that reach it) caused it" \
        in warning
    assert r.details["nonfinite"]["origins"] == {"y": {"node": "log", "op": "Log", "inputs": ["sigma"]}}
    assert "validation.data=PATH" in warning and "'y' is not finite" in warning
    assert warning in r.details["warnings"]


def test_nan_at_other_places_fails_without_advising_a_higher_precision(tmp_path):
    ref = log_model(tmp_path / "log.onnx")
    rng = np.random.default_rng(2)
    feeds = [{"sigma": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(2)]

    def shifted(feed):  # the build's NaN fall elsewhere: a candidate that logs |sigma| rolled by one place
        from tasks.onnxrt.ort import ort_run, ort_session
        return ort_run(ort_session(ref), {"sigma": np.roll(feed["sigma"], 1)})

    with pytest.raises(AccuracyError) as e:
        validate_onnx(ref, shifted, feeds, 0.99, "random inputs", tmp_path / "v.json", random_inputs=True,
                      fix="use a higher precision (precision=fp32)")
    msg, fix = e.value.message, e.value.fix
    assert "non-finite values and the build is non-finite at other places" in msg
    assert "the generated random values of input(s) sigma caused it" in msg
    assert "validation.data" in fix and "precision" not in fix


def test_the_fp16_search_judges_the_finite_part_and_does_not_advise_fp32(tmp_path):
    from tasks.fp16.search import fp16_within_budget

    ref = masked_model(tmp_path / "masked.onnx")
    m = onnx.load(str(ref))
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((1, 16)).astype(np.float32), "mask": rng.random((1, 16)) > 0.3}
             for _ in range(4)]
    r = fp16_within_budget(ref, tmp_path / "out.onnx", feeds, 0.999, convert=lambda keep: fp16_from_onnx(m, keep_nodes=keep))
    assert r.metrics["fallback_layers"] == 0 and r.metrics["search_cosine"] > 0.999  # NaN where masked: left out

    log = log_model(tmp_path / "log.onnx")
    lm = onnx.load(str(log))
    sigma = [{"sigma": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(3)]

    def convert(keep):  # a build whose NaN fall elsewhere than the reference's (sigma negated before the Log)
        g, stats = fp16_from_onnx(lm, keep_nodes=keep)
        neg = helper.make_node("Neg", [g.graph.node[0].input[0]], ["negated"], name="neg")
        g.graph.node[0].input[0] = "negated"
        g.graph.node.insert(0, neg)
        return g, stats

    with pytest.raises(AccuracyError) as e:
        fp16_within_budget(log, tmp_path / "out2.onnx", sigma, 0.99, convert=convert, samples_text="random inputs")
    assert "the fp32 reference itself is not finite on random inputs: 'y'" in e.value.message
    assert "validation.data" in e.value.fix and "precision=fp32" not in e.value.fix
