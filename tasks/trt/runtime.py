"""Running TensorRT engines on a GPU of a supported compute capability (ONNX Runtime on this host: tasks/onnxrt/ort.py).

Engine execution follows the TensorRT / TensorRT-RTX Python runtime API (`IRuntime`, `ICudaEngine`,
`IExecutionContext.execute_async_v3`), with the CUDA runtime of `cuda-bindings` (installed with the project, imported
only when an engine is run, i.e. on a GPU host). Per call:

- the optimization profile that contains the feed is chosen and set (`set_optimization_profile_async`);
- every input shape is set (`set_input_shape`) and every address bound (`set_tensor_address`), each result checked;
- shape-tensor inputs (tensors whose values feed shapes, location HOST) are bound to host memory;
- outputs whose shape depends on the data (NonZero, NMS: still `-1` once the inputs are set) get an
  `IOutputAllocator`; the others a device buffer sized from `get_tensor_shape`;
- dtypes and ranks of the feed are checked against the engine's tensors before anything runs.

TensorRT-RTX engines run with an `IRuntimeConfig`: eager kernel specialization for dynamic shapes (the default, lazy,
runs fallback kernels while specialized ones compile in the background, which would spoil both outputs' timing and
the first runs) and a runtime cache of compiled kernels kept in a file per target. Timing uses CUDA events: GPU
compute (`execute_async_v3`) separately from the host-to-device and device-to-host copies (pinned host memory),
optionally replaying a CUDA graph.

The host-side decisions (profile choice, feed checks, output planning) are plain functions over `TensorSpec` in
tensors.py, so they are tested without a GPU; the CUDA calls and buffers are in cuda.py.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.common.timing import latency_stats
from tasks.common.errors import StageError
from tasks.data.inputs import batch_size
from tasks.trt.cuda import Buffers, Cuda, output_allocator
from tasks.trt.tensors import binding_unchanged, check_feed, choose_profile, engine_specs, graph_binding, output_plan


def runtime_cache_file(cache_dir: str | os.PathLike, target: str, backend_version: str) -> Path:
    """Where TensorRT-RTX's runtime cache (kernels compiled on the GPU) is kept: one file per target and backend."""
    return Path(cache_dir).expanduser() / "runtime-cache" / target / f"{backend_version}.bin"


