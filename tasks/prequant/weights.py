"""Quantized constants of a Q/DQ graph rewritten for TensorRT: int8 layer weights kept, uint8 with zero point 128
shifted to int8, 8-bit weights with another zero point as int8 codes plus a constant term (shifted) or requantized to
symmetric int8, the rest (int32 bias, 16-bit, other readers) folded to float; QuantizeLinear of a constant computed
once. The rules are in the module doc of tasks/prequant/rewrite.py."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from tasks.graph.edit import unique_name
from tasks.prequant.qdq import LAYERS, add_initializer, bypass, dequantize, is_fp8, zero_point


def rewrite_weights(g, inits, asymmetric: str, opset: int, stats: dict) -> tuple[set[int], int]:
    """Rewrite every DequantizeLinear of a constant of ``g`` for TensorRT, counting each kind in ``stats``. Returns (the
    ids of the layers that now read int8 weights, how many Conv/MatMul/Gemm layers the graph had before)."""
    int8_layers: set[int] = set()
    layers = {id(n): n for n in g.node if n.op_type in LAYERS}
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]:
        data = numpy_helper.to_array(inits[dq.input[0]])
        zp = zero_point(dq, inits)
        consumers = [n for n in g.node if dq.output[0] in n.input]
        if data.dtype == np.uint8 and zp is not None and (zp == 128).all():
            name = unique_name(dq.input[0] + "_int8", inits)
            add_initializer(g, inits, name, (data.astype(np.int16) - 128).astype(np.int8))
            zname = unique_name(dq.input[2] + "_int8", inits)
            add_initializer(g, inits, zname, np.zeros(zp.shape, np.int8))
            dq.input[0], dq.input[2] = name, zname
            stats["int8_from_uint8"] += 1
        elif (is_fp8(data) or (data.dtype == np.int8 and (zp is None or not zp.any()))) and consumers \
                and all(_weight_of(c, dq.output[0]) or _gathered(c, dq) for c in consumers):
            pass  # a layer's int8 weights; a quantized constant elsewhere (an Add's operand, QLinearAdd's constant
            # after the rewrite) gains nothing in int8 and the parser's broadcast reshape would separate it from its DQ
        elif asymmetric == "exact" and opset >= 13 and _shifted_int8_weights(g, dq, inits, consumers):
            stats["shifted_weights"] = stats.get("shifted_weights", 0) + 1
        elif (asymmetric == "int8" and consumers and all(_weight_of(c, dq.output[0]) for c in consumers)
              and _symmetric_int8_weights(g, dq, inits, consumers, per_channel=opset >= 13)):
            stats["requantized_weights"] += 1
        else:
            name = unique_name(dq.output[0] + "_float", inits)  # int32 bias, other zero points, 16-bit: float constants
            add_initializer(g, inits, name, dequantize(dq, inits))
            bypass(g, dq, name)
            stats["folded_constants"] += 1
            continue
        int8_layers.update(id(c) for c in consumers if id(c) in layers)
    return int8_layers, len(layers)


def _weight_of(node, tensor: str) -> bool:
    """Whether `tensor` is a weight operand of a Conv/ConvTranspose/Gemm/MatMul (not a bias: TensorRT takes bias in float)."""
    if node.op_type not in LAYERS:
        return False
    operands = node.input[:2] if node.op_type in ("MatMul", "Gemm") else node.input[1:2]
    return tensor in operands


def _gathered(node, dq) -> bool:
    """Whether ``node`` gathers rows of ``dq``'s output (an embedding table stored int8 with a scale per row): TensorRT
    builds int8 -> DequantizeLinear(axis 0) -> Gather(axis 0), the table staying int8."""
    if node.op_type != "Gather" or node.input[0] != dq.output[0]:
        return False
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    dq_axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    return axis == 0 and dq_axis == 0


def _output_channel_axis(node, tensor: str, ndim: int) -> int | None:
    """The output-channel axis of a layer's weight (TensorRT's per-channel axis), None where per tensor is safer."""
    attrs = {a.name: a.i for a in node.attribute}
    if node.op_type == "Conv" and node.input[1] == tensor:
        return 0
    if node.op_type == "MatMul" and node.input[1] == tensor and ndim == 2:
        return 1
    if node.op_type == "Gemm" and node.input[1] == tensor:
        return 0 if attrs.get("transB") else 1
    return None


def _shifted_int8_weights(g, dq, inits, readers: list) -> bool:
    """8-bit weights with a per-tensor zero point, exactly: W = (Wq - z) * s = Wq' * s + d with int8 codes Wq' = Wq - 128
    (uint8) or Wq (int8) and the constant d = (128 - z) * s or -z * s. Conv(x, W) = Conv(x, Wq' * s) + Conv(x, d) where
    the second term is a box sum of x (one float Conv with a constant kernel, broadcast over the output channels; per
    channel for a depthwise Conv); MatMul(x, W) = MatMul(x, Wq' * s) + d * ReduceSum(x, last axis). The layer keeps the
    model's weights as int8 (an int8 layer when its input is quantized)."""
    scale = numpy_helper.to_array(inits[dq.input[1]]) if dq.input[1] in inits else None
    zp = zero_point(dq, inits)
    data = numpy_helper.to_array(inits[dq.input[0]])
    if (scale is None or scale.size != 1 or zp is None or zp.size != 1 or data.dtype not in (np.uint8, np.int8)
            or zp.dtype != data.dtype or not readers or any(a.name == "block_size" for a in dq.attribute)):
        return False
    for r in readers:
        if r.op_type == "Conv" and r.input[1] == dq.output[0] and r.input[0] != dq.output[0]:
            group = next((a.i for a in r.attribute if a.name == "group"), 1)
            if group != 1 and group != data.shape[0]:
                return False
        elif not (r.op_type == "MatMul" and r.input[1] == dq.output[0] and r.input[0] != dq.output[0] and data.ndim == 2):
            return False
    codes = (data.astype(np.int16) - 128).astype(np.int8) if data.dtype == np.uint8 else data
    d = float(((128 if data.dtype == np.uint8 else 0) - int(zp.item())) * float(scale.item()))
    name, zname = unique_name(dq.input[0] + "_int8", inits), unique_name(dq.input[0] + "_zero_point_int8", inits)
    add_initializer(g, inits, name, codes)
    add_initializer(g, inits, zname, np.zeros((), np.int8))
    dq.input[:] = [name, dq.input[1], zname]
    for r in readers:
        if d == 0.0:
            continue
        taken = set(inits) | {o for n in g.node for o in n.output}
        out = r.output[0]
        r.output[0] = unique_name(f"{out}_int8_weights", taken)
        term = unique_name(f"{out}_weight_shift", taken | {r.output[0]})
        at = list(g.node).index(r) + 1
        if r.op_type == "Conv":
            group = next((a.i for a in r.attribute if a.name == "group"), 1)
            kname = unique_name(f"{term}_kernel", inits)
            shape = (1, *data.shape[1:]) if group == 1 else data.shape
            add_initializer(g, inits, kname, np.full(shape, d, dtype=scale.dtype))
            box = onnx.helper.make_node("Conv", [r.input[0], kname], [term], name=term)
            box.attribute.extend(a for a in r.attribute)
            nodes = [box]
        else:
            axes, dname, rs = (unique_name(f"{term}_{v}", taken | set(inits)) for v in ("axes", "d", "rowsum"))
            add_initializer(g, inits, axes, np.array([-1], np.int64))
            add_initializer(g, inits, dname, np.array(d, dtype=scale.dtype))
            nodes = [onnx.helper.make_node("ReduceSum", [r.input[0], axes], [rs], name=rs, keepdims=1),
                     onnx.helper.make_node("Mul", [rs, dname], [term], name=term)]
        nodes.append(onnx.helper.make_node("Add", [r.output[0], term], [out], name=f"{out}_with_weight_shift"))
        for node in reversed(nodes):
            g.node.insert(at, node)
    return True


def _symmetric_int8_weights(g, dq, inits, readers: list, per_channel: bool) -> bool:
    """8-bit weights with a zero point -> symmetric int8 with the scale of their own largest value per output channel
    (as TensorRT quantizes weights; per tensor where the layer has no clear channel axis). ONNX Runtime's default
    per-tensor asymmetric weights can hold outliers 190x their spread: one int8 step for the whole tensor would move
    them by up to 37% (PP-OCRv4 rec), per channel by 2%. Only when no weight moves by more than the model's own step."""
    attrs = {a.name: a.i for a in dq.attribute}
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float32)
    if attrs.get("block_size") or scale.ndim > 1:
        return False
    w = dequantize(dq, inits)
    if scale.size > 1:
        axis = attrs.get("axis", 1) % w.ndim
    else:
        axes = {_output_channel_axis(r, dq.output[0], w.ndim) for r in readers}
        axis = axes.pop() if len(axes) == 1 and per_channel else None
    others = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=others, keepdims=True) if axis is not None else np.abs(w).max()
    step = np.broadcast_to(scale.reshape(-1)[0] if scale.size == 1 else scale.reshape(amax.shape), np.shape(amax))
    new = np.where(amax > 0, amax / 127, step).astype(np.float32)
    wq = np.clip(np.rint(w / new), -127, 127).astype(np.int8)
    if (np.abs(wq * new - w) > step).any():
        return False
    name, sname = unique_name(dq.input[0] + "_int8", inits), unique_name(dq.input[1] + "_int8", inits)
    zname = unique_name(dq.input[2] + "_int8", inits)
    add_initializer(g, inits, name, wq)
    add_initializer(g, inits, sname, new.reshape(-1) if axis is not None else new.reshape(()))
    add_initializer(g, inits, zname, np.zeros(w.shape[axis], np.int8) if axis is not None else np.zeros((), np.int8))
    dq.input[:] = [name, sname, zname]
    del dq.attribute[:]
    if axis is not None:
        dq.attribute.append(onnx.helper.make_attribute("axis", axis))
    return True


