"""Activation pairs (a QuantizeLinear of a tensor computed at run time and its DequantizeLinear) rewritten for TensorRT:
kept, moved from uint8 to int8 exactly, shifted int8 (the model's own rounding), requantized to symmetric int8, or run in
float clamped to their range; the exact shifts are then folded into the bias of the int8 layers that read them. The
rules are in the module doc of tasks/prequant/rewrite.py."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from tasks.graph.edit import unique_name
from tasks.prequant.qdq import LAYERS, add_initializer, bypass, dequantize, is_fp8, zero_point

QDQ = ("QuantizeLinear", "DequantizeLinear")


def rewrite_activation_pairs(g, inits, producers: dict, readers: dict, asymmetric: str,
                             stats: dict) -> tuple[set[str], list[tuple]]:
    """Rewrite every activation pair (Q -> DQ on a tensor computed at run time) of ``g`` (its ``producers`` and
    ``readers`` by tensor, as tasks.graph.edit.links gives them) for TensorRT, counting each kind in ``stats`` and
    recording stats["pairs"] (what became of each tensor's pair). Returns (the tensors whose pair was removed: they stay
    float, the exact shifts as (unshift node, shift constant))."""
    pairs: dict[str, dict] = {}  # tensor -> what became of its pair (kept, exact, requantized with its widening, float)

    def feeds_layer(q) -> bool:  # the pair quantizes an input of a Conv/MatMul/Gemm: TensorRT's int8 layers need it
        dqs = [d for d in readers.get(q.output[0], []) if d.op_type == "DequantizeLinear"]
        return asymmetric == "int8" and any(r.op_type in LAYERS for d in dqs for r in readers.get(d.output[0], []))

    shifts: list[tuple] = []  # (unshift node, shift constant): folded into the layer that reads them, after the weights
    dropped: set[str] = set()  # tensors whose pair was removed: they stay float
    converted: dict[int, tuple[str, str, str]] = {}  # id(Q) -> (stats key, new scale, zero point): a Q feeds several DQs
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] not in inits]:
        q = producers.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        zp = zero_point(q, inits)
        tensor = q.input[0]
        if id(q) in converted:
            key, scale, zname = converted[id(q)]
            dq.input[:] = [dq.input[0], scale, zname]
            stats[key] += 1
            if key == "shifted_pairs":
                shift = next(sh for _, sh in shifts if sh[2] is q)
                shifts.append((_unshift(g, dq, shift, inits), shift))
        elif zp is not None and (is_fp8(zp) or (zp.dtype == np.int8 and not zp.any())):
            stats["kept_pairs"] += 1
            pairs[tensor] = {"kind": "kept"}
        elif zp is not None and zp.dtype == np.uint8 and (zp == 128).all() and _same_params(q, dq):
            zname = unique_name(q.input[2] + "_int8", inits)
            add_initializer(g, inits, zname, np.zeros(zp.shape, np.int8))
            q.input[2] = dq.input[2] = zname
            converted[id(q)] = ("int8_from_uint8", q.input[1], zname)
            stats["int8_from_uint8"] += 1
            pairs[tensor] = {"kind": "exact"}
        elif asymmetric == "exact" and (shift := _shifted_int8(g, q, dq, zp, inits)) is not None:
            converted[id(q)] = ("shifted_pairs", q.input[1], q.input[2])
            shifts.append((_unshift(g, dq, shift, inits), shift))
            stats["shifted_pairs"] += 1
            pairs[tensor] = {"kind": "shifted", "shift_steps": int(round(float(shift[0])))}
        elif feeds_layer(q) and (widening := _symmetric_int8(g, q, dq, zp, inits)) is not None:
            converted[id(q)] = ("requantized_pairs", q.input[1], q.input[2])
            stats["requantized_pairs"] += 1
            pairs[tensor] = {"kind": "requantized", "widening": round(widening, 4)}
        else:  # float, but clamped to the quantized range: a pair can stand for a Relu that was folded into it
            bypass(g, dq, _clamp(g, q, dq, zp, inits))
            dropped.add(q.input[0])
            stats["high_precision_pairs"] += 1
            pairs[tensor] = {"kind": "float"}
    widenings = [p["widening"] for p in pairs.values() if "widening" in p]
    if widenings:
        stats["max_step_widening"] = max(widenings)
    stats["pairs"] = pairs
    return dropped, shifts


def _same_params(q, dq) -> bool:
    return list(q.input[1:3]) == list(dq.input[1:3])


def _clamp(g, q, dq, zp, inits) -> str:
    """Clip(x) to what the pair could represent, (qmin - zp) * scale .. (qmax - zp) * scale (per-tensor scale);
    quantizers fold a Relu into a uint8 pair with zero point 0. Returns the tensor that replaces the pair."""
    scale = numpy_helper.to_array(inits[q.input[1]]) if q.input[1] in inits else None
    if scale is None or scale.size != 1 or zp is None or zp.size != 1 or zp.dtype not in (np.uint8, np.int8, np.uint16, np.int16):
        return q.input[0]
    info = np.iinfo(zp.dtype)
    lo, hi = ((np.float64(v) - np.float64(zp.item())) * np.float64(scale.item()) for v in (info.min, info.max))
    names = [unique_name(f"{q.input[0]}_{k}", inits) for k in ("qmin", "qmax", "clamped")]
    for name, v in zip(names, (lo, hi)):
        inits[name] = numpy_helper.from_array(np.array(v, dtype=numpy_helper.to_array(inits[q.input[1]]).dtype), name)
        g.initializer.append(inits[name])
    at = list(g.node).index(dq)  # where the pair's value was ready: keeps the graph in topological order
    g.node.insert(at, onnx.helper.make_node("Clip", [q.input[0], names[0], names[1]], [names[2]], name=names[2]))
    return names[2]


def _symmetric_int8(g, q, dq, zp, inits) -> float | None:
    """An 8-bit activation pair with a per-tensor scale s and a zero point becomes int8 with zero point 0 and the scale
    amax / 127, amax = max(|(qmin - zp) * s|, |(qmax - zp) * s|): the whole range the pair could hold, which is what
    TensorRT's calibration would choose for it. A one-sided range (a Relu folded into the pair) is kept by a Relu or
    Clip before the pair. Returns the widening of the step (new scale / s), or None when the pair does not qualify."""
    scale = numpy_helper.to_array(inits[q.input[1]]) if q.input[1] in inits else None
    if (scale is None or scale.size != 1 or zp is None or zp.size != 1 or zp.dtype not in (np.uint8, np.int8)
            or not _same_params(q, dq)):
        return None
    info, z, s = np.iinfo(zp.dtype), float(zp.item()), float(scale.item())
    lo, hi = (info.min - z) * s, (info.max - z) * s
    amax = max(abs(lo), abs(hi))
    new_scale = np.array(amax / 127, dtype=scale.dtype)
    tensor = q.input[0]
    sname, zname = unique_name(f"{tensor}_scale_int8", inits), unique_name(f"{tensor}_zero_point_int8", inits)
    add_initializer(g, inits, sname, new_scale)
    add_initializer(g, inits, zname, np.zeros(zp.shape, np.int8))
    q.input[1] = dq.input[1] = sname
    q.input[2] = dq.input[2] = zname
    low, high = lo > -amax * (1 - 1e-6), hi < amax * (1 - 1e-6)  # sides the symmetric range holds and the pair not
    if low or high:  # clamp to the pair's range (-128 * new scale, the one code outside +-amax, is left as TensorRT has it)
        out = unique_name(f"{tensor}_clamped", inits)
        if lo == 0 and not high:
            node = onnx.helper.make_node("Relu", [tensor], [out], name=out)
        else:
            bounds = [unique_name(f"{tensor}_{k}", inits) for k in ("qmin", "qmax")]
            for name, v in zip(bounds, (lo, hi)):
                add_initializer(g, inits, name, np.array(v, dtype=scale.dtype))
            node = onnx.helper.make_node("Clip", [tensor, *bounds], [out], name=out)
        g.node.insert(list(g.node).index(q), node)
        q.input[0] = out
    return float(new_scale) / s


def _shifted_int8(g, q, dq, zp, inits) -> tuple | None:
    """An 8-bit activation pair with per-tensor scale s and zero point z, exactly, on int8 with zero point 0: with
    k = z - 128 (uint8) or z (int8), (clamp(round(x/s) + z, qmin, qmax) - z) * s
    = clamp(round((x + k*s) / s), -128, 127) * s - k*s, so the pair becomes Add(x, k*s) -> Q/DQ int8 (scale s) ->
    Sub(., k*s): the model's own rounding and saturation, which TensorRT can run. Returns (k, c = k*s, q) or None."""
    scale = numpy_helper.to_array(inits[q.input[1]]) if q.input[1] in inits else None
    if (scale is None or scale.size != 1 or zp is None or zp.size != 1 or zp.dtype not in (np.uint8, np.int8)
            or not _same_params(q, dq) or any(a.name == "saturate" for a in q.attribute)):
        return None
    k = int(zp.item()) - (128 if zp.dtype == np.uint8 else 0)
    c = np.array(k * float(scale.item()), dtype=scale.dtype)
    tensor = q.input[0]
    cname, zname, shifted = (unique_name(f"{tensor}_{x}", inits) for x in ("shift", "zero_point_int8", "shifted"))
    add_initializer(g, inits, cname, c)
    add_initializer(g, inits, zname, np.zeros(zp.shape, np.int8))
    g.node.insert(list(g.node).index(q), onnx.helper.make_node("Add", [tensor, cname], [shifted], name=shifted))
    q.input[0] = shifted
    q.input[2] = dq.input[2] = zname
    return np.array(k), cname, q


