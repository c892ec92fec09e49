"""The build stage: the graph at the build's precision, and one engine per TensorRT subgraph."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "add_metrics": "engines",
    "as_baseline": "engines",
    "baseline_skip_reason": "notes",
    "build_error": "engines",
    "engine_from_onnx": "engines",
    "engines_for_segments": "engines",
    "engines_of": "engines",
    "onnx_at_precision": "engines",
    "same_graph": "engines",
})
