"""ONNX Runtime: sessions and runners, integer ops computed exactly as written (the same figure on any x86-64 CPU), and the emulation of the engine's precision that validate runs on a CPU host."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "emulation_label": "emulate",
    "ort_runner": "ort",
    "ort_session": "ort",
    "precision_runner": "emulate",
    "SAME_ON_ANY_CPU": "emulate",
})
