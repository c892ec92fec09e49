import json

import pytest

from tasks.backend import Backend
from tasks.errors import StageError
from tasks.partition import plan_from_onnx
from tests.conftest import make_conv_model

CFG = {"min_subgraph_size": 3, "exclude_ops": [], "strict": False}


def test_ppocr_det_is_one_tensorrt_subgraph(det_path, tmp_path):
    r = plan_from_onnx(det_path, CFG, Backend("tensorrt_rtx"), tmp_path / "p.json")
    assert r.metrics["trt_subgraphs"] == 1 and r.metrics["fallback_nodes"] == 0
    assert r.details["fully_supported"]


def test_unparseable_op_is_reported_with_the_parsers_reason(tmp_path):
    m = make_conv_model(tmp_path / "custom.onnx", custom_op="MysteryOp")
    with pytest.raises(StageError) as e:
        plan_from_onnx(m, CFG, Backend("tensorrt_rtx"), tmp_path / "p.json")
    assert "custom1 (MysteryOp)" in str(e.value) and "[partition]" in str(e.value)
    report = json.loads((tmp_path / "p.json").read_text())
    node = next(f for f in report["fallback_nodes"] if f["name"] == "custom1")
    assert node["op"] == "MysteryOp" and node["reason"] and node["inputs"] == ["r1"]
