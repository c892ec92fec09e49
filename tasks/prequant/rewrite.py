"""Models that arrive already quantized (PaddleSlim, ModelOpt, ONNX Runtime, quantization-aware training).

They are built as they are, with their own scales, never recalibrated. What TensorRT cannot take is converted:
- DequantizeLinear of a constant TensorRT cannot read (int32 bias, uint8/int8 with another zero point, 16-bit), or
  of one that is no Conv/MatMul/Gemm weight (an Add's or Mul's operand), is folded into a float constant (exact: it is
  what ONNX Runtime computes);
- a uint8 Q/DQ pair with zero point 128 becomes int8 with zero point 0: the same values, exactly;
- any other 8-bit activation pair with a per-tensor scale (uint8 asymmetric, int8 with a zero point: ONNX Runtime's
  quantize_static default), by default (asymmetric="exact"), keeps the model's own rounding: with k the zero point's
  offset from int8's, Q(x) - z = clamp(round(x / s + k)) - k, so the pair becomes Add(k s) -> int8 Q/DQ -> Sub(k s).
  Where it feeds a Conv (its zero padding moved before the pair), a Gemm or a MatMul on constant weights, the Sub
  moves into the layer's bias and the layer reads int8 (an int8 layer in TensorRT). Asymmetric per-tensor 8-bit
  weights become int8 codes plus a constant term (a box-sum Conv, a row sum). Only float rounding of x + k s at half
  steps differs from the shipped model (benchmarks/bench_prequant.py: PP-OCRv4 det 0.994-0.996 vs shipped, at its
  own ONNX Runtime spread);
- asymmetric="int8" requantizes such a pair that feeds a Conv/MatMul/Gemm to symmetric int8 covering the range the
  pair could hold, as TensorRT's own calibration would choose for that range: amax = max(|(qmin - zp) * s|,
  |(qmax - zp) * s|), scale amax / 127, zero point 0, behind a Relu/Clip to that range when it is one-sided
  (quantizers fold a Relu into a uint8 pair with zero point 0). The step widens by amax / (127 s), up to x2.0
  (recorded per tensor). Asymmetric pairs elsewhere run in float, clamped to the range they could hold. 8-bit weights
  with a zero point feeding a Conv/MatMul/Gemm become symmetric int8 per output channel, with the scale of their own
  largest value (the model is moved to opset 13 for per-channel DequantizeLinear if it is older), when no weight
  moves by more than the model's own step; else they are folded to float;
- what is left (16-bit, per-channel activation scales, scales computed at run time) runs in higher precision the same
  way; int8 weights of the layers it feeds stay int8;
- QuantizeLinear of a constant (quantize_static quantizes weights stored as Constant nodes like activations: uint8,
  asymmetric, per tensor) is computed once into a constant; int32 biases are folded to float;
- asymmetric="float": every asymmetric pair and weight runs in float;
- QLinearConv / QLinearMatMul / QGemm (QOperator format) are rewritten as DequantizeLinear -> Conv/MatMul/Gemm ->
  QuantizeLinear with the same scales, and ONNX Runtime's contrib QLinear ops (QLINEAR_CONTRIB, QLinearConcat) as
  DQ -> float op -> Q; value-selecting ops the format leaves on 8-bit data (MOVEMENT: Resize in nearest mode, MaxPool,
  Reshape, ...) run in float between a DQ and a Q of the same scale; then treated as above;
- dynamic quantization (DynamicQuantizeLinear, ConvInteger, MatMulInteger) runs natively in ONNX Runtime (the
  partition stage places it), or with model.dequantize_dynamic=true is dequantized: MatMulInteger/ConvInteger (any
  rank) become float MatMul/Conv on the dequantized weights, or on the float weight a DynamicQuantizeLinear quantized
  at run time; stats["dynamic_left_why"] says why the rest stays native.
"""
from __future__ import annotations

import onnx

