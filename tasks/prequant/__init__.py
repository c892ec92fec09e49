"""Models that arrive quantized: Q/DQ, QOperator and dynamically quantized graphs rewritten for TensorRT, weight-only quantization, and what a build of them can promise."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "accuracy_fix": "fixes",
    "dequantized_fix": "fixes",
    "dequantized_vs_shipped": "fixes",
    "describe": "detect",
    "float_engines": "detect",
    "float_weight_segments": "calibration",
    "float_weights": "weight_only",
    "keep_weight_scales": "weight_only",
    "precision_for": "detect",
    "quantization_of": "detect",
    "restore_weight_scales": "calibration",
    "trt_from_prequantized": "rewrite",
    "weight_only_model": "weight_only",
    "weight_only_note": "weight_only",
    "weight_only_weights": "calibration",
    "weight_scales_note": "calibration",
})
