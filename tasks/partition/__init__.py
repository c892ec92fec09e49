"""Partition: TensorRT subgraphs and native segments, the fallback when a subgraph does not build, and running a segmented model."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "REDUCE_BUILD_SECONDS": "partition",
    "Rest": "segments",
    "all_segment_feeds": "segments",
    "build_fallback": "partition",
    "composed_runner": "segments",
    "plan_from_onnx": "partition",
    "segment_feeds": "segments",
    "trt_segments": "segments",
})
