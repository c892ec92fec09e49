"""Weight-only quantized models in calibration: each TensorRT segment's weights folded to float for calibration to
quantize, then the model's own int8 weights and scales put back where a layer's weight was quantized per output
channel (tasks/prequant/weight_only.py)."""
from __future__ import annotations

from pathlib import Path

from tasks.graph.load import load_onnx
from tasks.graph.models import save_onnx
from tasks.prequant.weight_only import float_weights, keep_weight_scales


def weight_only_weights(export_details: dict) -> int:
    """How many weight-only quantized weights the graph TensorRT gets has (int8 constant -> DequantizeLinear)."""
    return int((export_details.get("prequantized") or {}).get("weight_only") or 0)


def float_weight_segments(segs: list[dict], d: Path) -> dict[int, tuple[Path, dict]]:
    """Each segment with weight-only DequantizeLinear nodes, its weights folded to float (for calibration): index ->
    (ONNX file, the model's codes and scales by weight)."""
    out = {}
    for s in segs:
        m = load_onnx(s["onnx"])
        kept = float_weights(m)
        if kept:
            path = d / f"float_weights{s['index']}.onnx"
            save_onnx(m, path)
            out[s["index"]] = (path, kept)
    return out


def restore_weight_scales(files: dict, shipped: dict[int, tuple[Path, dict]]) -> dict:
    """The model's own int8 weights back into each quantized segment (``files``: qdq<index> -> its Q/DQ graph);
    {"restored": n, "weights": n}."""
    restored = 0
    for i, (path, kept) in shipped.items():
        m = load_onnx(files[f"qdq{i}"])
        n = keep_weight_scales(m, kept)
        if n:
            save_onnx(m, files[f"qdq{i}"])
        restored += n
        path.unlink(missing_ok=True)
    return {"restored": restored, "weights": sum(len(k) for _, k in shipped.values())}


def weight_scales_note(kept: dict) -> str:
    """calibrate's note on a weight-only quantized model: how many of its own int8 weights and scales it kept."""
    return (f"weight-only quantized model: activations calibrated; the model's own int8 weights and scales kept for "
            f"{kept['restored']} of its {kept['weights']} weights" + ("" if kept["restored"] == kept["weights"] else
                                                                     " (the others are float: another axis or shape)"))