def _unshift(g, dq, shift: tuple, inits):
    """DQ -> Sub(DQ, k*s) under the DQ's old output name (its readers are unchanged). Returns the Sub node."""
    out = dq.output[0]
    dq.output[0] = unique_name(f"{out}_shifted", set(inits) | {o for n in g.node for o in n.output})
    sub = onnx.helper.make_node("Sub", [dq.output[0], shift[1]], [out], name=f"{out}_unshift")
    g.node.insert(list(g.node).index(dq) + 1, sub)
    return sub


def float_fed_nodes(g, inits, dropped: set[str]) -> set[int]:
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


def fold_shift(g, sub, shift: tuple, inits) -> int:
    """Move an unshift into the layers that read it where that is exact: a Conv without padding (every tap reads a
    shifted value: its bias loses c * the sum of each output channel's weights), a Gemm or a 2-D MatMul on a constant
    weight (c * the column sums). Those layers then read the int8 pair directly: int8 layers in TensorRT. The Sub
    stays for the other readers. Returns how many layers it folded into."""
    if any(o.name == sub.output[0] for o in g.output):
        return 0
    folded = sum(_fold_into(g, layer, sub, shift, inits) for layer in [n for n in g.node if sub.output[0] in n.input])
    if not any(sub.output[0] in n.input for n in g.node):
        g.node.remove(sub)
    return folded


