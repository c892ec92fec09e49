"""Running models: ONNX Runtime sessions on this host, and TensorRT engines where a supported GPU exists.

Engine execution uses the real TensorRT runtime API (deserialize, execution context, enqueue) with
Polygraphy's CUDA wrapper for device memory. It only runs on a GPU of the engine's compute capability;
callers check `backend.gpu_for(...)` first and report `skipped` with the reason otherwise.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .errors import StageError


def ort_session(path: Path, threads: int = 0, stage: str = "validate", basic: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if basic:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.log_severity_level = 4  # errors come back as exceptions; keep ORT's own printing quiet
    if threads:
        so.intra_op_num_threads = int(threads)
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise StageError(f"ONNX Runtime cannot load the model: {str(e).splitlines()[0][:300]}", stage=stage,
                         file=str(path)) from e


def ort_run(session, feed: dict[str, np.ndarray], stage: str = "validate") -> dict[str, np.ndarray]:
    try:
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feed)))
    except Exception as e:
        shapes = {k: list(v.shape) for k, v in feed.items()}
        raise StageError(f"ONNX Runtime failed on inputs {shapes}: {str(e).splitlines()[0][:300]}", stage=stage) from e


class EngineRunner:
    """Executes a serialized engine on the GPU (TensorRT runtime API, one execution context)."""

    def __init__(self, engine_bytes: bytes, backend):
        from polygraphy import cuda  # ctypes wrapper around libcudart

        self.cuda = cuda
        trt = self.trt = backend.trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise StageError("TensorRT could not deserialize the engine on this GPU", stage="validate")
        self.context = self.engine.create_execution_context()
        self.stream = cuda.Stream()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self._buffers: dict[str, object] = {}
        self._dtypes: dict[str, np.dtype] = {}

    def _device(self, name: str, shape, dtype):
        """A device buffer per tensor, reallocated when its dtype changes and resized to each shape."""
        dtype = np.dtype(dtype)
        buf = self._buffers.get(name)
        if buf is None or self._dtypes.get(name) != dtype:
            if buf is not None:
                buf.free()
            buf = self.cuda.DeviceArray(shape=tuple(shape), dtype=dtype)
            self._buffers[name], self._dtypes[name] = buf, dtype
        else:
            buf.resize(tuple(shape))
        return buf

    def enqueue(self, feed: dict[str, np.ndarray]) -> None:
        for name in self.inputs:
            arr = np.ascontiguousarray(feed[name])
            self.context.set_input_shape(name, arr.shape)
            dev = self._device(name, arr.shape, arr.dtype)
            dev.copy_from(arr, stream=self.stream)
            self.context.set_tensor_address(name, dev.ptr)
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name)))
            dev = self._device(name, shape, dtype)
            self.context.set_tensor_address(name, dev.ptr)
        if not self.context.execute_async_v3(self.stream.ptr):
            raise StageError("TensorRT execute_async_v3 failed", stage="validate")

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.enqueue(feed)
        out = {}
        for name in self.outputs:
            dev = self._buffers[name]
            host = np.empty(tuple(dev.shape), dtype=self._dtypes[name])
            dev.copy_to(host, stream=self.stream)
            out[name] = host
        self.stream.synchronize()
        return out

    def run(self, feed: dict[str, np.ndarray]) -> None:
        """One execution, waited for (outputs stay on the device): what engine timing measures."""
        self.enqueue(feed)
        self.stream.synchronize()

    def time(self, feed: dict[str, np.ndarray], warmup: int, iterations: int) -> list[float]:
        for _ in range(warmup):
            self.run(feed)
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            self.run(feed)
            times.append((time.perf_counter() - t0) * 1e3)
        return times
