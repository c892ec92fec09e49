"""int8 layers computed as TensorRT's fused int8 kernels compute them: codes multiplied, summed exactly, scaled in fp32.

A quantized layer of the written graph reads ``DequantizeLinear(codes, scale)`` on its activation and its weight.
Computed as written, ONNX Runtime multiplies the dequantized values (code x scale) and sums those products in fp32,
which rounds each sum. TensorRT fuses the two DequantizeLinear nodes into the layer: it multiplies the int8 codes,
accumulates them exactly in int32, and scales the sum once, in fp32, by the activation's scale times the weight's
(then adds the bias). ``int8_layers_from_codes`` rewrites each such layer to do the same in float: the same op on the
codes as float (integers: every product below 2^14, every partial sum exact while below 2^24 -- 1000 products at full
scale, far more in practice -- in any summation order, so on any CPU and any ONNX Runtime kernel), a ``Mul`` by the
combined scale and an ``Add`` of the bias. Layers the rewrite does not recognise (float8 codes, a per-channel
activation scale, a weight that is not an initializer) stay as written.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.graph.edit import name_allocator, prune_unused

F = TensorProto.FLOAT
INTEGER_CODES = (TensorProto.INT8, TensorProto.UINT8)
LAYERS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def int8_layers_from_codes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` whose int8 layers (``LAYERS`` reading a DequantizeLinear of int8/uint8 codes on input and
    weight) compute on the codes and scale the exact sum in fp32 (see the module doc); returns (model, layers
    rewritten). The main graph only: layers inside control-flow bodies stay as written."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    made = {o: n for n in g.node for o in n.output}
    fresh = name_allocator(g)
    nodes, count = [], 0
    for n in g.node:
        new = layer_from_codes(n, made, inits, g, fresh) if n.op_type in LAYERS and n.domain in ("", "ai.onnx") else None
        if new is None:
            nodes.append(n)
        else:
            nodes.extend(new)
            count += 1
    if count:
        del g.node[:]
        g.node.extend(nodes)
        prune_unused(g, ops=("DequantizeLinear",))
    return m, count


def _codes_of(dq, inits) -> tuple[str, np.ndarray, np.ndarray | None, int] | None:
    """(codes value, scale, zero point or None, axis) of a DequantizeLinear of int8/uint8 codes with constant scale
    and zero point; None otherwise."""
    ins = list(dq.input) + [""]
    if ins[1] not in inits or (ins[2] and ins[2] not in inits):
        return None
    zp = numpy_helper.to_array(inits[ins[2]]) if ins[2] else None
    codes_type = inits[ins[2]].data_type if ins[2] else (inits[ins[0]].data_type if ins[0] in inits else None)
    if codes_type not in INTEGER_CODES:
        return None
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    if any(a.name == "block_size" and a.i for a in dq.attribute):
        return None
    return ins[0], numpy_helper.to_array(inits[ins[1]]).astype(np.float32), zp, axis


def layer_from_codes(n, made, inits, g, fresh) -> list | None:
    """The nodes computing layer ``n`` of graph ``g`` (``made``: value -> its producer; ``inits``: name -> initializer,
    extended with what the rewrite adds; ``fresh``: a name allocator) from its codes, writing ``n``'s output; None when
    it is not an int8 layer this rewrite knows."""
    dq_x, dq_w = (made.get(x) for x in n.input[:2])
    if dq_x is None or dq_w is None or dq_x.op_type != "DequantizeLinear" or dq_w.op_type != "DequantizeLinear":
        return None
    x, w = _codes_of(dq_x, inits), _codes_of(dq_w, inits)
    if x is None or w is None or x[1].size != 1 or (x[2] is not None and x[2].size != 1) or w[0] not in inits:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    codes_w = numpy_helper.to_array(inits[w[0]]).astype(np.float32)
    out_axis = {"Conv": 0, "ConvTranspose": 1, "MatMul": codes_w.ndim - 1,
                "Gemm": 0 if attrs.get("transB") else 1}[n.op_type]
    if (n.op_type == "ConvTranspose" and attrs.get("group", 1) != 1) or (n.op_type == "MatMul" and codes_w.ndim != 2):
        return None
    s_w, zp_w = w[1], w[2]
    if s_w.size > 1 and (w[3] % codes_w.ndim) != out_axis:
        return None  # a per-channel weight scale along another axis than the output channels: not one scale per sum
    if zp_w is not None and np.any(zp_w != 0):
        shape = [1] * codes_w.ndim
        shape[out_axis] = -1
        codes_w = codes_w - zp_w.astype(np.float32).reshape(shape if zp_w.size > 1 else [])
    alpha, beta = float(attrs.pop("alpha", 1.0)), float(attrs.pop("beta", 1.0))
    scale = (x[1].reshape(()) * s_w.reshape(-1) * np.float32(alpha)).astype(np.float32)  # one fp32 scale per channel
    conv = n.op_type in ("Conv", "ConvTranspose")
    scale = scale.reshape([1, -1] + [1] * (codes_w.ndim - 2)) if conv and scale.size > 1 else scale.reshape(-1)
    base = n.name or n.output[0]
    wc, sc = fresh(f"{w[0]}_codes_f32"), fresh(f"{base}_codes_scale")
    g.initializer.extend([numpy_helper.from_array(codes_w, wc), numpy_helper.from_array(scale, sc)])
    inits[wc], inits[sc] = g.initializer[-2], g.initializer[-1]
    xc = fresh(f"{x[0]}_codes_f32")
    out = [helper.make_node("Cast", [x[0]], [xc], to=F, name=fresh(xc + "_cast"))]
    if x[2] is not None and np.any(x[2] != 0):
        zx = fresh(f"{x[0]}_codes_zero_point")
        g.initializer.append(numpy_helper.from_array(x[2].astype(np.float32).reshape(()), zx))
        centred = fresh(f"{x[0]}_codes_centred")
        out.append(helper.make_node("Sub", [xc, zx], [centred], name=fresh(centred + "_sub")))
        xc = centred
    acc, scaled = fresh(f"{n.output[0]}_codes_sum"), fresh(f"{n.output[0]}_codes_scaled")
    out.append(helper.make_node(n.op_type, [xc, wc], [acc], name=fresh(base + "_codes"), **attrs))
    # the scale first: ONNX Runtime folds a Conv followed by a Mul of a constant second input into the Conv's weights
    # (ConvMulFusion), which would make the codes non-integers again
    bias = n.input[2] if len(n.input) > 2 and n.input[2] else ""
    out.append(helper.make_node("Mul", [sc, acc], [scaled if bias else n.output[0]], name=fresh(base + "_codes_scale")))
    if bias:
        b = bias
        if conv:  # the bias [M] along the channel axis of the output
            if bias in inits:
                b = fresh(f"{bias}_codes_channels")
                arr = numpy_helper.to_array(inits[bias]).astype(np.float32)
                g.initializer.append(numpy_helper.from_array(arr.reshape([1, -1] + [1] * (codes_w.ndim - 2)), b))
            else:
                shape = fresh(f"{bias}_codes_shape")
                g.initializer.append(numpy_helper.from_array(
                    np.array([1, -1] + [1] * (codes_w.ndim - 2), dtype=np.int64), shape))
                b = fresh(f"{bias}_codes_channels")
                out.append(helper.make_node("Reshape", [bias, shape], [b], name=fresh(b + "_reshape")))
        if beta != 1.0:
            bb = fresh(f"{bias}_codes_beta")
            g.initializer.append(numpy_helper.from_array(np.array(beta, dtype=np.float32), bb + "_value"))
            out.append(helper.make_node("Mul", [bb + "_value", b], [bb], name=fresh(bb + "_mul")))
            b = bb
        out.append(helper.make_node("Add", [scaled, b], [n.output[0]], name=fresh(base + "_codes_bias")))
    return out