class EngineRunner:
    """Executes a serialized engine on the GPU: one execution context, one stream; `close()` frees everything."""

    def __init__(self, engine_bytes: bytes, backend, runtime_cache: Path | None = None, cuda_graph: bool = False,
                 stage: str = "validate", pci_bus_id: str | None = None):
        """``pci_bus_id``: the GPU to run on (``GpuInfo.pci_bus_id`` of the one ``gpu_for`` chose); on a host with
        several GPUs CUDA's device 0 may be another one (CUDA orders devices fastest first, nvidia-smi by bus)."""
        self.stage, self.notes = stage, []  # notes: what the runner decided and why (e.g. a stale runtime cache)
        self.cuda = Cuda(stage)
        self.device = self.cuda("cudaDeviceGetByPCIBusId", pci_bus_id.encode()) if pci_bus_id else 0
        self.cuda("cudaSetDevice", self.device)  # this thread's current device: the context, stream, buffers live there
        self.cuda("cudaFree", 0)  # creates the CUDA context (the runtime cache checks against it)
        trt = self.trt = backend.trt
        self.logger = backend.logger()
        self.runtime = backend.runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise StageError(f"TensorRT could not deserialize the engine on this GPU: {self._log()}", stage=stage)
        self.specs = engine_specs(self.engine, trt)
        for s in self.specs:
            s.numpy_dtype(stage)  # refuse unfeedable I/O types before running anything
        self.cache_file, self.runtime_config, self.cuda_graph, self._rtx_graph = runtime_cache, None, cuda_graph, False
        if hasattr(self.engine, "create_runtime_config"):  # TensorRT-RTX (and TensorRT >= 10.11)
            self.runtime_config = self._runtime_config(trt, runtime_cache, cuda_graph)
            self.context = self.engine.create_execution_context(self.runtime_config)
        else:
            self.context = self.engine.create_execution_context()
        if self.context is None:
            raise StageError(f"TensorRT could not create an execution context: {self._log()}", stage=stage)
        self.stream = self.cuda("cudaStreamCreateWithFlags", self.cuda.rt.cudaStreamNonBlocking)
        self.events = [self.cuda("cudaEventCreate") for _ in range(4)]
        self.buffers = Buffers(self.cuda)
        self.allocator = output_allocator(trt, self.buffers)
        self.profile: int | None = None
        self.inputs = [s for s in self.specs if s.is_input]
        self.outputs = [s for s in self.specs if not s.is_input]
        self._host_inputs: dict[str, np.ndarray] = {}  # shape-tensor values, alive while TensorRT may read them
        self._host_outputs: dict[str, np.ndarray] = {}
        self._plan: dict[str, int | None] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._graph = None
        self._graph_binding: tuple | None = None  # what the captured graph was recorded with (see GraphBinding)
        self.recaptures = 0

    def _log(self) -> str:
        return " | ".join(self.logger.errors()[-3:]) or "no error message"

    def _check(self, ok: bool, what: str) -> None:
        if not ok:
            raise StageError(f"TensorRT {what} failed: {self._log()}", stage=self.stage)

    def _runtime_config(self, trt, cache_file: Path | None, cuda_graph: bool):
        cfg = self.engine.create_runtime_config()
        if hasattr(trt, "DynamicShapesKernelSpecializationStrategy"):
            # eager: shape-specialized kernels are compiled before the run that needs them, not in the background
            cfg.dynamic_shapes_kernel_specialization_strategy = trt.DynamicShapesKernelSpecializationStrategy.EAGER
        if cuda_graph and hasattr(trt, "CudaGraphStrategy"):
            # TensorRT-RTX captures and replays inside enqueue (after shape-specialized kernels exist); its API does
            # not say whether it did, so the timing says "requested", never "captured"
            cfg.cuda_graph_strategy = trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
            self._rtx_graph = cfg.cuda_graph_strategy == trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
            if not self._rtx_graph:
                self.notes.append("no CUDA graph: TensorRT-RTX did not take the whole-graph capture strategy")
        if cache_file is not None and hasattr(cfg, "create_runtime_cache"):
            cache = cfg.create_runtime_cache()
            if cache_file.is_file() and not cache.deserialize(cache_file.read_bytes()):
                self.notes.append(f"runtime cache {cache_file} was made for another GPU, driver or version: rebuilt")
            self._check(cfg.set_runtime_cache(cache), "set_runtime_cache")
            self._runtime_cache = cache
        return cfg

    # -- one execution ---------------------------------------------------------------------------------------------

    def _bind(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Choose and set the profile, set input shapes and addresses, plan and bind the outputs."""
        feed = check_feed(self.specs, feed, self.stage)
        p = choose_profile(self.specs, feed, self.stage)
        if p != self.profile:
            self._check(self.context.set_optimization_profile_async(p, int(self.stream)),
                        f"set_optimization_profile_async({p})")
            self.profile = p
        for s in self.inputs:
            arr = feed[s.name]
            self._check(self.context.set_input_shape(s.name, arr.shape), f"set_input_shape({s.name!r}, {list(arr.shape)})")
            if s.host:  # a shape tensor: TensorRT reads its values from host memory
                self._host_inputs[s.name] = arr
                self._check(self.context.set_tensor_address(s.name, arr.ctypes.data), f"set_tensor_address({s.name!r})")
            else:
                self._check(self.context.set_tensor_address(s.name, self.buffers.dev(s.name, arr.nbytes)),
                            f"set_tensor_address({s.name!r})")
        missing = self.context.infer_shapes()
        if missing:
            raise StageError(f"TensorRT cannot infer shapes; insufficiently specified: {missing}", stage=self.stage)
        self._shapes = {s.name: tuple(self.context.get_tensor_shape(s.name)) for s in self.outputs}
        self._plan = output_plan(self.specs, self._shapes)
        for s in self.outputs:
            nbytes = self._plan[s.name]
            if nbytes is None:  # data-dependent: TensorRT asks the allocator once it knows the size
                self._check(self.context.set_output_allocator(s.name, self.allocator), f"set_output_allocator({s.name!r})")
            elif s.host:
                self._host_outputs[s.name] = np.empty(self._shapes[s.name], s.numpy_dtype())
                self._check(self.context.set_tensor_address(s.name, self._host_outputs[s.name].ctypes.data),
                            f"set_tensor_address({s.name!r})")
            else:
                self._check(self.context.set_tensor_address(s.name, self.buffers.dev(s.name, nbytes)),
                            f"set_tensor_address({s.name!r})")
        if self._graph is not None and not binding_unchanged(self._graph_binding, self._binding(feed)):
            self._drop_graph()  # a graph replays the shapes and addresses it was captured with: never replay it stale
        return feed

    def _binding(self, feed: dict[str, np.ndarray]) -> tuple:
        return graph_binding(self.profile, {n: a.shape for n, a in feed.items()},
                             {n: p for n, (p, _) in self.buffers.device.items()},
                             {n: a.ctypes.data for n, a in {**self._host_inputs, **self._host_outputs}.items()})

    def _stage(self, feed: dict[str, np.ndarray]) -> None:
        """Copy the inputs into pinned host memory (a host-side copy: not part of the timed host-to-device transfer)."""
        for s in self.inputs:
            if not s.host:
                arr = feed[s.name]
                self.buffers.host(s.name, arr.nbytes, arr.dtype, arr.shape)[...] = arr

    def _upload(self, feed: dict[str, np.ndarray]) -> None:
        for s in self.inputs:
            if not s.host:
                self.cuda.h2d(self.buffers.device[s.name][0], self.buffers.pinned[s.name][0], feed[s.name].nbytes,
                              self.stream)

    def _execute(self) -> None:
        if self._graph is not None:
            self.cuda("cudaGraphLaunch", self._graph, self.stream)
        else:
            self._check(self.context.execute_async_v3(int(self.stream)), "execute_async_v3")

    def _download(self) -> dict[str, np.ndarray]:
        out = {}
        for s in self.outputs:
            if s.host and self._plan[s.name] is not None:
                out[s.name] = self._host_outputs[s.name]
                continue
            shape = self.allocator.shapes[s.name] if self._plan[s.name] is None else self._shapes[s.name]
            dtype = s.numpy_dtype()
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            out[s.name] = self.buffers.host(s.name, nbytes, dtype, shape)
            if nbytes:
                self.cuda.d2h(self.buffers.pinned[s.name][0], self.buffers.device[s.name][0], nbytes, self.stream)
        return out

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs for one feed (copied off the pinned buffers)."""
        feed = self._bind(feed)
        self._stage(feed)
        self._upload(feed)
        self._execute()
        self.cuda("cudaStreamSynchronize", self.stream)  # data-dependent shapes are known only now
        out = self._download()
        self.cuda("cudaStreamSynchronize", self.stream)
        return {k: np.array(v, copy=True) for k, v in out.items()}

    # -- timing ------------------------------------------------------------------------------------------------------

    def _capture_graph(self) -> None:
        """Enterprise TensorRT: replay execute_async_v3 as a CUDA graph (TensorRT-RTX captures it itself)."""
        if self._rtx_graph:
            return
        if any(v is None for v in self._plan.values()):
            self.notes.append("no CUDA graph: an output's shape depends on the data")
            return
        if not self.context.is_stream_capturable(int(self.stream)):
            self.notes.append("no CUDA graph: TensorRT says this context cannot be captured on the stream")
            return
        rt = self.cuda.rt
        self.cuda("cudaStreamBeginCapture", self.stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)
        ok = self.context.execute_async_v3(int(self.stream))
        graph = self.cuda("cudaStreamEndCapture", self.stream)
        self._check(ok, "execute_async_v3 (CUDA graph capture)")
        self._graph = self.cuda("cudaGraphInstantiate", graph, 0)
        self._graph_def = graph
        self._graph_binding = self._binding(self._bound_feed)

    def _drop_graph(self) -> None:
        self.cuda("cudaStreamSynchronize", self.stream)
        self.cuda("cudaGraphExecDestroy", self._graph)
        self.cuda("cudaGraphDestroy", self._graph_def)
        self._graph = self._graph_binding = None
        self.recaptures += 1

    def measure(self, feed: dict[str, np.ndarray], warmup: int, iterations: int, repeats: int = 1) -> dict[str, Any]:
        """CUDA-event timing per run: host-to-device copy, GPU compute (execute_async_v3) and device-to-host copy,
        each in ms, plus the host-side wall time of the whole run. Warm-up runs come first (the first one is the
        cold start: kernel specialization, lazy loading) and are reported apart."""
        feed = self._bind(feed)
        self._bound_feed = feed
        self._stage(feed)  # once: the copy into pinned memory is host work, outside the timed transfer
        e0, e1, e2, e3 = self.events
        runs: list[tuple[float, float, float, float]] = []

        def once() -> None:
            t = time.perf_counter()
            self.cuda("cudaEventRecord", e0, self.stream)
            self._upload(feed)
            self.cuda("cudaEventRecord", e1, self.stream)
            self._execute()
            self.cuda("cudaEventRecord", e2, self.stream)
            self._download()
            self.cuda("cudaEventRecord", e3, self.stream)
            self.cuda("cudaEventSynchronize", e3)
            runs.append((self.cuda("cudaEventElapsedTime", e0, e1), self.cuda("cudaEventElapsedTime", e1, e2),
                         self.cuda("cudaEventElapsedTime", e2, e3), (time.perf_counter() - t) * 1e3))

        for _ in range(max(1, warmup)):
            once()
        warm, runs[:] = list(runs), []
        if self.cuda_graph and self._graph is None:
            self._capture_graph()
        medians = []
        for _ in range(max(1, repeats)):
            start = len(runs)
            for _ in range(max(1, iterations)):
                once()
            medians.append(float(np.median([r[1] for r in runs[start:]])))
        h2d, gpu, d2h, wall = (list(x) for x in zip(*runs))
        graph = {"cuda_graph": "captured" if self._graph is not None else
                 "requested (TensorRT-RTX whole-graph capture; the runtime does not report whether it captured)"
                 if self._rtx_graph else "requested, not captured" if self.cuda_graph else "off"}
        return {"timer": "cuda events", **graph, "cuda_graph_recaptures": self.recaptures, "device": self.device,
                "profile": self.profile, "first_run_ms": warm[0][3], "first_run_gpu_ms": warm[0][1],
                "warmup_gpu_ms": [w[1] for w in warm],
                # latency: GPU compute (execute_async_v3); throughput: whole requests, h2d + compute + d2h, one stream
                **latency_stats(gpu, medians, batch_size(feed), [a + b + c for a, b, c in zip(h2d, gpu, d2h)]),
                "h2d_ms": float(np.median(h2d)), "d2h_ms": float(np.median(d2h)),
                "end_to_end_p50_ms": float(np.percentile(wall, 50)), "runs": len(runs), "notes": list(self.notes)}

    # -- resources ---------------------------------------------------------------------------------------------------

    def save_runtime_cache(self) -> None:
        cache = getattr(self, "_runtime_cache", None)
        if cache is None or self.cache_file is None:
            return
        blob = cache.serialize()
        if blob is None or not blob.nbytes:
            return
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_file.with_name(f".{self.cache_file.name}.{os.getpid()}")
        tmp.write_bytes(bytes(blob))
        tmp.replace(self.cache_file)

    def close(self) -> None:
        """Save the runtime cache, free buffers, events, graph and stream, release TensorRT objects."""
        if getattr(self, "stream", None) is None:
            return
        try:
            self.cuda("cudaStreamSynchronize", self.stream)
            self.save_runtime_cache()
        finally:
            if self._graph is not None:
                self._drop_graph()
            self.buffers.free()
            for e in self.events:
                self.cuda("cudaEventDestroy", e)
            self.cuda("cudaStreamDestroy", self.stream)
            self.stream = None
            self.context = self.runtime_config = self.engine = self.runtime = None

    def __enter__(self) -> "EngineRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
