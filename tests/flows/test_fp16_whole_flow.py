"""fp16 of a model split around a native decoding Loop: each segment's fp16 search judges that segment's own outputs,
which fp16 keeps close, but the Loop's argmax turns the encoder's fp16 rounding into another number of decoding steps
on some samples. The converted segments judged together with the native Loop, on the model's outputs, keep the encoder
fp32 and the build validates on samples the search never saw. Real TensorRT-RTX builds, real ONNX Runtime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper as h
from onnx import numpy_helper as nh

from tests.conftest import model_conf
from tests.flows.test_build_flow import build
from tests.flows.test_int8_through_flow import D, argmax_decoder


@pytest.fixture(scope="module")
def close_call_decoder(tmp_path_factory):
    """The decoder whose two logits differ by 0.0005 per unit of the encoder's activations: fp16 rounds the encoder's
    output (about 10, in steps of 0.004-0.008) across that on about a third of the samples."""
    d = tmp_path_factory.mktemp("close_call_decoder")
    m = argmax_decoder(eps=0.0005)
    # beside it a branch that decides nothing, its own TensorRT segment after a native Sin: fp16 FLOPs that stay fp16
    rng = np.random.default_rng(1)
    m.graph.node.extend([h.make_node("Sin", ["x"], ["xs"], name="side_sin"),
                         h.make_node("MatMul", ["xs", "w3"], ["s1"], name="side_mm1"),
                         h.make_node("Relu", ["s1"], ["s2"], name="side_relu"),
                         h.make_node("MatMul", ["s2", "w4"], ["z"], name="side_mm2")])
    m.graph.initializer.extend(nh.from_array(rng.standard_normal([D, D]).astype(np.float32), w) for w in ("w3", "w4"))
    m.graph.output.append(h.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, D]))
    onnx.checker.check_model(m)
    onnx.save(m, str(d / "decoder.onnx"))
    np.savez(d / "samples.npz", x=np.random.default_rng(7).standard_normal([24, D]).astype(np.float32))
    conf = model_conf(d, "argmax_decoder", d / "decoder.onnx", f"x: {{min: [1, {D}], opt: [1, {D}], max: [1, {D}]}}")
    return conf, d / "samples.npz"


def test_fp16_segments_are_judged_together_through_the_native_loop(prefect_harness, close_call_decoder, tmp_path):
    conf, samples = close_call_decoder
    s = build(["model=argmax_decoder", "precision=fp16", f"calibration.data={samples}", "partition.exclude_ops=[Loop,Sin]",
               "stages.benchmark=false"], conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    m, b = s["metrics"], s["stages"]["build"]
    assert s["stages"]["validate"]["first_attempt"]["status"] == "failed"  # as converted: another number of steps
    assert m["cosine_min"] >= 0.99 and m["trt_subgraphs"] >= 1 and m["fallback_nodes"] >= 1
    assert m["fp16_segments_fp32"] == 1 and 0.3 < m["flops_share"]["fp32"] < 0.7  # the encoder; the side branch fp16
    assert "judged together with the native parts" in b["note"] and "1 of 2 TensorRT segments kept fp32" in b["note"], b["note"]
