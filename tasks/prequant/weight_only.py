"""Weight-only quantization written as arithmetic: an 8-bit (or 4-bit) integer constant -> Cast to float -> Mul(scale)
[with a zero point as Sub before the Mul, or a Sub of scale * zero point after it], how torch exporters write a weight
stored quantized. TensorRT refuses such a graph ("Quantized constant (...) is only allowed before DQ"): an int8
constant may only feed a DequantizeLinear. The pattern computes exactly what DequantizeLinear computes, so:

- where it is a layer's weight (Conv input 1, MatMul/Gemm input 1; or an embedding table whose rows a Gather reads,
  scaled per row or per tensor) with one scale per tensor or per output channel and
  a zero point TensorRT can take (int8 zero point 0; uint8 with zero point 128 and 4-bit values shift exactly to
  int8), it becomes int8 constant -> DequantizeLinear (TensorRT's weight-only quantization: the layer computes in
  float from the model's own int8 weights; verified to build for MatMul and Conv);
- anywhere else (another reader, another zero point, a scale per input channel or per block) the weight is folded to
  the float values the graph computes (fp16 at fp16, like any other float weight).

A Transpose with a constant permutation right after the pattern (a Linear's weight) is folded into the codes.
At int8 (tasks.prequant.weight_only.float_weights / keep_weight_scales), calibration sees the float weights and the quantized graph gets
the model's own int8 codes and scales back where a layer's weight was quantized per output channel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from tasks.graph.edit import links, prune_unused, unique_name
from tasks.graph.load import opset_of
from tasks.prequant.detect import DYNAMIC_OPS

INT_TYPES = {TensorProto.INT8: (-128, 127), TensorProto.UINT8: (0, 255), TensorProto.INT4: (-8, 7),
             TensorProto.UINT4: (0, 15)}
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
LAYERS = ("Conv", "MatMul", "Gemm")


def _const(name: str, inits: dict) -> np.ndarray | None:
    return numpy_helper.to_array(inits[name]) if name in inits else None


def _other(node: onnx.NodeProto, name: str) -> str | None:
    """The operand of a binary node that is not ``name`` (None when both are)."""
    if len(node.input) != 2 or list(node.input).count(name) != 1:
        return None
    return node.input[1] if node.input[0] == name else node.input[0]


def _sole_reader(value: str, readers: dict, outputs: set[str]) -> onnx.NodeProto | None:
    r = readers.get(value, [])
    return r[0] if len(r) == 1 and value not in outputs else None


def _channel_axis(a: np.ndarray, shape: tuple) -> tuple[str, int | None]:
    """How a scale (or zero point) broadcasts over a weight of ``shape``: ("tensor", None), ("channel", axis) or
    ("other", None)."""
    if a.size == 1:
        return "tensor", None
    if a.ndim > len(shape):
        return "other", None
    full = (1,) * (len(shape) - a.ndim) + tuple(a.shape)
    varying = [i for i, d in enumerate(full) if d != 1]
    if len(varying) == 1 and full[varying[0]] == shape[varying[0]]:
        return "channel", varying[0]
    return "other", None


def _output_axis(node: onnx.NodeProto, ndim: int) -> int | None:
    """A layer weight's output-channel axis (TensorRT's per-channel axis for weights)."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "MatMul" and ndim == 2:
        return 1
    if node.op_type == "Gemm":
        return 0 if any(a.name == "transB" and a.i for a in node.attribute) else 1
    return None


@dataclass
class _CastChain:
    """An integer constant -> Cast -> [Sub(z)] -> Mul(s) [-> Sub(z s)] [-> Transpose] of a graph."""
    src: str  # the integer constant
    q: np.ndarray  # its values
    to: int  # the float type the Cast makes
    nodes: list  # the chain's nodes, the Cast first
    out: str  # the tensor the chain computes: the float weight its readers read
    scale: np.ndarray
    zp: np.ndarray | None = None
    shift: np.ndarray | None = None
    perm: list[int] | None = None


