"""Integer arithmetic as written, the same on every x86-64 CPU.

ONNX Runtime runs quantized graphs with integer kernels it picks by instruction set: an AVX2 host without VNNI
multiplies u8 x s8 pairs with VPMADDUBSW, which saturates their sum at 16 bits; VNNI and SSE4 accumulate exactly. So
the same quantized graph scores differently on different CPUs. TensorRT accumulates int8 products exactly in int32.
``ort_session`` (tasks/onnxrt/ort.py) therefore keeps Q/DQ as float ops (its QDQ fusions off) and loads graphs with integer
ops through ``exact_integer_ops``: the same values as written, computed in float.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.graph.edit import name_allocator, replace_node, subgraphs, unique_name
from tasks.graph.load import opset_of

F = TensorProto.FLOAT
# ONNX ops whose CPU kernels are integer arithmetic; ``exact_integer_ops`` rewrites them into float ops computing the
# same as written (integer codes and zero points as float, products in fp32)
INTEGER_OPS = ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulInteger", "ConvInteger", "QLinearAdd", "QLinearMul",
               "QLinearSigmoid", "QLinearLeakyRelu", "QLinearGlobalAveragePool", "QLinearAveragePool", "QLinearConcat")
# integer ops the rewrite leaves to ONNX Runtime's own kernels (their figures may differ by CPU, and say so)
KERNEL_OPS = ("DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention", "QEmbedLayerNormalization",
              "QOrderedMatMul", "MatMulNBits", "QLinearSoftmax", "QLinearWhere", "QLinearReduceMean")
_MARKERS = tuple(op.encode() for op in INTEGER_OPS + KERNEL_OPS)


def integer_ops_in(model: onnx.ModelProto) -> dict[str, int]:
    """{op type: count} of the integer-kernel ops in the graph and its subgraphs."""
    from collections import Counter

    found: Counter = Counter()

    def walk(g):
        for n in g.node:
            if n.op_type in INTEGER_OPS or n.op_type in KERNEL_OPS:
                found[n.op_type] += 1
            for sub in subgraphs(n):
                walk(sub)
    walk(model.graph)
    return dict(found)


def exact_integer_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy computing the integer ops of the main graph exactly as written, in float: QLinear ops (ONNX Runtime's
    QOperator format) as DequantizeLinear -> float op -> QuantizeLinear with the same scales; MatMulInteger/ConvInteger
    as the float MatMul/Conv of (codes - zero point), cast back to int32 (exact while the sums stay below 2^24).
    Returns (model, {op type: count} of integer ops left to ONNX Runtime's kernels)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    _qdq_from_qlinear(m, inits)
    _qdq_from_qlinear_contrib(g)
    fresh = name_allocator(g)
    nodes = []
    for n in g.node:
        if n.op_type in ("MatMulInteger", "ConvInteger") and n.domain in ("", "ai.onnx"):
            nodes.extend(_float_integer_op(n, inits, g, fresh))
        else:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return m, integer_ops_in(m)


def _float_integer_op(n, inits, g, fresh) -> list:
    """MatMulInteger(a, b, a_zp, b_zp) / ConvInteger(x, w, x_zp, w_zp) as float ops on (codes - zero point)."""
    ins = list(n.input) + [""] * 4
    conv = n.op_type == "ConvInteger"
    out = []
    floats = []
    for k, (v, zp) in enumerate(((ins[0], ins[2]), (ins[1], ins[3]))):
        f = fresh(f"{v}_exact_f32")
        out.append(helper.make_node("Cast", [v], [f], to=F, name=fresh(f + "_cast")))
        if zp:
            if zp in inits:
                z = numpy_helper.to_array(inits[zp]).astype("float32")
                if z.ndim == 1 and z.size > 1:
                    if conv and k == 1:  # per output channel: [M] -> [M, 1, 1, ...] (the weight's rank)
                        z = z.reshape(-1, *([1] * ((len(_dims(g, v)) or 4) - 1)))
                    elif k == 0:  # MatMulInteger's per-row a_zero_point: [M] -> [M, 1]
                        z = z.reshape(-1, 1)
                zname = fresh(f"{zp}_exact_f32")
                g.initializer.append(numpy_helper.from_array(z, zname))
                inits[zname] = g.initializer[-1]
            else:
                zname = fresh(f"{zp}_exact_f32")
                # a zero point computed at run time (DynamicQuantizeLinear's) is a scalar: it broadcasts
                out.append(helper.make_node("Cast", [zp], [zname], to=F, name=fresh(zname + "_cast")))
            d = fresh(f"{v}_exact_centred")
            out.append(helper.make_node("Sub", [f, zname], [d], name=fresh(d + "_sub")))
            f = d
        floats.append(f)
    y = fresh(n.output[0] + "_exact_f32")
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    out.append(helper.make_node("Conv" if conv else "MatMul", floats, [y], name=fresh((n.name or n.op_type) + "_exact"),
                                **attrs))
    out.append(helper.make_node("Cast", [y], [n.output[0]], to=TensorProto.INT32, name=fresh(y + "_int32")))
    return out


def _dims(g, name: str) -> list:
    for t in g.initializer:
        if t.name == name:
            return list(t.dims)
    for v in (*g.input, *g.value_info):
        if v.name == name and v.type.tensor_type.HasField("shape"):
            return list(v.type.tensor_type.shape.dim)
    return []


def exact_integer_ops_of(model):
    """(What ``ort_session`` loads for an accuracy figure, whether it holds Q/DQ): ``model`` itself (a path or
    serialized bytes) unless it holds an integer op, else the serialized ``exact_integer_ops`` rewrite. A cheap byte
    scan first: op type names are stored as plain strings."""
    from pathlib import Path

    data = model if isinstance(model, bytes) else Path(model).read_bytes()
    qdq = b"QuantizeLinear" in data  # DequantizeLinear too
    if not any(marker in data for marker in _MARKERS):
        return model, qdq
    m = onnx.load_from_string(data) if isinstance(model, bytes) else onnx.load(str(model))
    if not integer_ops_in(m):
        return model, qdq
    rewritten, _ = exact_integer_ops(m)
    try:
        return rewritten.SerializeToString(), True
    except ValueError:  # over protobuf's 2 GB: ONNX Runtime's own kernels, as a last resort
        return model, qdq


def _qdq_from_qlinear(model, inits) -> int:
    """QLinearConv / QLinearMatMul (ONNX Runtime's QOperator format) and its contrib QGemm -> DequantizeLinear on input
    and weight, the float op (the int32 bias scaled into a float bias), QuantizeLinear on the output (QGemm without an
    output scale: float out): the Q/DQ form TensorRT reads, same scales."""
    g = model.graph
    opset = opset_of(model)
    count = 0
    for node in [n for n in g.node if n.op_type in ("QLinearConv", "QLinearMatMul") or
                 (n.op_type == "QGemm" and n.domain == "com.microsoft")]:
        gemm = node.op_type == "QGemm"
        ins = list(node.input) + [""] * 9
        x, xs, xz, w, ws, wz = ins[:6]
        bias_in, ys, yz = (ins[6], ins[7], ins[8]) if gemm else (ins[8], ins[6], ins[7])
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        w_scale = numpy_helper.to_array(inits[ws]) if ws in inits else None
        if w_scale is None or (w_scale.size > 1 and opset < 13) or attrs.get("transA"):  # per-axis DQ needs opset 13
            continue
        conv = node.op_type == "QLinearConv"
        p = node.name or node.output[0]
        axis = {"axis": 0 if conv or (gemm and attrs.get("transB")) else 1} if w_scale.size > 1 else {}
        nodes = [onnx.helper.make_node("DequantizeLinear", [x, xs] + ([xz] if xz else []), [f"{p}_x_dq"], name=f"{p}_x_dq"),
                 onnx.helper.make_node("DequantizeLinear", [w, ws] + ([wz] if wz else []), [f"{p}_w_dq"], name=f"{p}_w_dq", **axis)]
        floats = [f"{p}_x_dq", f"{p}_w_dq"]
        if (conv or gemm) and bias_in:
            if bias_in not in inits or xs not in inits:
                continue
            bias = numpy_helper.to_array(inits[bias_in]).astype(np.float32) * \
                (numpy_helper.to_array(inits[xs]).astype(np.float32) * w_scale.astype(np.float32)).reshape(-1)
            name = unique_name(f"{p}_bias_float", inits)
            inits[name] = numpy_helper.from_array(bias.astype(np.float32), name)
            g.initializer.append(inits[name])
            floats.append(name)
        op = "Conv" if conv else "Gemm" if gemm else "MatMul"
        out = f"{p}_float" if ys else node.output[0]
        nodes.append(onnx.helper.make_node(op, floats, [out], name=f"{p}_float", **attrs))
        if ys:
            nodes.append(onnx.helper.make_node("QuantizeLinear", [out, ys] + ([yz] if yz else []), [node.output[0]],
                                               name=f"{p}_q"))
        replace_node(g, node, nodes)
        count += 1
    return count


# ONNX Runtime's QOperator contrib ops (com.microsoft) on activations: op -> (float op, the (x, scale, zero point)
# input triples, the output's (scale, zero point) inputs, the attributes the float op takes). Each becomes
# DequantizeLinear per input -> the float op -> QuantizeLinear with the same scales: the arithmetic ONNX Runtime does
# in float, and pairs TensorRT can fuse (the rules above then apply to them).
QLINEAR_CONTRIB = {
    "QLinearAdd": ("Add", [(0, 1, 2), (3, 4, 5)], (6, 7), ()),
    "QLinearMul": ("Mul", [(0, 1, 2), (3, 4, 5)], (6, 7), ()),
    "QLinearSigmoid": ("Sigmoid", [(0, 1, 2)], (3, 4), ()),
    "QLinearLeakyRelu": ("LeakyRelu", [(0, 1, 2)], (3, 4), ("alpha",)),
    "QLinearGlobalAveragePool": ("GlobalAveragePool", [(0, 1, 2)], (3, 4), ()),
    "QLinearAveragePool": ("AveragePool", [(0, 1, 2)], (3, 4),
                           ("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides")),
}


def _qdq_from_qlinear_contrib(g) -> int:
    """ONNX Runtime's QLinearAdd/Mul/Sigmoid/LeakyRelu/(Global)AveragePool/Concat -> DQ -> float op -> Q (NCHW only:
    a channels_last variant stays as it is and runs natively). Returns how many were rewritten."""
    count = 0
    for node in [n for n in g.node if n.domain == "com.microsoft" and (n.op_type in QLINEAR_CONTRIB or n.op_type == "QLinearConcat")]:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("channels_last"):
            continue
        ins = list(node.input)
        if node.op_type == "QLinearConcat":  # Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) per input
            op, triples, out, keep = "Concat", [(i, i + 1, i + 2) for i in range(2, len(ins), 3)], (0, 1), ("axis",)
        else:
            op, triples, out, keep = QLINEAR_CONTRIB[node.op_type]
        if any(len(ins) <= t[1] for t in triples):
            continue
        p = node.name or node.output[0]
        at = ins + [""] * (max(max(t) for t in triples + [out]) + 1 - len(ins))
        nodes, floats = [], []
        for k, (x, sc, zp) in enumerate(triples):
            name = f"{p}_in{k}_dq"
            nodes.append(onnx.helper.make_node("DequantizeLinear", [at[x], at[sc]] + ([at[zp]] if at[zp] else []),
                                               [name], name=name))
            floats.append(name)
        nodes.append(onnx.helper.make_node(op, floats, [f"{p}_float"], name=f"{p}_float",
                                           **{k: v for k, v in attrs.items() if k in keep}))
        nodes.append(onnx.helper.make_node("QuantizeLinear", [f"{p}_float", at[out[0]]] + ([at[out[1]]] if at[out[1]] else []),
                                           [node.output[0]], name=f"{p}_q"))
        replace_node(g, node, nodes)
        count += 1
    return count
