"""A failed validation of an int8 graph names the validation feeds that fail and whether their inputs reach outside the
range the calibration samples spanned (real calibrate, real ONNX Runtime)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.common.errors import AccuracyError
from tasks.evaluate.fixes import input_ranges
from tasks.evaluate.validate import gate, validate_onnx
from tasks.onnxrt.emulate import precision_runner
from tests.conftest import make_conv_model


@pytest.fixture(scope="module")
def int8_graph(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    from tasks.quantization.calibrate import qdq_from_onnx

    d = tmp_path_factory.mktemp("failing")
    src = make_conv_model(d / "f32.onnx")
    rng = np.random.default_rng(5)
    cal = [{"x": rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(6)]
    r = qdq_from_onnx(src, cal, d / "int8.onnx", method="minmax", workdir=d / "work")
    return src, r.files["onnx"], cal


def test_the_failed_verdict_names_the_feeds_outside_calibrations_range(int8_graph, tmp_path):
    src, int8, cal = int8_graph
    rng = np.random.default_rng(6)
    feeds = [{"x": rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(4)]
    feeds[2] = {"x": feeds[2]["x"] * 8}  # 8x the range calibration saw: the int8 input of conv1 clips
    run = precision_runner(int8)[0]
    with pytest.raises(AccuracyError) as ei:
        validate_onnx(src, run, feeds, 0.999, "test feeds", tmp_path / "validation.json")
    result = ei.value.result
    with pytest.raises(AccuracyError) as ei:
        gate(result, calibration_ranges=input_ranges(cal))
    msg = ei.value.message
    assert "validation feeds below accuracy.min_cosine=0.999 on their own: 1 of 4: #2 (cosine " in msg, msg
    assert "x in [" in msg and "outside calibration's [" in msg and "give calibration.data samples that cover it" in msg
    lo, hi = input_ranges(cal)["x"]
    assert f"outside calibration's [{lo:.4g}, {hi:.4g}]" in msg
    assert [k for k, f in enumerate(result.details["feed_inputs"]) if f["x"][1] > hi] == [2]


def test_feeds_within_calibrations_range_are_said_to_differ_in_content(int8_graph, tmp_path):
    src, int8, cal = int8_graph
    rng = np.random.default_rng(7)
    feeds = [{"x": rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(3)]
    with pytest.raises(AccuracyError) as ei:  # a budget int8 misses on any feed
        validate_onnx(src, precision_runner(int8)[0], feeds, 0.9999999, "test feeds", tmp_path / "validation.json")
    result = ei.value.result
    with pytest.raises(AccuracyError) as ei:
        gate(result, calibration_ranges=input_ranges(cal))
    msg = ei.value.message
    assert "3 of 3: #" in msg and msg.count("inputs within calibration's range") == 3, msg
    assert "differ from them in content, not in range" in msg