def constants_from_quantized_constants(g, inits) -> int:
    """QuantizeLinear of a constant (ONNX Runtime quantizes weights stored as Constant nodes like activations: uint8,
    asymmetric) is a constant: the codes ONNX Runtime computes, saturate(round_half_even(w / scale) + zero_point).
    Its DequantizeLinear then follows the rules for weights. Returns the count."""
    count = 0
    for q in [n for n in g.node if n.op_type == "QuantizeLinear" and n.input[0] in inits]:
        zp = zero_point(q, inits)
        attrs = {a.name: a.i for a in q.attribute}
        if q.input[1] not in inits or zp is None or zp.dtype not in (np.uint8, np.int8) or set(attrs) - {"axis"}:
            continue
        w = numpy_helper.to_array(inits[q.input[0]]).astype(np.float32)
        scale = numpy_helper.to_array(inits[q.input[1]]).astype(np.float32)
        z = zp.astype(np.float32)
        if scale.ndim == 1 and w.ndim > 1:
            shape = [1] * w.ndim
            shape[attrs.get("axis", 1) % w.ndim] = -1
            scale, z = scale.reshape(shape), z.reshape(shape)
        info = np.iinfo(zp.dtype)
        codes = np.clip(np.rint(w / scale) + z, info.min, info.max).astype(zp.dtype)
        add_initializer(g, inits, q.output[0], codes)
        g.node.remove(q)
        count += 1
    return count
