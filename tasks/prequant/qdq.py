"""The constants of Q/DQ nodes, read and written: a node's zero point, what DequantizeLinear computes on a constant, an
initializer added, a DequantizeLinear removed. Shared by the rewrites of activation pairs and of weights for TensorRT."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from tasks.graph.edit import redirect_reads

LAYERS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def zero_point(node, inits) -> np.ndarray | None:
    if len(node.input) < 3 or not node.input[2]:
        return np.zeros((), np.uint8)  # the ONNX default is uint8 0
    t = inits.get(node.input[2])
    return numpy_helper.to_array(t) if t is not None else None


def is_fp8(a: np.ndarray) -> bool:
    return "float8" in str(a.dtype)


def dequantize(dq, inits) -> np.ndarray:
    """What DequantizeLinear computes on a constant, as ONNX Runtime does: float32(x - zero_point) * scale, per axis
    when the scale is a vector, per block with block_size."""
    x = numpy_helper.to_array(inits[dq.input[0]])
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float32)
    zp = zero_point(dq, inits)
    zp = np.zeros(scale.shape, np.int64) if zp is None or is_fp8(zp) else zp.astype(np.int64)
    attrs = {a.name: a.i for a in dq.attribute}
    if attrs.get("block_size"):  # blocked quantization (opset 21): scale and zero point repeat along the axis
        axis, block = attrs.get("axis", 1) % x.ndim, attrs["block_size"]
        scale, zp = (np.repeat(a, block, axis=axis).take(range(x.shape[axis]), axis=axis) for a in (scale, zp))
    elif scale.ndim == 1 and x.ndim > 1:
        axis = attrs.get("axis", 1) % x.ndim
        shape = [1] * x.ndim
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    if is_fp8(x):
        return x.astype(np.float32) * scale
    return (x.astype(np.int64) - zp).astype(np.float32) * scale


def add_initializer(g, inits, name: str, value: np.ndarray) -> None:
    inits[name] = numpy_helper.from_array(value, name)
    g.initializer.append(inits[name])


def bypass(g, dq, new: str) -> None:
    """Remove a DequantizeLinear: every reader of its output reads `new`; a graph output keeps its name (Identity)."""
    old = dq.output[0]
    g.node.remove(dq)
    redirect_reads(g.node, {old: new})
    if any(o.name == old for o in g.output):
        g.node.append(onnx.helper.make_node("Identity", [new], [old], name=f"{old}_passthrough"))
