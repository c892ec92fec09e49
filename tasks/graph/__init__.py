"""The ONNX graph toolkit: loading and saving models, inputs and outputs, edits (folding, renaming, pruning, subgraphs), value types, and the FLOP model."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "TensorInfo": "models",
    "array_from_constant": "specialise",
    "check_safe_name": "models",
    "graph_io": "models",
    "load_onnx": "load",
    "onnx_flops": "flops",
    "resolve_source": "models",
    "save_onnx": "models",
    "subgraphs": "edit",
})
