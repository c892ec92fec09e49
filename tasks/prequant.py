"""Models that arrive already quantized (PaddleSlim, ModelOpt, ONNX Runtime, quantization-aware training).

They are built as they are, with their own scales, never recalibrated. What TensorRT cannot take is converted:
- DequantizeLinear of a constant TensorRT cannot read (int32 bias, uint8/int8 with another zero point, 16-bit) is
  folded into a float constant (exact: it is what ONNX Runtime computes);
- a uint8 Q/DQ pair with zero point 128 becomes int8 with zero point 0: the same values, exactly;
- any other activation pair (uint8 asymmetric, int8 with a zero point) runs in higher precision: the pair becomes a
  float Clip to the range it could hold (quantizers fold a Relu into a uint8 pair with zero point 0); int8 weights of
  the layers it feeds stay int8 (weight-only, exactly the model's weights);
- QLinearConv / QLinearMatMul (QOperator format) are rewritten as DequantizeLinear -> Conv/MatMul -> QuantizeLinear
  with the same scales, then treated as above;
- dynamic quantization (DynamicQuantizeLinear, ConvInteger, MatMulInteger) runs natively in ONNX Runtime (the
  partition stage places it), or with model.dequantize_dynamic=true is dequantized: MatMulInteger/ConvInteger
  become float MatMul/Conv on the dequantized weights.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import numpy_helper

QDQ = ("QuantizeLinear", "DequantizeLinear")
DYNAMIC_OPS = ("DynamicQuantizeLinear", "ConvInteger", "MatMulInteger")
LAYERS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def quantization_of(model: onnx.ModelProto) -> dict:
    """What quantization a model carries: {"qdq": DequantizeLinear count, "dynamic": dynamic quantization ops,
    "qlinear": QLinearConv/QLinearMatMul (ONNX Runtime's QOperator format)}."""
    ops = Counter(n.op_type for n in model.graph.node)
    return {"qdq": ops["DequantizeLinear"], "dynamic": sum(ops[o] for o in DYNAMIC_OPS),
            "qlinear": ops["QLinearConv"] + ops["QLinearMatMul"]}


def describe(q: dict) -> str:
    parts = []
    if q.get("qdq"):
        parts.append(f"{q['qdq']} Q/DQ pairs")
    if q.get("dynamic"):
        parts.append(f"{q['dynamic']} dynamic quantization ops")
    if q.get("qlinear"):
        parts.append(f"{q['qlinear']} QLinearConv/QLinearMatMul")
    return ", ".join(parts)


def trt_from_prequantized(model: onnx.ModelProto, dequantize_dynamic: bool = False) -> tuple[onnx.ModelProto, dict]:
    """Convert a pre-quantized graph into one TensorRT takes, keeping the model's scales. Returns (model, stats)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    stats = {"folded_constants": 0, "int8_from_uint8": 0, "kept_pairs": 0, "high_precision_pairs": 0,
             "dequantized_dynamic": 0}
    stats["qlinear_rewritten"] = _qdq_from_qlinear(model, inits)
    producers = {o: n for n in g.node for o in n.output}

    # activation pairs: Q -> DQ on a tensor computed at run time
    dropped: set[str] = set()  # tensors whose pair was removed: they stay float
    converted: dict[int, str] = {}  # id(Q) -> its new int8 zero point (a Q may feed several DQs)
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] not in inits]:
        q = producers.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        zp = _zero_point(q, inits)
        if id(q) in converted:
            dq.input[:] = [dq.input[0], dq.input[1], converted[id(q)]]
            stats["int8_from_uint8"] += 1
        elif zp is not None and (_is_fp8(zp) or (zp.dtype == np.int8 and not zp.any())):
            stats["kept_pairs"] += 1
        elif zp is not None and zp.dtype == np.uint8 and (zp == 128).all() and _same_params(q, dq):
            name = _unique(q.input[2] + "_int8", inits)
            inits[name] = numpy_helper.from_array(np.zeros(zp.shape, np.int8), name)
            g.initializer.append(inits[name])
            q.input[2] = dq.input[2] = converted[id(q)] = name
            stats["int8_from_uint8"] += 1
        else:  # float, but clamped to the quantized range: a pair can stand for a Relu that was folded into it
            _bypass(g, dq, _clamp(g, q, dq, zp, inits))
            dropped.add(q.input[0])
            stats["high_precision_pairs"] += 1

    # constants: int8 with zero point 0 stay (TensorRT weights, also before a layer whose activation now runs in float:
    # weight-only int8, exactly the model's weights); uint8 with zero point 128 shift to int8; the rest fold to float
    float_fed = _float_fed_nodes(g, inits, dropped)
    int8_layers: set[int] = set()
    layers = {id(n): n for n in g.node if n.op_type in LAYERS}
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]:
        data = numpy_helper.to_array(inits[dq.input[0]])
        zp = _zero_point(dq, inits)
        consumers = [n for n in g.node if dq.output[0] in n.input]
        if data.dtype == np.uint8 and zp is not None and (zp == 128).all():
            name = _unique(dq.input[0] + "_int8", inits)
            inits[name] = numpy_helper.from_array((data.astype(np.int16) - 128).astype(np.int8), name)
            zname = _unique(dq.input[2] + "_int8", inits)
            inits[zname] = numpy_helper.from_array(np.zeros(zp.shape, np.int8), zname)
            g.initializer.extend([inits[name], inits[zname]])
            dq.input[0], dq.input[2] = name, zname
            stats["int8_from_uint8"] += 1
        elif not (_is_fp8(data) or (data.dtype == np.int8 and (zp is None or not zp.any()))):
            name = _unique(dq.output[0] + "_float", inits)  # int32 bias, other zero points, 16-bit: float constants
            inits[name] = numpy_helper.from_array(_dequantize(dq, inits), name)
            g.initializer.append(inits[name])
            _bypass(g, dq, name)
            stats["folded_constants"] += 1
            continue
        int8_layers.update(id(c) for c in consumers if id(c) in layers)
    # quantized layers: int8 weights and quantized activations; the rest of the layers run in higher precision
    stats["quantized_layers"] = len(int8_layers - float_fed)
    stats["fallback_layers"] = len(layers) - stats["quantized_layers"]

    if dequantize_dynamic:
        stats["dequantized_dynamic"] = _dequantize_dynamic(g, inits)
    _drop_dead(g)
    del g.value_info[:]  # types changed (uint8 -> int8, int32 -> float): infer them again
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # a help for later passes, not a requirement
        pass
    return model, stats


def _qdq_from_qlinear(model, inits) -> int:
    """QLinearConv / QLinearMatMul (ONNX Runtime's QOperator format) -> DequantizeLinear on input and weight, the float
    op (the int32 bias scaled into a float bias), QuantizeLinear on the output: the Q/DQ form TensorRT reads, same scales."""
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    count = 0
    for node in [n for n in g.node if n.op_type in ("QLinearConv", "QLinearMatMul")]:
        x, xs, xz, w, ws, wz, ys, yz = node.input[:8]
        w_scale = numpy_helper.to_array(inits[ws]) if ws in inits else None
        if w_scale is None or (w_scale.size > 1 and opset < 13):  # per-axis DequantizeLinear needs opset 13
            continue
        conv = node.op_type == "QLinearConv"
        p = node.name or node.output[0]
        axis = {"axis": 0 if conv else 1} if w_scale.size > 1 else {}
        nodes = [onnx.helper.make_node("DequantizeLinear", [x, xs, xz], [f"{p}_x_dq"], name=f"{p}_x_dq"),
                 onnx.helper.make_node("DequantizeLinear", [w, ws, wz], [f"{p}_w_dq"], name=f"{p}_w_dq", **axis)]
        ins = [f"{p}_x_dq", f"{p}_w_dq"]
        if conv and len(node.input) > 8 and node.input[8]:
            if node.input[8] not in inits or xs not in inits:
                continue
            bias = numpy_helper.to_array(inits[node.input[8]]).astype(np.float32) * \
                (numpy_helper.to_array(inits[xs]).astype(np.float32) * w_scale.astype(np.float32)).reshape(-1)
            name = _unique(f"{p}_bias_float", inits)
            inits[name] = numpy_helper.from_array(bias.astype(np.float32), name)
            g.initializer.append(inits[name])
            ins.append(name)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        nodes += [onnx.helper.make_node("Conv" if conv else "MatMul", ins, [f"{p}_float"], name=f"{p}_float", **attrs),
                  onnx.helper.make_node("QuantizeLinear", [f"{p}_float", ys, yz], [node.output[0]], name=f"{p}_q")]
        at = list(g.node).index(node)
        g.node.remove(node)
        for i, n in enumerate(nodes):
            g.node.insert(at + i, n)
        count += 1
    return count


def _zero_point(node, inits) -> np.ndarray | None:
    if len(node.input) < 3 or not node.input[2]:
        return np.zeros((), np.uint8)  # the ONNX default is uint8 0
    t = inits.get(node.input[2])
    return numpy_helper.to_array(t) if t is not None else None


def _is_fp8(a: np.ndarray) -> bool:
    return "float8" in str(a.dtype)


def _same_params(q, dq) -> bool:
    return list(q.input[1:3]) == list(dq.input[1:3])


def _dequantize(dq, inits) -> np.ndarray:
    """What DequantizeLinear computes on a constant, as ONNX Runtime does: float32(x - zero_point) * scale, per axis
    when the scale is a vector, per block with block_size."""
    x = numpy_helper.to_array(inits[dq.input[0]])
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float32)
    zp = _zero_point(dq, inits)
    zp = np.zeros(scale.shape, np.int64) if zp is None or _is_fp8(zp) else zp.astype(np.int64)
    attrs = {a.name: a.i for a in dq.attribute}
    if attrs.get("block_size"):  # blocked quantization (opset 21): scale and zero point repeat along the axis
        axis, block = attrs.get("axis", 1) % x.ndim, attrs["block_size"]
        scale, zp = (np.repeat(a, block, axis=axis).take(range(x.shape[axis]), axis=axis) for a in (scale, zp))
    elif scale.ndim == 1 and x.ndim > 1:
        axis = attrs.get("axis", 1) % x.ndim
        shape = [1] * x.ndim
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    if _is_fp8(x):
        return x.astype(np.float32) * scale
    return (x.astype(np.int64) - zp).astype(np.float32) * scale


def _float_fed_nodes(g, inits, dropped: set[str]) -> set[int]:
    """Nodes with a run-time input that is not quantized (it comes from no DQ, or from a removed pair)."""
    dq_out = {n.output[0] for n in g.node if n.op_type == "DequantizeLinear"}
    out = set()
    for n in g.node:
        if n.op_type in QDQ:
            continue
        runtime = [i for i in n.input if i and i not in inits]
        if any(i in dropped or (i not in dq_out) for i in runtime) and any(i in dq_out for i in n.input):
            out.add(id(n))
    return out


def _clamp(g, q, dq, zp, inits) -> str:
    """Clip(x) to what the pair could represent, (qmin - zp) * scale .. (qmax - zp) * scale (per-tensor scale);
    quantizers fold a Relu into a uint8 pair with zero point 0. Returns the tensor that replaces the pair."""
    scale = numpy_helper.to_array(inits[q.input[1]]) if q.input[1] in inits else None
    if scale is None or scale.size != 1 or zp is None or zp.size != 1 or zp.dtype not in (np.uint8, np.int8, np.uint16, np.int16):
        return q.input[0]
    info = np.iinfo(zp.dtype)
    lo, hi = ((np.float64(v) - np.float64(zp.item())) * np.float64(scale.item()) for v in (info.min, info.max))
    names = [_unique(f"{q.input[0]}_{k}", inits) for k in ("qmin", "qmax", "clamped")]
    for name, v in zip(names, (lo, hi)):
        inits[name] = numpy_helper.from_array(np.array(v, dtype=numpy_helper.to_array(inits[q.input[1]]).dtype), name)
        g.initializer.append(inits[name])
    at = list(g.node).index(dq)  # where the pair's value was ready: keeps the graph in topological order
    g.node.insert(at, onnx.helper.make_node("Clip", [q.input[0], names[0], names[1]], [names[2]], name=names[2]))
    return names[2]


def _bypass(g, dq, new: str) -> None:
    """Remove a DequantizeLinear: every reader of its output reads `new`; a graph output keeps its name (Identity)."""
    old = dq.output[0]
    g.node.remove(dq)
    for n in g.node:
        n.input[:] = [new if v == old else v for v in n.input]
    if any(o.name == old for o in g.output):
        g.node.append(onnx.helper.make_node("Identity", [new], [old], name=f"{old}_passthrough"))


def _drop_dead(g) -> None:
    """Remove nodes whose outputs nobody reads, and initializers nobody uses."""
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if not any(o in used for o in n.output if o)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for t in [t for t in g.initializer if t.name not in used]:
        g.initializer.remove(t)


def _unique(base: str, taken) -> str:
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


def _dequantize_dynamic(g, inits) -> int:
    """MatMulInteger/ConvInteger(DynamicQuantizeLinear(x), W_q) -> Cast -> Mul(scale_x * scale_w) becomes a float
    MatMul/Conv of x with W = (W_q - zp) * scale_w (ONNX Runtime's quantize_dynamic pattern). Returns the count."""
    producers = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    count = 0
    for node in [n for n in g.node if n.op_type in ("MatMulInteger", "ConvInteger")]:
        dql = producers.get(node.input[0])
        w = inits.get(node.input[1])
        cast = (consumers.get(node.output[0]) or [None])[0]
        if dql is None or dql.op_type != "DynamicQuantizeLinear" or w is None or cast is None or cast.op_type != "Cast":
            continue
        mul = (consumers.get(cast.output[0]) or [None])[0]
        if mul is None or mul.op_type != "Mul":
            continue
        scales = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
        smul = producers.get(scales)
        if smul is None or smul.op_type != "Mul" or dql.output[1] not in smul.input:
            continue
        w_scale = next((i for i in smul.input if i != dql.output[1]), None)
        if w_scale not in inits:
            continue
        wq = numpy_helper.to_array(w).astype(np.float64)
        wzp = numpy_helper.to_array(inits[node.input[3]]).astype(np.float64) if len(node.input) > 3 and node.input[3] in inits else 0.0
        ws = numpy_helper.to_array(inits[w_scale]).astype(np.float64)
        if node.op_type == "ConvInteger" and np.ndim(ws) == 1:
            ws = ws.reshape(-1, *([1] * (wq.ndim - 1)))
            wzp = np.reshape(wzp, (-1, *([1] * (wq.ndim - 1)))) if np.ndim(wzp) == 1 else wzp
        name = _unique(node.input[1] + "_float", inits)
        inits[name] = numpy_helper.from_array(((wq - wzp) * ws).astype(np.float32), name)
        g.initializer.append(inits[name])
        op = "MatMul" if node.op_type == "MatMulInteger" else "Conv"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        new = onnx.helper.make_node(op, [dql.input[0], name], [mul.output[0]], name=(node.name or op) + "_float", **attrs)
        g.node.insert(list(g.node).index(mul), new)
        g.node.remove(mul)
        count += 1
    return count