def _fold_into(g, layer, sub, shift: tuple, inits) -> bool:
    if layer.op_type not in ("Conv", "Gemm", "MatMul") or len(layer.input) < 2 or layer.input[0] != sub.output[0] \
            or sub.output[0] in layer.input[1:]:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in layer.attribute}
    w = _constant_value(g, layer.input[1], inits)
    if w is None or not any(n.op_type == "DequantizeLinear" and n.output[0] == layer.input[1] for n in g.node):
        return False  # float weights: no int8 layer to gain (and a weight-shift box sum stays on the float input)
    c = float(numpy_helper.to_array(inits[shift[1]]))
    has_bias = len(layer.input) > 2 and bool(layer.input[2])
    b = _constant_value(g, layer.input[2], inits) if has_bias else None
    if has_bias and (b is None or layer.op_type == "MatMul"):
        return False
    if layer.op_type == "Conv":
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
            return False
        if any(attrs.get("pads", [])) and not _pad_before_pair(g, layer, shift, attrs["pads"], inits):
            return False
        corr = -c * w.reshape(w.shape[0], -1).sum(axis=1)
    elif layer.op_type == "Gemm":
        beta = float(attrs.get("beta", 1.0))
        if attrs.get("transA") or w.ndim != 2 or (has_bias and beta == 0.0):
            return False
        wk = w.T if attrs.get("transB") else w
        corr = -c * float(attrs.get("alpha", 1.0)) * wk.sum(axis=0) / (beta if has_bias else 1.0)
    else:
        if w.ndim != 2:
            return False
        corr = -c * w.sum(axis=0)
    dtype = numpy_helper.to_array(inits[shift[1]]).dtype
    if layer.op_type == "MatMul":  # out + correction, under the MatMul's output name
        name = unique_name(f"{layer.output[0]}_unshift", inits)
        add_initializer(g, inits, name, corr.astype(dtype))
        out = layer.output[0]
        layer.output[0] = unique_name(f"{out}_shifted", set(inits) | {o for n in g.node for o in n.output})
        g.node.insert(list(g.node).index(layer) + 1, onnx.helper.make_node("Add", [layer.output[0], name], [out], name=name))
    else:
        if has_bias:
            corr = b + corr
        elif layer.op_type == "Gemm":
            keep = [a for a in layer.attribute if a.name != "beta"]
            del layer.attribute[:]
            layer.attribute.extend(keep)
        name = unique_name(f"{layer.name or layer.output[0]}_bias_unshifted", inits)
        add_initializer(g, inits, name, corr.astype(dtype))
        while len(layer.input) < 3:
            layer.input.append("")
        layer.input[2] = name
    if not (layer.op_type == "Conv" and any(attrs.get("pads", []))):
        layer.input[0] = sub.input[0]
    return True


