"""model.constants: binding graph inputs to constants and folding what that decides (the If nodes on them, and
what no output needs any more)."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from tasks.common.errors import ConfigError
from tasks.graph.edit import CONTROL_FLOW, prune_unused, toposort
from tasks.graph.fold import fold_constant_nodes, fold_constants, fold_ifs, pin_fixed_dims
from tasks.graph.models import ONNX_DTYPES, value_dims


def array_from_constant(name: str, value: Any, dtype: str, shape: list) -> np.ndarray:
    """A `model.constants.<name>` value (scalar or nested list) as an array of the input's own dtype and shape;
    a ConfigError naming the key when its rank, static dims or type do not fit the input."""
    key = f"model.constants.{name}"
    try:
        arr = np.asarray(value)
    except Exception:
        arr = np.asarray(None, dtype=object)
    want = f"rank {len(shape)} {list(shape)}, {dtype}"
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise ConfigError(f"{key}: input {name!r} has type {dtype}, which model.constants cannot bind",
                          fix=f"remove {key}") from None
    if arr.dtype.kind not in "biuf":
        raise ConfigError(f"{key}={value!r} is not a number or a list of numbers (input {name!r} is {want})",
                          fix=f"give {key} a value of input {name!r}'s shape, e.g. {key}={_example(dtype, shape)}")
    if arr.ndim != len(shape) or any(isinstance(d, int) and d != n for d, n in zip(shape, arr.shape)):
        raise ConfigError(f"{key}={value!r} has shape {list(arr.shape)} but input {name!r} is {want}",
                          fix=f"give {key} a value of that shape, e.g. {key}={_example(dtype, shape)}")
    if np_dtype.kind in "iub" and arr.dtype.kind == "f" and not np.all(arr == np.round(arr)):
        raise ConfigError(f"{key}={value!r} is not integral but input {name!r} is {dtype}",
                          fix=f"give {key} whole numbers, e.g. {key}={_example(dtype, shape)}")
    if np_dtype.kind == "b" and not np.isin(arr, (0, 1)).all():
        raise ConfigError(f"{key}={value!r} is not boolean but input {name!r} is bool", fix=f"use true/false for {key}")
    if np_dtype.kind in "iu" and not np.all((arr >= np.iinfo(np_dtype).min) & (arr <= np.iinfo(np_dtype).max)):
        raise ConfigError(f"{key}={value!r} does not fit input {name!r}'s type {dtype}", fix=f"give {key} a value in range")
    return arr.astype(np_dtype)


def _example(dtype: str, shape: list) -> str:
    one = "1" if np.dtype(dtype).kind in "iub" else "1.0"
    if np.prod([d if isinstance(d, int) else 1 for d in shape]) > 8:
        return f"<a nested list of shape {list(shape)}>"
    for d in reversed(shape):
        one = "[" + ", ".join([one] * (d if isinstance(d, int) else 1)) + "]"
    return one


def bind_inputs(model: onnx.ModelProto, constants: dict[str, Any]) -> list[str]:
    """Each graph input named in `constants` becomes an initializer of the input's own dtype and shape (its name
    kept, so every reader, subgraphs included, reads the value); returns notes."""
    g = model.graph
    notes = []
    keep = []
    for inp in g.input:
        if inp.name not in constants:
            keep.append(inp)
            continue
        dtype = ONNX_DTYPES.get(inp.type.tensor_type.elem_type, str(inp.type.tensor_type.elem_type))
        arr = array_from_constant(inp.name, constants[inp.name], dtype, value_dims(inp))
        g.initializer.append(numpy_helper.from_array(arr, inp.name))
        notes.append(f"input {inp.name!r} bound to {constants[inp.name]!r} (model.constants)")
    del g.input[:]
    g.input.extend(keep)
    found = {t.name for t in g.initializer}
    notes += [f"WARNING: model.constants.{n} names no input of the exported model" for n in constants if n not in found]
    return notes


def specialise(model: onnx.ModelProto, constants: dict[str, Any], profiles: list[dict]) -> list[str]:
    """model.constants: bind those inputs, then fold what they decide (If nodes on them, and the Ifs that open up
    inside the inlined branches, e.g. on shapes that are static now) and drop what no output needs. Returns notes."""
    notes = bind_inputs(model, constants)
    notes += pin_fixed_dims(model, profiles)
    n_nodes = len(model.graph.node)
    for _ in range(100):  # each round inlines at least one If; nested Ifs surface one level per round
        fold_constant_nodes(model)
        done = fold_ifs(model)
        notes += [n for n in done if n not in notes]
        if not any(not n.startswith("WARNING") for n in done):
            break
    fold_constants(model.graph)
    dropped = prune_unused(model.graph)
    toposort(model.graph)
    left = sorted({n.op_type for n in model.graph.node if n.op_type in CONTROL_FLOW})
    notes.append(f"{n_nodes} -> {len(model.graph.node)} top-level nodes ({dropped} unused dropped)"
                 + (f"; still control flow: {', '.join(left)}" if left else "; no control flow left"))
    return notes
