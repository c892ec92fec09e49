"""CUDA through `cuda-bindings` (installed with the project, imported only when an engine is run, i.e. on a GPU
host): the library versions, the few runtime calls the engine runner makes (each result checked), device and pinned
host buffers, and the IOutputAllocator for outputs sized by the data."""
from __future__ import annotations

import ctypes

import numpy as np

from tasks.common.errors import StageError


def cuda_versions() -> dict[str, str]:
    """The CUDA runtime and driver versions, read from the libraries ("not present" when they are not)."""
    def fmt(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"

    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return {"cuda_runtime": "not present", "cuda_driver": "not present"}
    err, rt = cudart.cudaRuntimeGetVersion()
    runtime = fmt(rt) if err == cudart.cudaError_t.cudaSuccess and rt else "not present"
    err, drv = cudart.cudaDriverGetVersion()  # 0 when no driver is installed
    driver = fmt(drv) if err == cudart.cudaError_t.cudaSuccess and drv else "not present"
    return {"cuda_runtime": runtime, "cuda_driver": driver}


class Cuda:
    """The few CUDA runtime calls the engine runner needs; every result is checked."""

    def __init__(self, stage: str = "validate"):
        try:
            from cuda.bindings import runtime as cudart
        except ImportError as e:
            raise StageError(f"the CUDA runtime bindings are not installed ({e})", stage=stage,
                             fix="pip install cuda-bindings (a dependency of trtforge; reinstall the project)") from None
        self.rt = cudart
        self.stage = stage

    def __call__(self, name: str, *args):
        result = getattr(self.rt, name)(*args)
        err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if err != self.rt.cudaError_t.cudaSuccess:
            _, text = self.rt.cudaGetErrorString(err)
            raise StageError(f"CUDA {name} failed: {err.name}: {text.decode(errors='replace')}", stage=self.stage)
        return rest[0] if len(rest) == 1 else (rest or None)

    def h2d(self, dst: int, src: int, nbytes: int, stream) -> None:
        self("cudaMemcpyAsync", dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream)

    def d2h(self, dst: int, src: int, nbytes: int, stream) -> None:
        self("cudaMemcpyAsync", dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream)


class Buffers:
    """Device buffers and pinned host buffers by tensor name, grown as needed, freed together."""

    def __init__(self, cuda: Cuda):
        self.cuda = cuda
        self.device: dict[str, tuple[int, int]] = {}  # name -> (pointer, bytes)
        self.pinned: dict[str, tuple[int, int]] = {}

    def _grow(self, table: dict, name: str, nbytes: int, alloc: str, free: str) -> int:
        ptr, have = table.get(name, (0, 0))
        if have < max(nbytes, 1):
            if ptr:
                self.cuda(free, ptr)
            ptr, have = self.cuda(alloc, max(nbytes, 1)), max(nbytes, 1)
            table[name] = (ptr, have)
        return ptr

    def dev(self, name: str, nbytes: int) -> int:
        return self._grow(self.device, name, nbytes, "cudaMalloc", "cudaFree")

    def host(self, name: str, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        ptr = self._grow(self.pinned, name, nbytes, "cudaMallocHost", "cudaFreeHost")
        raw = (ctypes.c_byte * max(nbytes, 1)).from_address(ptr)
        return np.frombuffer(raw, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)

    def free(self) -> None:
        for ptr, _ in self.device.values():
            self.cuda("cudaFree", ptr)
        for ptr, _ in self.pinned.values():
            self.cuda("cudaFreeHost", ptr)
        self.device.clear()
        self.pinned.clear()


def output_allocator(trt, buffers: Buffers):
    """An IOutputAllocator for outputs whose size is known only after execution (NonZero, NMS)."""

    class OutputAllocator(trt.IOutputAllocator):
        def __init__(self):
            trt.IOutputAllocator.__init__(self)
            self.shapes: dict[str, tuple[int, ...]] = {}

        def reallocate_output(self, tensor_name, memory, size, alignment):
            return buffers.dev(tensor_name, int(size))

        def reallocate_output_async(self, tensor_name, memory, size, alignment, stream):
            return buffers.dev(tensor_name, int(size))

        def notify_shape(self, tensor_name, shape):
            self.shapes[tensor_name] = tuple(shape)

    return OutputAllocator()
