"""Integer arithmetic as written, the same on every x86-64 CPU.

ONNX Runtime runs quantized graphs with integer kernels it picks by instruction set: an AVX2 host without VNNI
multiplies u8 x s8 pairs with VPMADDUBSW, which saturates their sum at 16 bits; VNNI and SSE4 accumulate exactly. So
the same quantized graph scores differently on different CPUs. TensorRT accumulates int8 products exactly in int32.
``ort_session`` (tasks/ort.py) therefore keeps Q/DQ as float ops (its QDQ fusions off) and loads graphs with integer
ops through ``exact_integer_ops``: the same values as written, computed in float.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph import name_allocator, subgraphs

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
    from .prequant import _qdq_from_qlinear, _qdq_from_qlinear_contrib

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
