"""fp16: the graph conversion (what stays fp32 and why), the range hazards found on data, and the fp16 accuracy search that keeps the sensitive nodes fp32."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "fp16_build_warnings": "notes",
    "fp16_cancellation_warning": "notes",
    "fp16_from_onnx": "convert",
    "fp16_hazards_from_data": "hazards",
    "fp16_search_note": "notes",
    "fp16_whole_model_note": "notes",
    "fp16_or_fp32": "composed",
    "segments_kept_fp32": "composed",
    "searched_segments": "search",
})
