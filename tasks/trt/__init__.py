"""The TensorRT adapter: the backend (TensorRT-RTX embedded, Enterprise TensorRT by target), the network's precision and FLOPs, and engine execution on a GPU."""
from tasks.common.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "Backend": "backend",
    "Cuda": "cuda",
    "EngineRunner": "runtime",
    "backend_for_target": "backend",
    "cuda_versions": "cuda",
    "describe": "network",
    "describe_boundaries": "boundaries",
    "gpu_for": "backend",
    "host_gpus": "backend",
    "installed_version": "backend",
    "no_gpu_reason": "backend",
    "runtime_cache_file": "runtime",
})