def dequantize_cast_weights(model: onnx.ModelProto) -> dict:
    """Rewrite every integer constant -> Cast -> [Sub(z)] -> Mul(s) [-> Sub(z s)] [-> Transpose] of ``model`` in place
    (module doc). Returns {"weight_only": {weight: {"as", "dtype", "axis"?, "reason"?}}, "dequantize_linear": n,
    "folded": n}; empty counts when the model has none."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    _, readers = links(g)
    outputs = {o.name for o in g.output}
    taken = set(inits) | {o for n in g.node for o in n.output} | {i.name for i in g.input}
    per_channel_ok = opset_of(model) >= 13
    found: dict[str, dict] = {}
    for cast in [n for n in g.node if n.op_type == "Cast"]:
        chain = _cast_chain(cast, inits, readers, outputs)
        if chain is None:
            continue
        cur = chain.out
        dtype = onnx.helper.tensor_dtype_to_np_dtype(chain.to)
        w = _float_weight(chain, dtype)
        codes, reason, how, axis = _int8_codes(chain)
        consumers = readers.get(cur, [])
        codes, reason, new_axis = _fit_layers(chain, codes, reason, how, axis, consumers, outputs, w.ndim, per_channel_ok)
        weight = cur
        stored = TensorProto.DataType.Name(inits[chain.src].data_type).lower()
        if codes is None:
            name = unique_name(f"{cur}_float", taken)
            taken.add(name)
            g.initializer.append(numpy_helper.from_array(w.astype(dtype), name))
            found[weight] = {"as": "float", "dtype": stored, "reason": reason}
        else:
            name = _insert_dequantize_linear(g, chain, codes, how, dtype, new_axis, taken)
            found[weight] = {"as": "dequantize_linear", "dtype": stored,
                             **({"axis": new_axis} if new_axis is not None else {})}
        for c in consumers:
            for k, x in enumerate(c.input):
                if x == cur:
                    c.input[k] = name
    if found:
        prune_unused(g)
        del g.value_info[:]  # the weights' producers changed: inferred again by whoever needs them
    return {"weight_only": found, "dequantize_linear": sum(v["as"] == "dequantize_linear" for v in found.values()),
            "folded": sum(v["as"] == "float" for v in found.values())}


def _cast_chain(cast: onnx.NodeProto, inits: dict, readers: dict, outputs: set[str]) -> _CastChain | None:
    """The chain from an integer constant through ``cast`` to the float weight, or None when ``cast`` reads no integer
    constant or no scale follows it (an integer constant used as float, not a quantized weight)."""
    src = cast.input[0]
    to = next((a.i for a in cast.attribute if a.name == "to"), None)
    if src not in inits or inits[src].data_type not in INT_TYPES or to not in FLOAT_TYPES:
        return None
    q = numpy_helper.to_array(inits[src])
    chain, cur = [cast], cast.output[0]
    zp = shift = scale = None
    r = _sole_reader(cur, readers, outputs)
    if r is not None and r.op_type == "Sub" and r.input[0] == cur and _const(r.input[1], inits) is not None:
        zp, chain, cur = _const(r.input[1], inits), chain + [r], r.output[0]
        r = _sole_reader(cur, readers, outputs)
    if r is None or r.op_type != "Mul" or _other(r, cur) is None or _const(_other(r, cur), inits) is None:
        return None  # no scale: an integer constant used as float, not a quantized weight
    scale, chain, cur = _const(_other(r, cur), inits), chain + [r], r.output[0]
    r = _sole_reader(cur, readers, outputs)
    if zp is None and r is not None and r.op_type == "Sub" and r.input[0] == cur \
            and _const(r.input[1], inits) is not None:
        shift, chain, cur = _const(r.input[1], inits), chain + [r], r.output[0]
        r = _sole_reader(cur, readers, outputs)
    perm = None
    if r is not None and r.op_type == "Transpose":
        perm = next((list(a.ints) for a in r.attribute if a.name == "perm"), list(range(q.ndim))[::-1])
        chain, cur = chain + [r], r.output[0]
    return _CastChain(src, q, to, chain, cur, scale, zp, shift, perm)


def _float_weight(chain: _CastChain, dtype) -> np.ndarray:
    """The float weight exactly as the graph computes it (each op in the output type)."""
    w = chain.q.astype(dtype)
    if chain.zp is not None:
        w = w - chain.zp.astype(dtype)
    w = w * chain.scale.astype(dtype)
    if chain.shift is not None:
        w = w - chain.shift.astype(dtype)
    if chain.perm is not None:
        w = np.transpose(w, chain.perm)
    return w


def _int8_codes(chain: _CastChain) -> tuple[np.ndarray | None, str | None, str, int | None]:
    """The same weight as int8 codes (the zero point folded into them exactly) with how its scale broadcasts:
    (codes or None, why not, "tensor"/"channel"/"other", axis)."""
    q, zp, scale, shift = chain.q, chain.zp, chain.scale, chain.shift
    how, axis = _channel_axis(scale, q.shape)
    z = np.zeros(1) if zp is None else zp.astype(np.float64)
    if shift is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            z = shift.astype(np.float64) / scale.astype(np.float64)
    zhow, zaxis = _channel_axis(np.asarray(z), q.shape)
    reason = None
    codes = None
    if how == "other" or (zhow == "channel" and (how, axis) != (zhow, zaxis)) or zhow == "other":
        reason = "its scale is neither per tensor nor per channel"
    elif not np.all(np.isfinite(z)) or np.any(np.abs(z - np.round(z)) > 1e-3):
        reason = "its zero point is not an integer"
    else:  # (q - z) * s = (q - z as one integer) * s: exact whenever q - z fits int8, whatever z was
        zint = np.round(z).astype(np.int32)
        if np.ndim(zint):
            zint = zint.reshape((1,) * (q.ndim - zint.ndim) + zint.shape)
        codes = q.astype(np.int32) - zint
        if codes.min() < -128 or codes.max() > 127:
            reason, codes = "its values less the zero point do not fit int8", None
    return codes, reason, how, axis


def _fit_layers(chain: _CastChain, codes, reason, how: str, axis, consumers: list, outputs: set[str], ndim: int,
                per_channel_ok: bool) -> tuple[np.ndarray | None, str | None, int | None]:
    """Whether the int8 codes can stand as the weight TensorRT's layers read: only Conv/MatMul/Gemm weights or embedding
    tables, scaled per output channel (or per row of a table). Returns (codes or None, why not, the axis of a
    per-channel scale in the layer's weight)."""
    cur, perm = chain.out, chain.perm
    layer_axes = {(_output_axis(c, ndim) if c.input[1:2] == [cur] and c.op_type in LAYERS else
                   0 if _gathers_rows(c, cur) else "no") for c in consumers}
    if codes is not None and (not consumers or cur in outputs or "no" in layer_axes or None in layer_axes):
        reason, codes = "it is not only a Conv/MatMul/Gemm weight or an embedding table", None
    new_axis = None
    if codes is not None and how == "channel":
        new_axis = perm.index(axis) if perm is not None else axis
        if layer_axes != {new_axis}:
            reason, codes = "its scale is per input channel, not per output channel (or per row of a table)", None
        elif not per_channel_ok:
            reason, codes = "per-channel DequantizeLinear needs opset 13", None
    return codes, reason, new_axis


def _insert_dequantize_linear(g: onnx.GraphProto, chain: _CastChain, codes: np.ndarray, how: str, dtype,
                              new_axis: int | None, taken: set[str]) -> str:
    """int8 codes, scale and zero point 0 as initializers and a DequantizeLinear of them after the chain. Returns the
    DequantizeLinear's output."""
    cur, perm, scale = chain.out, chain.perm, chain.scale
    c = codes.astype(np.int8)
    if perm is not None:
        c = np.transpose(c, perm)
    s = scale.astype(dtype).ravel() if how == "channel" else scale.astype(dtype).reshape(())
    names = [unique_name(f"{cur}_{k}", taken) for k in ("int8", "scale", "zero_point")]
    taken.update(names)
    g.initializer.extend([numpy_helper.from_array(c, names[0]), numpy_helper.from_array(s, names[1]),
                          numpy_helper.from_array(np.zeros(s.shape, np.int8), names[2])])
    attrs = {"axis": new_axis} if new_axis is not None else {}
    dq = onnx.helper.make_node("DequantizeLinear", names, [unique_name(f"{cur}_dq", taken)],
                               name=unique_name(f"{cur}_dequantize", taken), **attrs)
    taken.update([dq.output[0], dq.name])
    g.node.insert(list(g.node).index(chain.nodes[-1]) + 1, dq)
    return dq.output[0]


def _gathers_rows(node: onnx.NodeProto, table: str) -> bool:
    """Whether ``node`` gathers rows (axis 0) of ``table`` (an embedding lookup)."""
    return node.op_type == "Gather" and node.input[0] == table and \
        next((a.i for a in node.attribute if a.name == "axis"), 0) == 0


def weight_only_dqs(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """DequantizeLinear nodes of constants that feed only layer weights (or embedding tables' row lookups), in a graph
    without QuantizeLinear (a weight-only quantized model: its layers compute float)."""
    if any(n.op_type == "QuantizeLinear" for n in g.node):
        return []
    inits = {t.name for t in g.initializer}
    _, readers = links(g)
    return [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits and readers.get(n.output[0])
            and all((r.op_type in LAYERS and r.input[1:2] == [n.output[0]]) or _gathers_rows(r, n.output[0])
                    for r in readers[n.output[0]])]


def float_weights(model: onnx.ModelProto) -> dict[str, dict]:
    """Fold a weight-only quantized graph's DequantizeLinear nodes into float weights in place (for calibration, which
    quantizes float weights itself). Returns {float weight name: {"codes", "scale", "axis"}}: what keep_weight_scales
    puts back."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    kept: dict[str, dict] = {}
    for dq in weight_only_dqs(g):
        codes = numpy_helper.to_array(inits[dq.input[0]])
        scale = numpy_helper.to_array(inits[dq.input[1]])
        if codes.dtype != np.int8:
            continue
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1) if scale.ndim == 1 else None
        s = scale.reshape([-1 if i == axis else 1 for i in range(codes.ndim)]) if axis is not None else scale
        name = dq.output[0]
        g.initializer.append(numpy_helper.from_array((codes.astype(scale.dtype) * s).astype(scale.dtype), name))
        kept[name] = {"codes": codes, "scale": scale, "axis": axis}
        g.node.remove(dq)
    if kept:
        prune_unused(g)
    return kept


def keep_weight_scales(model: onnx.ModelProto, kept: dict[str, dict]) -> int:
    """Put the model's own int8 weight codes and scales back into a quantized graph (ONNX Runtime's quantizer names a
    weight ``W``'s codes ``W_quantized`` and its scale ``W_scale``), where it quantized that weight along the same axis
    (per output channel, as shipped). Returns how many weights it restored."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    n = 0
    for dq in [x for x in g.node if x.op_type == "DequantizeLinear" and x.input[0] in inits]:
        base = dq.input[0][: -len("_quantized")] if dq.input[0].endswith("_quantized") else None
        if base not in kept or dq.input[1] not in inits:
            continue
        k = kept[base]
        have = numpy_helper.to_array(inits[dq.input[0]])
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1) if inits[dq.input[1]].dims else None
        if have.shape != k["codes"].shape or have.dtype != np.int8 or axis != k["axis"]:
            continue
        scale_dtype = onnx.helper.tensor_dtype_to_np_dtype(inits[dq.input[1]].data_type)
        inits[dq.input[0]].CopyFrom(numpy_helper.from_array(k["codes"], dq.input[0]))
        inits[dq.input[1]].CopyFrom(numpy_helper.from_array(k["scale"].astype(scale_dtype).reshape(
            numpy_helper.to_array(inits[dq.input[1]]).shape), dq.input[1]))
        n += 1
    return n + _requantize_float_weights(model, kept)


def _requantize_float_weights(model: onnx.ModelProto, kept: dict[str, dict]) -> int:
    """Weights calibration left in float (a layer the accuracy search kept in higher precision, an embedding table)
    get the model's own int8 codes back behind a DequantizeLinear (weight-only again: the layer computes float, fp16
    where the graph is fp16, from int8 weights). Returns how many."""
    g = model.graph
    _, readers = links(g)
    fp16_scales_ok = opset_of(model) >= 19
    taken = {t.name for t in g.initializer} | {o for n in g.node for o in n.output} | {n.name for n in g.node}
    n = 0
    for t in list(g.initializer):
        base = t.name[: -len("_fp16")] if t.name.endswith("_fp16") and t.name[: -len("_fp16")] in kept else t.name
        if base not in kept or t.data_type not in FLOAT_TYPES or not readers.get(t.name):
            continue
        if t.data_type == TensorProto.FLOAT16 and not fp16_scales_ok:
            continue
        if not all((r.op_type in LAYERS and r.input[1:2] == [t.name]) or _gathers_rows(r, t.name)
                   for r in readers[t.name]):
            continue
        k = kept[base]
        if k["codes"].shape != tuple(t.dims):
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        names = [unique_name(f"{t.name}_{x}", taken) for x in ("int8", "scale", "zero_point", "dq")]
        taken.update(names)
        g.initializer.extend([numpy_helper.from_array(k["codes"], names[0]),
                              numpy_helper.from_array(k["scale"].astype(dtype), names[1]),
                              numpy_helper.from_array(np.zeros(k["scale"].shape, np.int8), names[2])])
        attrs = {"axis": k["axis"]} if k["axis"] is not None else {}
        g.node.insert(0, onnx.helper.make_node("DequantizeLinear", names[:3], [names[3]], name=names[3], **attrs))
        for r in readers[t.name]:
            for i, x in enumerate(r.input):
                if x == t.name:
                    r.input[i] = names[3]
        n += 1
    if n:
        prune_unused(g)
    return n


def has_cast_weights(model: onnx.ModelProto) -> bool:
    """Whether any integer constant is Cast to float (cheap: before copying the model for the rewrite)."""
    ints = {t.name for t in model.graph.initializer if t.data_type in INT_TYPES}
    return any(n.op_type == "Cast" and n.input and n.input[0] in ints and
               next((a.i for a in n.attribute if a.name == "to"), None) in FLOAT_TYPES for n in model.graph.node)


def weight_only_note(stats: dict) -> str:
    """What the rewrite did, in words (export's notes)."""
    found = stats["weight_only"]
    if not found:
        return "integer constants cast to float, none of them a quantized weight (no scale): left as they are"
    dtypes = sorted({v["dtype"] for v in found.values()})
    text = (f"{len(found)} weight-only quantized weights ({', '.join(dtypes)} constant -> Cast -> Mul(scale)): "
            f"{stats['dequantize_linear']} as int8 -> DequantizeLinear (TensorRT's weight-only quantization: the layer "
            f"computes float from the model's own int8 weights)")
    if stats["folded"]:
        why = sorted({v["reason"] for v in found.values() if v["as"] == "float"})
        text += f", {stats['folded']} folded to float weights ({'; '.join(why)})"
    return text


def weight_only_model(model: onnx.ModelProto) -> bool:
    """Whether a model's only quantization is of layer weights (DequantizeLinear of constants, no activation
    quantized): its layers compute float, and int8 calibrates it like a float model."""
    g = model.graph
    dqs = [n for n in g.node if n.op_type == "DequantizeLinear"]
    activations = any(n.op_type == "QuantizeLinear" or n.op_type.startswith("QLinear") or n.op_type == "QGemm"
                      or n.op_type in DYNAMIC_OPS for n in g.node)
    return bool(dqs) and not activations and len(weight_only_dqs(g)) == len(dqs)
