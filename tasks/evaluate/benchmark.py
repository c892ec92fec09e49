"""Stage 6, benchmark: latency percentiles, throughput, warm-up and run-to-run spread on this host."""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tasks.data.inputs import batch_size
from tasks.onnxrt.ort import ort_run, ort_session
from tasks.common.timing import latency_stats
from tasks.common.util import StageResult, write_json


def host_info() -> dict[str, Any]:
    import onnxruntime as ort

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return {"cpu": cpu, "cores": os.cpu_count(), "onnxruntime": ort.__version__, "python": platform.python_version()}


def measure(step: Callable[[], Any], bench_cfg: Any, batch: int) -> dict[str, Any]:
    """Time `step()`: warm-up runs (the first one is the cold start), then repeats x iterations -> latency stats."""
    def timed() -> float:
        t = time.perf_counter()
        step()
        return (time.perf_counter() - t) * 1e3

    warm = [timed() for _ in range(max(1, int(bench_cfg["warmup"])))]
    times, medians = [], []
    for _ in range(max(1, int(bench_cfg["repeats"]))):
        rep = [timed() for _ in range(max(1, int(bench_cfg["iterations"])))]
        times += rep
        medians.append(float(np.median(rep)))
    return {"first_run_ms": warm[0], "warmup_ms": warm, **latency_stats(times, medians, batch), "runs": len(times),
            "times_ms": times}


def benchmark_onnx(onnx_path: Path, feed: dict[str, np.ndarray], bench_cfg: Any, label: str) -> dict[str, Any]:
    """ONNX Runtime on this host: session creation, then `measure`."""
    t0 = time.perf_counter()
    sess = ort_session(onnx_path, threads=bench_cfg["threads"], spinning=True, stage="benchmark", exact=False)
    load_ms = (time.perf_counter() - t0) * 1e3
    stats = measure(lambda: ort_run(sess, feed, stage="benchmark"), bench_cfg, batch_size(feed))
    return {"runtime": label, "session_create_ms": load_ms, **stats, "shape": {n: list(a.shape) for n, a in feed.items()}}


def benchmark_model(onnx_path: Path, feed: dict[str, np.ndarray], bench_cfg: Any, out_path: Path,
                    build_metrics: dict[str, float], engine_timing: dict | None, engine_skip_reason: str | None,
                    extra: dict | None = None) -> StageResult:
    t0 = time.perf_counter()
    native = benchmark_onnx(onnx_path, feed, bench_cfg, "onnxruntime-cpu fp32")
    report = {"host": host_info(), "native": native, "build": build_metrics,
              "engine": engine_timing or {"status": "skipped", "reason": engine_skip_reason}, **(extra or {})}
    write_json(out_path, report)
    metrics = {f"ort_{k}": v for k, v in native.items() if isinstance(v, float)}
    if engine_timing:
        metrics.update({f"trt_{k}": v for k, v in engine_timing.items() if isinstance(v, float)})
    metrics["benchmark_seconds"] = time.perf_counter() - t0
    files = {"benchmark": out_path}
    from tasks.report.plots import latency_plot

    plot = latency_plot(report, out_path.with_name("latency.png"))  # kept with the timing (a cached one needs no redraw)
    if plot:
        files["latency_plot"] = plot
    return StageResult(files=files, metrics=metrics, details=report)


def engine_timing(feed: dict[str, np.ndarray], bench_cfg: Any, device: str, open_engine: Callable, engine: Path,
                  baseline: Path | None = None, composed: Callable | None = None) -> dict[str, Any]:
    """Engine timing on a GPU. One engine: CUDA-event timing of GPU compute apart from the copies (``open_engine``
    gives its EngineRunner), and the ``baseline`` engine's (the fp16/fp32 build of an int8/fp8 one) for comparison. A
    hybrid model (``composed``: engines + ONNX Runtime segments): host wall clock of the whole composed run."""
    timing: dict[str, Any] = {"runtime": device}
    if composed is not None:
        return {**timing, "timer": "host wall clock: engines + ONNX Runtime segments + copies",
                **measure(lambda: composed(feed), bench_cfg, batch_size(feed))}

    def timed(path: Path) -> dict:
        return open_engine(path).measure(feed, bench_cfg["warmup"], bench_cfg["iterations"], bench_cfg["repeats"])
    timing.update(timed(engine), timer="cuda events: p50_ms... is GPU compute (execute_async_v3); h2d/d2h "
                  "copies apart (from pinned memory, staged before timing); throughput_per_s counts whole requests")
    if baseline is not None:  # engine vs engine
        timing["baseline_p50_ms"] = timed(baseline)["p50_ms"]
        timing["quantized_but_slower"] = bool(timing["p50_ms"] > timing["baseline_p50_ms"])
    return timing


def baseline_note(precision: str, baseline: str, compute_capability: str, timing: dict | None) -> str:
    """Whether the quantized engine beat its baseline, in words (or what it takes to know)."""
    head = f"{precision} engine vs the {baseline} baseline: "
    if timing and "baseline_p50_ms" in timing:
        return head + ("QUANTIZED BUT SLOWER" if timing["quantized_but_slower"] else "quantized is faster")
    return head + "needs a GPU of compute capability " + compute_capability + " to time both engines"
