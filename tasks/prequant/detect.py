"""What quantization a model arrived with (Q/DQ, dynamic, QOperator), what the graph TensorRT gets from it computes,
and the precisions a build of it can name."""
from __future__ import annotations

from collections import Counter

import onnx

from tasks.common.errors import ConfigError

DYNAMIC_OPS = ("DynamicQuantizeLinear", "ConvInteger", "MatMulInteger", "DynamicQuantizeLSTM")


def quantization_of(model: onnx.ModelProto) -> dict:
    """What quantization a model carries: {"qdq": DequantizeLinear count, "dynamic": dynamic quantization ops,
    "qlinear": QLinear* ops (ONNX Runtime's QOperator format: QLinearConv/QLinearMatMul and its contrib ops)}."""
    ops = Counter(n.op_type for n in model.graph.node)
    return {"qdq": ops["DequantizeLinear"], "dynamic": sum(ops[o] for o in DYNAMIC_OPS),
            "qlinear": sum(c for o, c in ops.items() if o.startswith("QLinear") or o == "QGemm")}


def describe(q: dict) -> str:
    parts = []
    if q.get("qdq"):
        parts.append(f"{q['qdq']} Q/DQ pairs")
    if q.get("dynamic"):
        parts.append(f"{q['dynamic']} dynamic quantization ops")
    if q.get("qlinear"):
        parts.append(f"{q['qlinear']} QLinear ops")

    def n(key: str, one: str, many: str) -> str:
        return f"{q[key]} {one if q[key] == 1 else many}"

    notes = []
    if q.get("shifted_pairs"):
        notes.append(n("shifted_pairs", "asymmetric pair", "asymmetric pairs") + " kept exactly as shifted int8"
                     + (f" ({q.get('shift_folded', 0)} of them feeding int8 layers)" if "shift_folded" in q else ""))
    if q.get("requantized_pairs"):
        notes.append(n("requantized_pairs", "asymmetric pair", "asymmetric pairs") + " requantized to symmetric int8, "
                     f"step widened up to x{q['max_step_widening']:.1f}")
    if q.get("requantized_weights"):
        notes.append(n("requantized_weights", "asymmetric weight", "asymmetric weights") + " requantized to symmetric int8")
    if q.get("high_precision_pairs"):
        notes.append(n("high_precision_pairs", "pair runs", "pairs run") + " in float")
    return ", ".join(parts) + "".join(f"; {n}" for n in notes)


FP8_TYPES = {getattr(onnx.TensorProto, t) for t in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ")}
INT8_TYPES = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}


def quantized_kind(model: onnx.ModelProto) -> str | None:
    """"fp8" or "int8" when the graph's DequantizeLinear nodes read 8-bit data (fp8 wins), else None: what its
    quantized layers compute in TensorRT."""
    g = model.graph
    types = {t.name: t.data_type for t in g.initializer}
    types.update({v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info, *g.output)})
    for n in g.node:  # a DQ after a Q reads the Q's type (its zero point's, int8/uint8 by default)
        if n.op_type == "QuantizeLinear" and n.output[0] not in types:
            zp = n.input[2] if len(n.input) > 2 and n.input[2] else None
            types[n.output[0]] = types.get(zp, onnx.TensorProto.UINT8) if zp else onnx.TensorProto.UINT8
    kinds = {types.get(n.input[0]) for n in g.node if n.op_type == "DequantizeLinear"}
    return "fp8" if kinds & FP8_TYPES else "int8" if kinds & INT8_TYPES else None


def float_engines(q: dict) -> bool:
    """Whether every TensorRT engine of a model that arrived quantized computes float: its only quantization is
    dynamic (MatMulInteger/ConvInteger run natively in ONNX Runtime), so at fp16 its TensorRT part is converted, and
    searched for the nodes to keep fp32 (tasks/fp16/search.py), as any float model's is."""
    return q.get("computes") is None


def precision_for(q: dict, precision: str) -> str:
    """The graph a model that arrived quantized is built from at ``precision``, so that the engine computes what its
    name says: "as_is" (its own Q/DQ, its float part as shipped) when ``precision`` is what it is quantized to, "fp16"
    (its float part in fp16, as ModelOpt writes them) at fp16, "fp32" for a model whose only quantization is dynamic
    (run natively: its TensorRT part is float). Anything else would name a precision the engine does not compute:
    ConfigError with the fix."""
    kind, dynamic = q.get("computes"), q.get("dynamic_left", 0)
    what = describe({k: q.get(k) for k in ("qdq", "dynamic", "qlinear")})
    if kind is None:  # dynamic quantization only: TensorRT gets a float graph
        if precision in ("fp32", "fp16"):
            return precision
        left = q.get("dynamic_left_why")  # present when model.dequantize_dynamic=true is set and left some native
        if left is None:
            raise ConfigError(
                f"precision={precision}: the model's quantization is dynamic ({dynamic} ops, run natively in ONNX "
                f"Runtime), so its TensorRT engines compute float, not {precision}",
                fix="build it at precision=fp16 or precision=fp32, or set model.dequantize_dynamic=true to dequantize "
                    f"it and calibrate it to {precision} for TensorRT")
        said = "; ".join(f"{n} because {r}" for r, n in Counter(left.values()).most_common(3))
        said = f" ({said})" if said else ""
        raise ConfigError(
            f"precision={precision}: model.dequantize_dynamic=true left {dynamic} dynamic quantization ops native in "
            f"ONNX Runtime, not being ONNX Runtime's quantize_dynamic pattern it dequantizes{said}, so its TensorRT "
            f"engines compute float, not {precision}",
            fix="build it at precision=fp16 or precision=fp32 (the export stage's prequant.json lists the ops under "
                "dynamic_left_why), or give model.source the float model it was quantized from")
    if precision == "fp16":
        return "fp16"
    if precision == kind:
        return "as_is"
    raise ConfigError(
        f"precision={precision}: the model arrives quantized to {kind} ({what}); its quantized layers compute {kind} "
        f"whatever the precision, so an engine named {precision} would not compute {precision}",
        fix=f"build it at precision={kind} (as shipped, its float part as it is) or precision=fp16 (its float part in "
            "fp16)")
