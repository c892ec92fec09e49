"""An engine's I/O tensors as plain data (`TensorSpec`, read from a deserialized engine by `engine_specs`) and the
host-side decisions over them: feed checks, the optimization profile that contains a feed, output sizes, what a
captured CUDA graph depends on. Plain functions, so they are tested without a GPU."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.common.errors import StageError

# TensorRT DataType name -> numpy dtype; BF16, FP8, INT4, FP4 and E8M0 have none, so an engine with such an input or
# output cannot be fed from numpy (a strongly typed graph should keep its I/O in fp32/fp16/int types).
NUMPY_OF = {"FLOAT": "float32", "HALF": "float16", "INT8": "int8", "INT32": "int32", "INT64": "int64", "BOOL": "bool",
            "UINT8": "uint8"}

Range = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # (min, opt, max)


@dataclass(frozen=True)
class TensorSpec:
    """One I/O tensor of an engine, as `ICudaEngine` describes it."""

    name: str
    is_input: bool
    dtype: str  # TensorRT's DataType name: FLOAT, HALF, INT32, ...
    shape: tuple[int, ...]  # -1 for a dimension known only at run time
    host: bool = False  # TensorLocation.HOST: a shape tensor, read from (input) or written to (output) host memory
    profiles: tuple[Range, ...] = ()  # inputs: per optimization profile, the (min, opt, max) dimensions
    values: tuple[Range, ...] = ()  # shape-tensor inputs: per profile, the (min, opt, max) values

    def numpy_dtype(self, stage: str = "validate") -> np.dtype:
        if self.dtype not in NUMPY_OF:
            raise StageError(f"engine tensor {self.name!r} has type {self.dtype}, which numpy cannot hold", stage=stage,
                             fix="keep the model's inputs and outputs in fp32/fp16/int types (cast inside the graph)")
        return np.dtype(NUMPY_OF[self.dtype])


def engine_specs(engine, trt) -> list[TensorSpec]:
    """The engine's I/O tensors (needs a deserialized engine, i.e. a GPU)."""
    specs = []
    n_profiles = engine.num_optimization_profiles
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        host = engine.get_tensor_location(name) == trt.TensorLocation.HOST
        shape = tuple(engine.get_tensor_shape(name))
        profiles, values = (), ()
        if is_input and -1 not in shape:  # static: every profile holds exactly this shape
            profiles = ((shape, shape, shape),) * n_profiles
        elif is_input:
            profiles = tuple(tuple(tuple(d) for d in engine.get_tensor_profile_shape(name, p)) for p in range(n_profiles))
        if is_input and host and engine.is_shape_inference_io(name):  # a shape tensor: its values have ranges too
            values = tuple(tuple(tuple(v) for v in engine.get_tensor_profile_values(p, name)) for p in range(n_profiles))
        specs.append(TensorSpec(name, is_input, engine.get_tensor_dtype(name).name, shape, host, profiles, values))
    return specs


def check_feed(specs: list[TensorSpec], feed: dict[str, Any], stage: str = "validate") -> dict[str, np.ndarray]:
    """The engine's inputs from the feed as contiguous arrays, checked: names, dtypes, ranks and fixed dims. Arrays
    for names the engine has no input for are left out (TensorRT drops inputs the network does not use)."""
    inputs = {s.name: s for s in specs if s.is_input}
    missing = sorted(set(inputs) - set(feed))
    if missing:
        raise StageError(f"the feed {sorted(feed)} lacks the engine's inputs {missing}", stage=stage,
                         fix=f"feed every input of the engine: {sorted(inputs)}")
    out = {}
    for name, s in inputs.items():
        arr = np.ascontiguousarray(feed[name])
        want = s.numpy_dtype(stage)
        if arr.dtype != want:
            raise StageError(f"input {name!r} is {arr.dtype}, the engine's tensor is {s.dtype} ({want})", stage=stage,
                             fix=f"feed {want} arrays for {name!r} (the engine does not convert types)")
        if len(arr.shape) != len(s.shape) or any(d != -1 and d != a for d, a in zip(s.shape, arr.shape)):
            raise StageError(f"input {name!r} has shape {list(arr.shape)}, the engine's tensor is {list(s.shape)} "
                             f"(-1: set at run time)", stage=stage, fix=f"feed {name!r} with a shape of that form")
        out[name] = arr
    return out


def _inside(value: tuple[int, ...], rng: Range) -> bool:
    lo, _, hi = rng
    return len(value) == len(lo) and all(a <= v <= b for v, a, b in zip(value, lo, hi))


def choose_profile(specs: list[TensorSpec], feed: dict[str, np.ndarray], stage: str = "validate") -> int:
    """The first optimization profile whose ranges contain every input's shape (and a shape tensor's values)."""
    inputs = [s for s in specs if s.is_input]
    n = max((len(s.profiles) for s in inputs), default=1)
    for p in range(n):
        if all(_inside(tuple(feed[s.name].shape), s.profiles[p]) and
               (not s.values or _inside(tuple(int(v) for v in feed[s.name].ravel()), s.values[p])) for s in inputs):
            return p
    shapes = {s.name: list(feed[s.name].shape) for s in inputs}
    ranges = "; ".join(f"profile {p}: " + ", ".join(f"{s.name} {list(s.profiles[p][0])}..{list(s.profiles[p][2])}"
                                                    for s in inputs) for p in range(n))
    raise StageError(f"inputs {shapes} fit none of the engine's {n} optimization profiles ({ranges})", stage=stage,
                     fix="feed shapes inside a profile, or widen model.profiles and rebuild")


def output_plan(specs: list[TensorSpec], shapes: dict[str, tuple[int, ...]]) -> dict[str, int | None]:
    """Bytes to allocate per output once the input shapes are set (`shapes`: `get_tensor_shape` of each output);
    None for an output whose shape depends on the data (a -1 left): it needs an IOutputAllocator."""
    plan = {}
    for s in specs:
        if s.is_input:
            continue
        shape = tuple(shapes[s.name])
        plan[s.name] = None if any(d < 0 for d in shape) else int(np.prod(shape, dtype=np.int64)) * s.numpy_dtype().itemsize
    return plan


def graph_binding(profile: int | None, shapes: dict[str, tuple[int, ...]], device: dict[str, int],
                  host: dict[str, int]) -> tuple:
    """What a captured CUDA graph depends on: the optimization profile, every input shape and every tensor address
    (device buffers are reallocated when a larger shape needs more memory; host shape tensors move with each feed)."""
    return (profile, tuple(sorted((n, tuple(int(d) for d in s)) for n, s in shapes.items())),
            tuple(sorted(device.items())), tuple(sorted(host.items())))


def binding_unchanged(captured: tuple | None, now: tuple) -> bool:
    """Whether a graph captured with ``captured`` may be replayed for ``now`` (anything else re-captures)."""
    return captured is not None and captured == now