from tasks.graph.edit import links, prune_unused
from tasks.graph.load import opset_of
from tasks.onnxrt.exact import _qdq_from_qlinear, _qdq_from_qlinear_contrib
from tasks.prequant.detect import DYNAMIC_OPS, quantized_kind
from tasks.prequant.dynamic import float_from_dynamic
from tasks.prequant.pairs import float_fed_nodes, fold_shift, rewrite_activation_pairs
from tasks.prequant.weight_only import weight_only_dqs
from tasks.prequant.weights import constants_from_quantized_constants, rewrite_weights


def trt_from_prequantized(model: onnx.ModelProto, dequantize_dynamic: bool = False,
                          asymmetric: str = "exact") -> tuple[onnx.ModelProto, dict]:
    """Convert a pre-quantized graph into one TensorRT takes, keeping the model's scales where TensorRT can hold them
    (asymmetric: "exact" shifted int8 pairs, "int8" requantized, "float"; see the module doc). Returns (model, stats)."""
    activations = any(n.op_type == "QuantizeLinear" or n.op_type in DYNAMIC_OPS or n.op_type.startswith("QLinear")
                      or n.op_type == "QGemm" for n in model.graph.node)  # else only weights are quantized
    model, upgraded = _per_channel_opset(model)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    stats = {"opset_upgraded": upgraded, "folded_constants": 0, "int8_from_uint8": 0, "kept_pairs": 0,
             "shifted_pairs": 0, "requantized_pairs": 0, "high_precision_pairs": 0, "requantized_weights": 0,
             "dequantized_dynamic": 0}
    stats["qlinear_rewritten"] = _qdq_from_qlinear(model, inits) + _qdq_from_qlinear_contrib(g)
    stats["dq_before_movement"] = _dq_before_movement(g)
    stats["quantized_constants"] = constants_from_quantized_constants(g, inits)
    opset = opset_of(model)
    # producers and readers also hold the graph's node objects until the end: the node ids that float_fed_nodes and
    # rewrite_weights record stay those nodes' (protobuf makes a new object, often at a freed address, for a node
    # nothing holds)
    producers, readers = links(g)
    dropped, shifts = rewrite_activation_pairs(g, inits, producers, readers, asymmetric, stats)

    # constants: int8 with zero point 0 stay (TensorRT weights, also before a layer whose activation now runs in float:
    # weight-only int8, exactly the model's weights); uint8 with zero point 128 shift to int8; 8-bit layer weights with
    # another zero point are requantized to symmetric int8 when that loses at most their own step; the rest fold to float
    float_fed = float_fed_nodes(g, inits, dropped)
    int8_layers, layers = rewrite_weights(g, inits, asymmetric, opset, stats)
    # exact shifts: a Conv (its padding made explicit before its own pair), a Gemm or a MatMul on constant weights reads
    # the shifted int8 pair directly, the shift moved into its bias (int8 layers in TensorRT); elsewhere the Sub stays
    stats["shift_folded"] = sum(fold_shift(g, sub, shift, inits) for sub, shift in shifts)
    if shifts:  # layers that now read a pair directly, and those still behind an unshift
        float_fed = float_fed_nodes(g, inits, dropped)
    # quantized layers: int8 weights and quantized activations; the rest of the layers run in higher precision
    stats["quantized_layers"] = len(int8_layers - float_fed)
    stats["fallback_layers"] = layers - stats["quantized_layers"]

    left: dict[str, str] = {}
    if dequantize_dynamic:
        stats["dequantized_dynamic"] = float_from_dynamic(g, inits, left)
    model = _shapes_inferred(model)
    _record_computes(model, activations, stats)
    if dequantize_dynamic and stats["dynamic_left"]:
        # dynamic quantization that model.dequantize_dynamic=true left native in ONNX Runtime, per node why: what the
        # refusal of an int8 build and the partition's warning say instead of recommending the flag already set
        stats["dynamic_left_why"] = left
    return model, stats


