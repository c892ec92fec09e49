import numpy as np

from tasks.evaluate.benchmark import benchmark_model
from tasks.common.timing import latency_stats


def test_latency_stats():
    s = latency_stats([1.0] * 98 + [10.0, 10.0], [1.0, 1.2], batch=4)
    assert s["p50_ms"] == 1.0 and s["p99_ms"] >= 9.9 and s["throughput_per_s"] > 0
    assert abs(s["spread_pct"] - 20.0) < 1e-9
    # an engine's latency is its compute; its throughput counts whole requests (copies included)
    e = latency_stats([1.0] * 4, [1.0], batch=4, request_ms=[2.0] * 4)
    assert e["p50_ms"] == 1.0 and e["throughput_per_s"] == 2000.0


def test_benchmark_measures_onnxruntime_and_says_engine_timing_needs_a_gpu(tiny_onnx, tmp_path):
    feed = {"x": np.zeros((2, 3, 16, 16), np.float32)}
    cfg = {"warmup": 1, "iterations": 5, "repeats": 2, "threads": 1}
    r = benchmark_model(tiny_onnx, feed, cfg, tmp_path / "b.json", {"build_seconds": 1.0, "engine_bytes": 10},
                        None, "no NVIDIA GPU on this host")
    assert r.details["native"]["runs"] == 10 and r.metrics["ort_p50_ms"] > 0
    assert r.details["engine"] == {"status": "skipped", "reason": "no NVIDIA GPU on this host"}