def _pad_before_pair(g, conv, shift: tuple, pads: list, inits) -> bool:
    """A padded Conv gets its own pair on the zero-padded input: Pad(x, 0) -> Add(k*s) -> Q -> DQ -> Conv without
    padding. A padded position then holds code k, i.e. k*s after DequantizeLinear, which the bias correction removes
    again: exactly the model's zero padding, with the Conv reading its pair directly (an int8 layer)."""
    k, cname, q = shift
    add = next((n for n in g.node if n.op_type == "Add" and n.output[0] == q.input[0]), None)
    if add is None or len(pads) % 2:
        return False
    x, nd = add.input[0], len(pads) // 2
    names = set(inits) | {o for n in g.node for o in n.output}
    pname, padded, shifted, qout, dqout = (unique_name(f"{conv.name or conv.output[0]}_{v}", names)
                                           for v in ("pads", "padded", "shifted", "quantized", "dequantized"))
    add_initializer(g, inits, pname, np.array([0, 0, *pads[:nd], 0, 0, *pads[nd:]], np.int64))
    at = list(g.node).index(conv)
    for node in reversed([onnx.helper.make_node("Pad", [x, pname], [padded], name=padded),
                          onnx.helper.make_node("Add", [padded, cname], [shifted], name=shifted),
                          onnx.helper.make_node("QuantizeLinear", [shifted, *q.input[1:3]], [qout], name=qout),
                          onnx.helper.make_node("DequantizeLinear", [qout, *q.input[1:3]], [dqout], name=dqout)]):
        g.node.insert(at, node)
    conv.input[0] = dqout
    keep = [a for a in conv.attribute if a.name != "pads"]
    del conv.attribute[:]
    conv.attribute.extend(keep)
    return True


def _constant_value(g, name: str, inits) -> np.ndarray | None:
    """The float value of an initializer or of a DequantizeLinear of one (float64), else None."""
    if name in inits:
        return numpy_helper.to_array(inits[name]).astype(np.float64)
    dq = next((n for n in g.node if n.op_type == "DequantizeLinear" and n.output[0] == name), None)
    if dq is not None and dq.input[0] in inits and all(i in inits for i in dq.input[1:] if i):
        return dequantize(dq, inits).astype(np.float64)
    return None
