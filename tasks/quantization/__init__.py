"""int8/fp8: calibration ranges, the Q/DQ graph, the sensitivity of each layer, and the calibrate stage that searches the accuracy budget."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "judge_feeds_of": "calibrate",
    "low_share_warning": "calibrate",
    "qdq_for_segments": "calibrate",
    "qdq_from_onnx": "calibrate",
    "search_fix": "calibrate",
    "unreached_warning": "notes",
})
