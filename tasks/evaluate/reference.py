"""What validate compares against: the model as shipped (one that arrived quantized, in ONNX Runtime), its dequantized
float form (model.reference=dequantized, a dynamically quantized model built dequantized: what the engine computes,
chosen knowingly), or the fp32 export; and how the verdict names it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.sources.export import constants_text


@dataclass(frozen=True)
class Reference:
    path: Path
    label: str  # in words, in the verdict and the summary
    shipped: bool  # the model as shipped (the export also holds a file "reference")
    dequantized: bool  # the export dequantized a dynamically quantized model


def validation_reference(files: dict, details: dict, reference: str, constants: dict) -> Reference:
    """From the export's ``files`` and ``details``, model.reference and model.constants."""
    shipped = "reference" in files and reference == "shipped"
    dequantized = bool((details.get("prequantized") or {}).get("dequantized_dynamic"))
    label = "the model as shipped" if shipped else (
        "its dequantized float form (model.reference=dequantized)" if "reference" in files else "fp32")
    if constants:
        label += f" with {constants_text(constants)} bound (model.constants)"
    return Reference(files["reference"] if shipped else files["onnx"], label, shipped, dequantized)
