"""The build stage: the graph at the build's precision, and one engine per TensorRT subgraph."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "add_metrics": "build",
    "as_baseline": "build",
    "baseline_skip_reason": "notes",
    "build_error": "build",
    "engine_from_onnx": "build",
    "engines_for_segments": "build",
    "engines_of": "build",
    "onnx_at_precision": "build",
    "same_graph": "build",
})
