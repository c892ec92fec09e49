"""fp16 under the accuracy budget through the whole flow: a decoder whose autoregressive Loop
diverges in fp16 builds at fp16 with the Loop kept fp32 (real TensorRT-RTX build), judged on samples held out of
calibration.data that validation never sees; a budget fp16 cannot meet fails in the build with the search's figure."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.flows.test_build_flow import build


@pytest.fixture(scope="module")
def decoder_conf(tmp_path_factory):
    import onnx

    from tests.tasks.fp16.test_search import D, decoder

    d = tmp_path_factory.mktemp("decoder")
    (d / "model").mkdir()
    onnx.save(decoder(), str(d / "decoder.onnx"))
    rng = np.random.default_rng(3)
    np.savez(d / "samples.npz", x=(rng.standard_normal([12, D]) * 0.5).astype(np.float32))  # 12 samples, axis 0
    (d / "model" / "decoder.yaml").write_text(f"name: decoder\nsource: {d / 'decoder.onnx'}\n")
    return d


def test_fp16_keeps_the_decoding_loop_fp32_within_the_budget(prefect_harness, decoder_conf, tmp_path):
    s = build(["model=decoder", "precision=fp16", f"calibration.data={decoder_conf / 'samples.npz'}",
               "stages.benchmark=false"], decoder_conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    m = s["metrics"]
    assert m["search_cosine_fp16"] < 0.9 and m["search_cosine_worst_feed"] >= 0.99 and m["cosine_min"] >= 0.99
    assert m["fallback_layers"] == 1 and m["search_samples"] == 3 and m["search_runs"] <= 20
    assert 0 < m["flops_share"]["fp32"] < 0.5 < m["flops_share"]["fp16"]  # the encoder stays fp16
    assert "decode_loop" in s["stages"]["build"]["note"] and "fp16 accuracy search" in s["stages"]["build"]["note"]
    # the search ran because the graph as converted missed the budget in validate; the stages count both attempts
    b, v = s["stages"]["build"], s["stages"]["validate"]
    assert "missed the accuracy budget in validate" in b["fp16_search"] and v["first_attempt"]["status"] == "failed"
    assert b["first_attempt"]["status"] == "ok" and b["seconds"] >= b["first_attempt"]["seconds"]
    assert list(s["stages"]) == ["export", "partition", "build", "calibrate", "validate", "benchmark"]
    search, val = s["data"]["search"], s["data"]["validation"]  # disjoint: 3 held out for the search, 9 validate
    assert search["samples"] == 3 and val["samples"] == 9 and "held out for the accuracy search" in search["source"]
    sens = json.loads((Path(s["out_dir"]) / "sensitivity.json").read_text())
    assert sens["segments"][0]["fallback"] == ["decode_loop"]
    assert max(sens["layers"], key=lambda r: r["error_growth"])["node"] == "decode_loop"
    assert "fp16 accuracy search" in (Path(s["out_dir"]) / "report.html").read_text()


def test_a_budget_fp16_cannot_meet_fails_in_the_build_with_the_searchs_figure(prefect_harness, decoder_conf, tmp_path):
    s = build(["model=decoder", "precision=fp16", f"calibration.data={decoder_conf / 'samples.npz'}",
               "accuracy.min_cosine=1.0", "stages.benchmark=false"], decoder_conf, tmp_path)
    assert s["status"] == "failed" and s["stages"]["build"]["status"] == "failed"
    reason = s["stages"]["build"]["reason"]
    assert "fp16 misses the accuracy budget" in reason and "accuracy.min_cosine=1" in reason
    assert "3 held-out samples" in reason and "precision=fp32" in reason


def test_the_fp16_search_judges_by_accuracy_metric(prefect_harness, decoder_conf, tmp_path):
    """accuracy.metric=top1 reaches the fp16 search through the flow as it reaches int8's: judged on its worst held-out
    sample against its own target, named in the metrics and the build's note, and validate gates on it."""
    s = build(["model=decoder", "precision=fp16", f"calibration.data={decoder_conf / 'samples.npz'}",
               "accuracy.metric=top1", "stages.benchmark=false"], decoder_conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    m = s["metrics"]
    assert m["search_metric"] == "top1" and m["search_score_fp16"] < 0.9 and m["search_score_worst_feed"] == 1.0
    assert "search_cosine_bound" not in m and 1 <= m["fallback_layers"] <= 2
    note = s["stages"]["build"]["note"]
    assert "decode_loop" in note and "accuracy.metric=top1" in note and "disjoint from validation's" in note
    assert s["data"]["search"]["samples"] == 3 and s["data"]["validation"]["samples"] == 9


def test_a_dynamically_quantized_decoder_is_searched_at_fp16(prefect_harness, decoder_conf, tmp_path):
    """The decoder quantized dynamically (its encoder MatMuls as MatMulInteger, run natively in ONNX Runtime): its
    engines compute float, so at fp16 the search keeps the diverging Loop fp32 as it does for the float model, judged
    against the model as shipped."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    src = conf / "decoder_dynamic.onnx"
    quantize_dynamic(str(decoder_conf / "decoder.onnx"), str(src), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul"])
    (conf / "model" / "decoder_dynamic.yaml").write_text(f"name: decoder_dynamic\nsource: {src}\n")
    s = build(["model=decoder_dynamic", "precision=fp16", f"calibration.data={decoder_conf / 'samples.npz'}",
               "stages.benchmark=false"], conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    m = s["metrics"]
    assert m["search_cosine_fp16"] < 0.9 and m["search_cosine_worst_feed"] >= 0.99 and m["cosine_min"] >= 0.99, m
    assert m["fallback_layers"] >= 1 and "decode_loop" in s["stages"]["build"]["note"]
