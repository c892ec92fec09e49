"""A split model's segments at fp16 (tasks/fp16/composed.py): a segment whose own fp16 search cannot meet its target
is kept fp32 whole and the model goes on; where no segment would stay fp16, the search's refusal stands."""
from __future__ import annotations

import pytest

from tasks.common import StageResult
from tasks.common.errors import AccuracyError
from tasks.fp16.composed import fp16_or_fp32


def _convert(missing: set[int]):
    def convert(s: dict) -> StageResult:
        if s["index"] in missing:
            raise AccuracyError(f"fp16 misses the accuracy budget on segment {s['index']}", stage="build")
        return StageResult(files={"onnx": f"fp16_{s['index']}.onnx"}, metrics={}, details={})
    return convert


def _fp32(s: dict) -> StageResult:
    return StageResult(files={"onnx": f"fp32_{s['index']}.onnx"}, metrics={}, details={})


def test_a_segment_whose_own_search_misses_is_kept_fp32_whole():
    segs = [{"index": 0}, {"index": 2}, {"index": 5}]
    out = fp16_or_fp32(segs, _convert({2}), _fp32)
    assert {i: r.files["onnx"] for i, r in out.items()} == {0: "fp16_0.onnx", 2: "fp32_2.onnx", 5: "fp16_5.onnx"}
    assert "segment 2" in out[2].details["fp16_search_refused"] and "fp16_search_refused" not in out[0].details


def test_the_refusal_stands_where_no_segment_would_stay_fp16():
    with pytest.raises(AccuracyError, match="segment 0"):
        fp16_or_fp32([{"index": 0}, {"index": 1}], _convert({0, 1}), _fp32)


def test_the_note_says_when_only_every_segment_fp32_met_the_target():
    from tasks.fp16.notes import fp16_whole_model_note

    note = fp16_whole_model_note({"kept": [], "met": False, "all_needed": True, "bound_fp16": 0.5, "bound": 1.0,
                                  "target": 0.995, "metric": "cosine", "samples": 4, "judgements": 16,
                                  "candidates": 182})
    assert "no smaller set of whole segments kept fp32 did in 16 judgements" in note and "stay as converted" in note
