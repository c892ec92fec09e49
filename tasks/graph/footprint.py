"""What a model surely needs in memory, known without running it: the parts of the lower bound a build is checked
against its memory budget with before any heavy stage (tasks/common/memory.py ``fit_check``).

* **weights**: the ONNX file and its external data, in bytes as stored (a build holds the graph and ONNX Runtime's copy
  of them at least).
* **largest step**: the node whose inputs and outputs take the most bytes at a profile's max shapes, where static shape
  inference (with data propagation) knows every dim of them; a node whose sizes it cannot know counts nothing, so this
  too stays a lower bound. When ONNX Runtime runs that node, its inputs and outputs are all alive.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

SMALL_ELEMENTS = 64  # initializers up to this many elements keep their values for shape inference (shape constants)


@dataclass(frozen=True)
class Step:
    """The largest step found: ``bytes`` of ``node``'s inputs and outputs at ``profile``'s max shapes."""
    bytes: int
    node: str
    profile: int
    tensor: str  # its largest tensor
    shape: tuple


def weights_bytes(path: Path, model: onnx.ModelProto | None = None) -> tuple[int, list[Path]]:
    """The bytes of the model file and its external data files (``model``: loaded without its external data, to list
    them), and those files."""
    from tasks.graph.load import external_data_files

    size = Path(path).stat().st_size
    side = [f for f in external_data_files(model, Path(path).parent) if f.is_file()] if model is not None else []
    return size + sum(f.stat().st_size for f in side), side


def largest_step(model: onnx.ModelProto, profiles: list[dict], inputs_at: dict[str, list[int]] | None = None) -> Step | None:
    """The node whose inputs and outputs take the most bytes at any profile's max shapes (static inputs at their own
    shape), where shape inference knows all their dims; None where it knows none. ``inputs_at``: fixed shapes of
    inputs no profile names."""
    best: Step | None = None
    for k, prof in enumerate(profiles or [{}]):
        shapes = {**(inputs_at or {}), **{n: list(r["max"]) for n, r in prof.items()}}
        sizes = value_bytes(model, shapes)
        if not sizes:
            continue
        for node in model.graph.node:
            names = [x for x in (*node.input, *node.output) if x in sizes]
            total = sum(sizes[x][0] for x in set(names))
            if names and (best is None or total > best.bytes):
                top = max(set(names), key=lambda x: sizes[x][0])
                best = Step(total, node.name or node.op_type, k, top, sizes[top][1])
    return best


def value_bytes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> dict[str, tuple[int, tuple]]:
    """{value: (bytes, shape)} of every value whose dims shape inference knows with the inputs at ``shapes``
    (initializers, which are weights, left out)."""
    light = _light(model, shapes)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # noqa: BLE001 - a graph ONNX cannot infer: nothing known, nothing counted
        return {}
    weights = {t.name for t in model.graph.initializer}
    out = {}
    for v in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        if v.name in weights or not v.type.HasField("tensor_type"):
            continue
        tt = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape") else None
        if dims is None or any(d is None or d < 0 for d in dims) or tt.elem_type == 0:
            continue
        item = itemsize(tt.elem_type)
        if item is None:  # strings: not counted
            continue
        out[v.name] = (int(np.prod(dims, dtype=np.int64)) * item, tuple(dims))
    return out


def itemsize(elem_type: int | None) -> int | None:
    """Bytes of one element of ONNX type ``elem_type``; None where it is unknown or numpy has no size for it
    (strings)."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize if elem_type else None
    except Exception:  # noqa: BLE001 - a type numpy has no size for
        return None


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """{value: ONNX element type} of every value whose type shape inference knows (read on the graph without its
    weights' values: no copy of them)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(_light(model, {}))
    except Exception:  # noqa: BLE001 - a graph ONNX cannot infer: no type known
        return {}
    return {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.input, *inferred.graph.value_info,
                                                           *inferred.graph.output)
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}


def _light(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """``model`` for shape inference: the inputs at ``shapes``, large initializers without their values (their dims and
    type are all inference needs; small ones keep theirs, for the shapes they hold)."""
    g = model.graph
    light = onnx.ModelProto()
    light.ir_version, light.producer_name = model.ir_version, model.producer_name
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    lg = light.graph
    lg.name = g.name
    lg.node.extend(g.node)
    lg.output.extend(g.output)
    for i in g.input:
        v = lg.input.add()
        v.CopyFrom(i)
        if i.name in shapes and v.type.HasField("tensor_type"):
            dims = v.type.tensor_type.shape.dim
            for d, n in zip(dims, shapes[i.name]):
                d.Clear()
                d.dim_value = int(n)
    for t in g.initializer:
        c = lg.initializer.add()
        if int(np.prod(t.dims, dtype=np.int64)) <= SMALL_ELEMENTS and t.data_location != onnx.TensorProto.EXTERNAL:
            c.CopyFrom(t)
            continue
        c.name, c.data_type = t.name, t.data_type
        c.dims.extend(t.dims)
        c.data_location = onnx.TensorProto.EXTERNAL  # values not needed: never read by shape inference
        e = c.external_data.add()
        e.key, e.value = "location", "not-read"
    return light


def estimate_of(path: Path, model: onnx.ModelProto | None, resident: int, profiles: list[dict] | None = None,
                inputs_at: dict[str, list[int]] | None = None, key: str = "model.source"):
    """The lower bound of a build's peak (tasks.common.memory.Estimate) for the model at ``path`` (``model``: loaded,
    with or without its external data; None: the file alone, not read yet), its processes holding ``resident`` bytes
    now. ``profiles``: the checked profiles when a stage runs the model at their max shapes (validate on generated
    inputs), else None (no step counted: nothing runs the model at them). ``key``: the config key naming the model."""
    from tasks.common.memory import Estimate

    weights, side = weights_bytes(path, model)
    what = f"{Path(path).name}" + (f" and {len(side)} external data file{'s' * (len(side) > 1)}" if side else "")
    step = largest_step(model, profiles, inputs_at) if profiles is not None and model is not None else None
    if step is None:
        return Estimate(resident, weights, what, weights_key=key)
    prof = profiles[step.profile] if profiles else {}
    at = ", ".join(f"{n} {list(r['max'])}" for n, r in prof.items())
    where = f"model.profiles[{step.profile}]" if prof else None
    dtype_shape = f"{step.tensor!r} {list(step.shape)}"
    return Estimate(resident, weights, what, step.bytes,
                    f"the largest step at the max shapes ({at or 'the static shapes'}): node {step.node!r}, its inputs "
                    f"and outputs (the largest {dtype_shape}) alive at once as ONNX Runtime runs it in validate",
                    where, key)
