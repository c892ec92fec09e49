"""Validate (the precision-transformed graph or the engine against the fp32 reference, gated by the user's metric) and benchmark."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "baseline_note": "benchmark",
    "benchmark_model": "benchmark",
    "engine_timing": "benchmark",
    "gate": "validate",
    "host_info": "benchmark",
    "input_ranges": "fixes",
    "logit_runners": "logits",
    "validate_onnx": "validate",
    "validation_fix": "fixes",
    "validation_reference": "reference",
})
