"""int8 of a model split around a native decoding Loop (SLANet-plus's class, at int8): the accuracy
search judges every candidate through the rest of the model on the model's own outputs, not the TensorRT segment by
its own outputs. Real TensorRT-RTX builds, real ONNX Runtime."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from tests.conftest import model_conf
from tests.flows.test_build_flow import build

D, STEPS = 16, 6


def argmax_decoder(seed: int = 0, eps: float = 0.2, outlier: float = 100.0) -> onnx.ModelProto:
    """An encoder (MatMul, Relu, MatMul) whose output h0 starts a decoding Loop: each step's token is the argmax of
    h0's first two values, its embedding is emitted, and the loop stops at token 1 ('eos'): 1 or STEPS steps. The two
    values come from weight columns that differ by ``eps``; a weight no activation reaches (its input is always 0)
    sets those columns' int8 step to ``outlier``/127, so int8 weights flip the argmax on some samples (then the
    output's shape differs: cosine 0) while h0 itself, dominated by a bias of 10, keeps a cosine near 1 and fp16
    rounds far below ``eps``."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal([D, D]) / 2).astype(np.float32)
    b1 = np.zeros([1, D], np.float32)
    b1[0, D - 1] = -1000.0  # r[D-1] is always 0
    w2 = rng.standard_normal([D, D]).astype(np.float32)
    w2[:, 1] = w2[:, 0] + eps * np.sign(rng.standard_normal(D)).astype(np.float32)
    w2[D - 1, :2] = outlier
    emb = np.stack([np.ones(D), -np.ones(D)]).astype(np.float32)
    body = h.make_graph(
        [h.make_node("Slice", ["h_in", "s0", "s2", "ax"], ["logits"], name="body_logits"),
         h.make_node("ArgMax", ["logits"], ["tok"], axis=-1, keepdims=0, name="body_argmax"),
         h.make_node("Gather", ["emb", "tok"], ["e"], axis=0, name="body_embed"),
         h.make_node("Squeeze", ["tok"], ["tok0"], name="body_squeeze"),
         h.make_node("Equal", ["tok0", "eos"], ["stop"], name="body_eos"),
         h.make_node("Not", ["stop"], ["cond_out"], name="body_cond"),
         h.make_node("Identity", ["h_in"], ["h_out"], name="body_state")], "decode",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("h_in", T.FLOAT, [1, D])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []), h.make_tensor_value_info("h_out", T.FLOAT, [1, D]),
         h.make_tensor_value_info("e", T.FLOAT, [1, D])],
        [nh.from_array(np.array([0], np.int64), "s0"), nh.from_array(np.array([2], np.int64), "s2"),
         nh.from_array(np.array([1], np.int64), "ax"), nh.from_array(emb, "emb"),
         nh.from_array(np.array(1, np.int64), "eos")])
    g = h.make_graph(
        [h.make_node("MatMul", ["x", "w1"], ["a"], name="enc_mm1"),
         h.make_node("Add", ["a", "b1"], ["ab"], name="enc_bias1"),
         h.make_node("Relu", ["ab"], ["r"], name="enc_relu"),
         h.make_node("MatMul", ["r", "w2"], ["b"], name="enc_mm2"),
         h.make_node("Add", ["b", "bias"], ["h0"], name="enc_bias2"),
         h.make_node("Loop", ["n", "c", "h0"], ["h_last", "seq"], body=body, name="decode_loop"),
         h.make_node("Mul", ["seq", "two"], ["y"], name="out_scale")], "argmax_decoder",
        [h.make_tensor_value_info("x", T.FLOAT, [1, D])], [h.make_tensor_value_info("y", T.FLOAT, ["steps", 1, D])],
        [nh.from_array(w1, "w1"), nh.from_array(b1, "b1"), nh.from_array(w2, "w2"),
         nh.from_array(np.full([1, D], 10.0, np.float32), "bias"), nh.from_array(np.array(STEPS, np.int64), "n"),
         nh.from_array(np.array(True), "c"), nh.from_array(np.array(2.0, np.float32), "two")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


@pytest.fixture(scope="module")
def decoder_conf(tmp_path_factory):
    d = tmp_path_factory.mktemp("argmax_decoder")
    onnx.save(argmax_decoder(), str(d / "decoder.onnx"))
    np.savez(d / "samples.npz", x=np.random.default_rng(7).standard_normal([24, D]).astype(np.float32))  # on axis 0
    conf = model_conf(d, "argmax_decoder", d / "decoder.onnx", f"x: {{min: [1, {D}], opt: [1, {D}], max: [1, {D}]}}")
    return conf, d / "samples.npz"


def test_int8_of_a_segment_before_a_native_loop_is_judged_through_the_loop(prefect_harness, decoder_conf, tmp_path):
    """The encoder segment alone meets the budget all-int8 (its output's cosine stays near 1), but int8 weights flip
    the Loop's argmax on some samples and the model then decodes another number of steps. Judged through the Loop on
    the model's output, the search keeps the flipping MatMul in fp16 and the build validates on samples it never saw."""
    conf, samples = decoder_conf
    s = build(["model=argmax_decoder", "precision=int8", f"calibration.data={samples}", "partition.exclude_ops=[Loop]",
               "stages.benchmark=false"], conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    m = s["metrics"]
    assert m["cosine_min"] >= 0.99 and m["trt_subgraphs"] >= 1 and m["fallback_nodes"] >= 1
    assert m["quantized_layers"] == 1 and m["fallback_layers"] == 1
    q = s["stages"]["calibrate"]
    sens = json.loads((Path(s["out_dir"]) / "sensitivity.json").read_text())
    kept = [r["node"] for r in sens["layers"] if r.get("quantized") is False]
    assert kept == ["enc_mm2"], (kept, q)
