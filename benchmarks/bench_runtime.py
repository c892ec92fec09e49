"""The engine runner (tasks/trt/runtime.py) against the raw TensorRT call it wraps, on a GPU of a TensorRT-RTX target.

    .venv/bin/python benchmarks/bench_runtime.py [--model ppocr_det] [--shape 1,3,480,480] [--iterations 50]

Builds the model's fp16 engine for this host's GPU, then times, with CUDA events on one stream:
1. raw: `execute_async_v3` in a loop on a context made with the defaults (TensorRT-RTX: lazy kernel
   specialization), inputs copied once;
2. runner: `EngineRunner.measure` (eager kernel specialization, runtime cache, pinned H2D/D2H timed apart);
3. runner with CUDA graphs (`cuda_graph=True`).
The first run of each is reported apart (cold start: kernel compilation). On a host without such a GPU it says so
and exits 0: engines cannot run there.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CCS = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")


def raw_timing(engine_bytes: bytes, backend, feed: dict[str, np.ndarray], iterations: int) -> dict:
    """The plain TensorRT + CUDA runtime calls, no checks beyond the return codes."""
    from tasks.trt import Cuda

    cuda, trt = Cuda("benchmark"), backend.trt
    cuda("cudaFree", 0)
    runtime = backend.runtime()  # the backend's logger (prints nothing)
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    context = engine.create_execution_context()
    stream = cuda("cudaStreamCreateWithFlags", cuda.rt.cudaStreamNonBlocking)
    ptrs = []
    for name, arr in feed.items():
        context.set_input_shape(name, arr.shape)
        ptr = cuda("cudaMalloc", arr.nbytes)
        cuda("cudaMemcpy", ptr, arr.ctypes.data, arr.nbytes, cuda.rt.cudaMemcpyKind.cudaMemcpyHostToDevice)
        context.set_tensor_address(name, ptr)
        ptrs.append(ptr)
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
            shape = context.get_tensor_shape(name)
            ptr = cuda("cudaMalloc", int(np.prod(shape)) * 4)
            context.set_tensor_address(name, ptr)
            ptrs.append(ptr)
    e0, e1 = cuda("cudaEventCreate"), cuda("cudaEventCreate")
    times = []
    for _ in range(iterations + 1):
        cuda("cudaEventRecord", e0, stream)
        context.execute_async_v3(int(stream))
        cuda("cudaEventRecord", e1, stream)
        cuda("cudaEventSynchronize", e1)
        times.append(cuda("cudaEventElapsedTime", e0, e1))
    for p in ptrs:
        cuda("cudaFree", p)
    cuda("cudaStreamDestroy", stream)
    return {"first_run_gpu_ms": times[0], "p50_ms": float(np.percentile(times[1:], 50)),
            "p99_ms": float(np.percentile(times[1:], 99))}


def main() -> int:
    from tasks.trt import Backend, gpu_for, no_gpu_reason

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ch_PP-OCRv4_det_infer.onnx")
    ap.add_argument("--shape", default="1,3,480,480")
    ap.add_argument("--iterations", type=int, default=50)
    a = ap.parse_args()
    cc = next((c for c in CCS if gpu_for(c)), None)
    if cc is None:
        print(f"bench_runtime: {no_gpu_reason('/'.join(CCS))}; nothing to time here")
        return 0
    from tasks.engines import engine_from_onnx, onnx_at_precision
    from tasks.graph import resolve_source
    from tasks.trt import EngineRunner

    backend = Backend("tensorrt_rtx")
    shape = [int(x) for x in a.shape.split(",")]
    prof = {"x": {"min": shape, "opt": shape, "max": shape}}
    feed = {"x": np.random.default_rng(0).random(shape, dtype=np.float32)}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        fp16 = onnx_at_precision(resolve_source(f"pkg://rapidocr_onnxruntime/models/{a.model}"), "fp16", d / "m.onnx")
        eng = engine_from_onnx(fp16.files["onnx"], d / "m.engine", [prof], cc,
                               {"optimization_level": 3, "workspace_mib": None}, backend, show_progress=False)
        blob = eng.files["engine"].read_bytes()
        rows = [("raw execute_async_v3 (defaults)", raw_timing(blob, backend, feed, a.iterations))]
        for label, graph in (("EngineRunner.measure", False), ("EngineRunner.measure, CUDA graph", True)):
            with EngineRunner(blob, backend, runtime_cache=d / "rc.bin", cuda_graph=graph, stage="benchmark") as r:
                rows.append((label, r.measure(feed, 3, a.iterations)))
    print(f"{a.model} fp16 {shape} on sm {cc}: GPU compute per run (CUDA events), ms")
    print(f"{'':<36} {'first':>8} {'p50':>8} {'p99':>8} {'h2d':>8} {'d2h':>8}")
    for label, t in rows:
        print(f"{label:<36} {t['first_run_gpu_ms']:8.3f} {t['p50_ms']:8.3f} {t['p99_ms']:8.3f} "
              f"{t.get('h2d_ms', float('nan')):8.3f} {t.get('d2h_ms', float('nan')):8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
