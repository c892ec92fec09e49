"""Where the ONNX comes from: ONNX files, torch factories and Paddle inference models, exported and sanitized for the later stages."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "constants_text": "export",
    "constants_warnings": "notes",
    "converted_onnx": "paddle",
    "onnx_from_model": "export",
    "sanitize": "export",
    "source_fingerprint": "export",
})