def _shapes_inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """The rewritten model without what no longer feeds an output, its value types inferred again."""
    g = model.graph
    prune_unused(g)
    del g.value_info[:]  # types changed (uint8 -> int8, int32 -> float): infer them again
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # a help for later passes, not a requirement
        pass
    return model


def _record_computes(model: onnx.ModelProto, activations: bool, stats: dict) -> None:
    """stats["computes"]: what the graph TensorRT gets computes below float (int8, fp8 or None); stats["weight_only"]
    for a model whose only quantization is of its weights (``activations`` false); stats["dynamic_left"]: the dynamic
    quantization ops left to run natively."""
    stats["computes"] = quantized_kind(model)  # what the graph TensorRT gets computes below float: int8, fp8 or None
    only_weights = weight_only_dqs(model.graph)
    if not activations and only_weights and len(only_weights) == sum(n.op_type == "DequantizeLinear" for n in model.graph.node):
        # weight-only quantization (no activation is quantized): TensorRT's layers compute float from int8 weights, so
        # the model is a float model to every precision (int8 calibrates its activations, keeping its weight scales)
        stats["computes"] = None
        stats["weight_only"] = len(only_weights)
    stats["dynamic_left"] = sum(1 for n in model.graph.node if n.op_type in DYNAMIC_OPS)  # run natively


def _per_channel_opset(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """Per-channel DequantizeLinear needs opset 13: older models carrying Q/DQ go through ONNX's version converter
    (PP-OCR ships opset 11/12); where it cannot convert, weights stay per tensor."""
    opset = opset_of(model)
    if opset >= 13 or not any(n.op_type == "QuantizeLinear" for n in model.graph.node):
        return model, False
    try:
        from onnx import version_converter

        return version_converter.convert_version(model, 13), True
    except Exception:  # noqa: BLE001 - per tensor then
        return model, False


# ops that only select or move values: on a quantized tensor they commute with DequantizeLinear exactly
# (QOperator graphs keep Resize, MaxPool, Reshape, ... on uint8 data, which TensorRT cannot take)
MOVEMENT = ("Resize", "MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Gather",
            "DepthToSpace", "SpaceToDepth", "Identity", "Expand", "Tile")


def _dq_before_movement(g) -> int:
    """Q -> M1 -> ... -> Mk -> DQ with value-selecting ops M (Resize only in nearest mode) becomes
    Q -> DQ -> M1 -> ... -> Mk -> Q -> DQ, same scale and zero point: the same values (they stay on the grid), with the
    movement in float and a pair on each side for TensorRT. Returns how many chains were rewritten."""
    producers, readers = links(g)
    count = 0
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear"]:
        chain, p = [], producers.get(dq.input[0])
        while p is not None and p.op_type in MOVEMENT and (p.op_type != "Resize" or _attr(p, "mode", b"nearest") in (b"nearest", "nearest")):
            if any(len(readers.get(o, [])) != 1 for o in p.output) or len(p.output) != 1:
                chain = []
                break
            chain.append(p)
            p = producers.get(p.input[0])
        if not chain or p is None or p.op_type != "QuantizeLinear" or list(p.input[1:3]) != list(dq.input[1:3]):
            continue
        first, params = chain[-1], list(dq.input[1:3])
        name = f"{first.name or first.output[0]}_in_dq"
        g.node.insert(list(g.node).index(first), onnx.helper.make_node(
            "DequantizeLinear", [first.input[0], *params], [name], name=name))
        first.input[0] = name
        qname = f"{dq.name or dq.output[0]}_requantized"
        g.node.insert(list(g.node).index(dq), onnx.helper.make_node(
            "QuantizeLinear", [dq.input[0], *params], [qname], name=qname))
        dq.input[0] = qname
        moved = {m.output[0] for m in chain}  # now float: drop their recorded (8-bit) types
        keep = [v for v in g.value_info if v.name not in moved]
        del g.value_info[:]
        g.value_info.extend(keep)
        count += 1
    return count


def _attr(node, name: str, default=None):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)
