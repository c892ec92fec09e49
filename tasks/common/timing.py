"""Latency statistics, one definition for ONNX Runtime and engine timings."""
from __future__ import annotations

import numpy as np


def latency_stats(times_ms: list[float], repeat_medians: list[float], batch: int,
                  request_ms: list[float] | None = None) -> dict[str, float]:
    """Percentiles of ``times_ms``; throughput from ``request_ms`` (a whole request, copies included) when the latency
    measured is only part of it (an engine's compute), else from ``times_ms``."""
    t = np.asarray(times_ms)
    p50 = float(np.percentile(t, 50))
    whole = np.asarray(request_ms if request_ms is not None else times_ms)
    return {"p50_ms": p50, "p90_ms": float(np.percentile(t, 90)), "p99_ms": float(np.percentile(t, 99)),
            "mean_ms": float(t.mean()), "throughput_per_s": batch * 1e3 / float(whole.mean()),
            "spread_pct": 100.0 * (max(repeat_medians) - min(repeat_medians)) / p50 if p50 else 0.0}
