"""The fix validate names when a build misses the accuracy budget: a pre-quantized model's (or an unsearched build's)
from what it arrived with, an int8/fp8 build's from its accuracy search; none for a metric other than cosine (those
fixes speak of cosine)."""
from __future__ import annotations

from tasks.prequant.fixes import accuracy_fix
from tasks.quantization.calibrate import search_fix


def validation_fix(prequantized: dict | None, search_metrics: dict | None, samples: int, budget_margin: float | None,
                   searched: bool, metric_name: str) -> str | None:
    """``prequantized``: the quantization a model arrived with and kept; ``search_metrics``: calibrate's metrics (None
    when it did not run); ``samples``: validation's."""
    if metric_name != "cosine":
        return None
    if prequantized or search_metrics is None:
        return accuracy_fix(prequantized or {})
    return search_fix(search_metrics, samples, budget_margin, searched)
