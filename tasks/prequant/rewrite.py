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
  partition stage places it), or with model.dequantize_dynamic=true is dequantized: MatMulInteger/ConvInteger
  become float MatMul/Conv on the dequantized weights.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import numpy_helper

from tasks.common.errors import ConfigError
from tasks.onnxrt.exact import QLINEAR_CONTRIB, _qdq_from_qlinear, _qdq_from_qlinear_contrib  # noqa: F401 (QOperator rewrites)
from tasks.graph.edit import links, prune_unused, replace_node, unique_name
from tasks.graph.load import opset_of

QDQ = ("QuantizeLinear", "DequantizeLinear")
DYNAMIC_OPS = ("DynamicQuantizeLinear", "ConvInteger", "MatMulInteger", "DynamicQuantizeLSTM")
LAYERS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


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


def accuracy_fix(q: dict) -> str:
    """How to fix a build of a pre-quantized model below its accuracy budget."""
    if q.get("requantized_pairs") or q.get("requantized_weights"):
        return ("its asymmetric pairs were requantized to symmetric int8, a different rounding than the model as shipped: "
                "lower accuracy.min_cosine if that agreement is acceptable, or use model.asymmetric=exact (the model's "
                "own rounding, int8 layers only where it folds exactly)")
    if q.get("shifted_pairs"):
        return ("its asymmetric pairs keep the model's own rounding as shifted int8 pairs; they differ from the model as "
                "shipped only where float rounding of the shift moves a value across a half step, which a model "
                "sensitive to single-step changes amplifies: lower accuracy.min_cosine if that agreement is acceptable, "
                "or try model.asymmetric=float (those pairs in float, not int8)")
    return "use a higher precision, or lower accuracy.min_cosine if that loss is acceptable"


def dequantized_vs_shipped(dequantized, shipped, feeds: list) -> float:
    """The lowest output cosine (pooled over ``feeds``) of a dynamically quantized model's dequantized float form to the
    model as shipped, both in ONNX Runtime: how far apart the float model an engine computes and the shipped model are
    on these inputs (the shipped model quantizes its activations at run time; the float form does not)."""
    from tasks.accuracy.metrics import compare, headline, summarize
    from tasks.onnxrt.ort import ort_runner

    a, b = ort_runner(dequantized), ort_runner(shipped)
    return headline(summarize([compare(b(f), a(f)) for f in feeds]))["cosine_min"]


def dequantized_fix(apart: float, random_inputs: bool, min_cosine: float) -> str:
    """What happened when a dynamically quantized model built dequantized (model.dequantize_dynamic=true) is compared
    with the model as shipped, and the choices."""
    scale = (" These inputs are random values inside the profiles, not the model's real input scale: the shipped "
             "model's run-time activation quantization depends on the range it sees, so the distance on real data can "
             "be quite different." if random_inputs else "")
    verdict = ("no engine of it can agree more closely with the model as shipped" if apart < min_cosine else
               "the rest of the loss is the engine's precision")
    return (f"the engine computes the float model that the dynamically quantized one approximates "
            f"(model.dequantize_dynamic=true), and that float model itself is at cosine {apart:.6f} to the model as "
            f"shipped on these inputs: {verdict}.{scale} Validate on real inputs (validation.data=..., "
            f"calibration.data=...), or choose the reference knowingly: model.reference=dequantized validates against "
            f"the float form (what the engine computes; recorded in summary.json and the run), model.reference=shipped "
            f"(the default) against the model as shipped; or build it as shipped with model.dequantize_dynamic=false")


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
    shifts: list[tuple] = []  # (unshift node, shift constant): folded into the layer that reads them, after the weights
    stats["qlinear_rewritten"] = _qdq_from_qlinear(model, inits) + _qdq_from_qlinear_contrib(g)
    stats["dq_before_movement"] = _dq_before_movement(g)
    stats["quantized_constants"] = _constants_from_quantized_constants(g, inits)
    opset = opset_of(model)
    producers, readers = links(g)
    pairs: dict[str, dict] = {}  # tensor -> what became of its pair (kept, exact, requantized with its widening, float)

    def feeds_layer(q) -> bool:  # the pair quantizes an input of a Conv/MatMul/Gemm: TensorRT's int8 layers need it
        dqs = [d for d in readers.get(q.output[0], []) if d.op_type == "DequantizeLinear"]
        return asymmetric == "int8" and any(r.op_type in LAYERS for d in dqs for r in readers.get(d.output[0], []))

    # activation pairs: Q -> DQ on a tensor computed at run time
    dropped: set[str] = set()  # tensors whose pair was removed: they stay float
    converted: dict[int, tuple[str, str, str]] = {}  # id(Q) -> (stats key, new scale, zero point): a Q feeds several DQs
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] not in inits]:
        q = producers.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        zp = _zero_point(q, inits)
        tensor = q.input[0]
        if id(q) in converted:
            key, scale, zname = converted[id(q)]
            dq.input[:] = [dq.input[0], scale, zname]
            stats[key] += 1
            if key == "shifted_pairs":
                shift = next(sh for _, sh in shifts if sh[2] is q)
                shifts.append((_unshift(g, dq, shift, inits), shift))
        elif zp is not None and (_is_fp8(zp) or (zp.dtype == np.int8 and not zp.any())):
            stats["kept_pairs"] += 1
            pairs[tensor] = {"kind": "kept"}
        elif zp is not None and zp.dtype == np.uint8 and (zp == 128).all() and _same_params(q, dq):
            zname = unique_name(q.input[2] + "_int8", inits)
            _add(g, inits, zname, np.zeros(zp.shape, np.int8))
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
            _bypass(g, dq, _clamp(g, q, dq, zp, inits))
            dropped.add(q.input[0])
            stats["high_precision_pairs"] += 1
            pairs[tensor] = {"kind": "float"}
    widenings = [p["widening"] for p in pairs.values() if "widening" in p]
    if widenings:
        stats["max_step_widening"] = max(widenings)
    stats["pairs"] = pairs

    # constants: int8 with zero point 0 stay (TensorRT weights, also before a layer whose activation now runs in float:
    # weight-only int8, exactly the model's weights); uint8 with zero point 128 shift to int8; 8-bit layer weights with
    # another zero point are requantized to symmetric int8 when that loses at most their own step; the rest fold to float
    float_fed = _float_fed_nodes(g, inits, dropped)
    int8_layers: set[int] = set()
    layers = {id(n): n for n in g.node if n.op_type in LAYERS}
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]:
        data = numpy_helper.to_array(inits[dq.input[0]])
        zp = _zero_point(dq, inits)
        consumers = [n for n in g.node if dq.output[0] in n.input]
        if data.dtype == np.uint8 and zp is not None and (zp == 128).all():
            name = unique_name(dq.input[0] + "_int8", inits)
            _add(g, inits, name, (data.astype(np.int16) - 128).astype(np.int8))
            zname = unique_name(dq.input[2] + "_int8", inits)
            _add(g, inits, zname, np.zeros(zp.shape, np.int8))
            dq.input[0], dq.input[2] = name, zname
            stats["int8_from_uint8"] += 1
        elif (_is_fp8(data) or (data.dtype == np.int8 and (zp is None or not zp.any()))) and consumers \
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
            _add(g, inits, name, _dequantize(dq, inits))
            _bypass(g, dq, name)
            stats["folded_constants"] += 1
            continue
        int8_layers.update(id(c) for c in consumers if id(c) in layers)
    # exact shifts: a Conv (its padding made explicit before its own pair), a Gemm or a MatMul on constant weights reads
    # the shifted int8 pair directly, the shift moved into its bias (int8 layers in TensorRT); elsewhere the Sub stays
    stats["shift_folded"] = sum(_fold_shift(g, sub, shift, inits) for sub, shift in shifts)
    if shifts:  # layers that now read a pair directly, and those still behind an unshift
        float_fed = _float_fed_nodes(g, inits, dropped)
    # quantized layers: int8 weights and quantized activations; the rest of the layers run in higher precision
    stats["quantized_layers"] = len(int8_layers - float_fed)
    stats["fallback_layers"] = len(layers) - stats["quantized_layers"]

    if dequantize_dynamic:
        stats["dequantized_dynamic"] = _dequantize_dynamic(g, inits)
    prune_unused(g)
    del g.value_info[:]  # types changed (uint8 -> int8, int32 -> float): infer them again
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # a help for later passes, not a requirement
        pass
    stats["computes"] = quantized_kind(model)  # what the graph TensorRT gets computes below float: int8, fp8 or None
    from tasks.prequant.weight_only import weight_only_dqs

    only_weights = weight_only_dqs(model.graph)
    if not activations and only_weights and len(only_weights) == sum(n.op_type == "DequantizeLinear" for n in model.graph.node):
        # weight-only quantization (no activation is quantized): TensorRT's layers compute float from int8 weights, so
        # the model is a float model to every precision (int8 calibrates its activations, keeping its weight scales)
        stats["computes"] = None
        stats["weight_only"] = len(only_weights)
    stats["dynamic_left"] = sum(1 for n in model.graph.node if n.op_type in DYNAMIC_OPS)  # run natively
    return model, stats


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
        raise ConfigError(
            f"precision={precision}: the model's quantization is dynamic ({dynamic} ops, run natively in ONNX Runtime), "
            f"so its TensorRT engines compute float, not {precision}",
            fix="build it at precision=fp16 or precision=fp32, or set model.dequantize_dynamic=true to dequantize it "
                f"and calibrate it to {precision} for TensorRT")
    if precision == "fp16":
        return "fp16"
    if precision == kind:
        return "as_is"
    raise ConfigError(
        f"precision={precision}: the model arrives quantized to {kind} ({what}); its quantized layers compute {kind} "
        f"whatever the precision, so an engine named {precision} would not compute {precision}",
        fix=f"build it at precision={kind} (as shipped, its float part as it is) or precision=fp16 (its float part in "
            "fp16)")


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


def _add(g, inits, name: str, value: np.ndarray) -> None:
    inits[name] = numpy_helper.from_array(value, name)
    g.initializer.append(inits[name])


def _constants_from_quantized_constants(g, inits) -> int:
    """QuantizeLinear of a constant (ONNX Runtime quantizes weights stored as Constant nodes like activations: uint8,
    asymmetric) is a constant: the codes ONNX Runtime computes, saturate(round_half_even(w / scale) + zero_point).
    Its DequantizeLinear then follows the rules for weights. Returns the count."""
    count = 0
    for q in [n for n in g.node if n.op_type == "QuantizeLinear" and n.input[0] in inits]:
        zp = _zero_point(q, inits)
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
        _add(g, inits, q.output[0], codes)
        g.node.remove(q)
        count += 1
    return count


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
    _add(g, inits, sname, new_scale)
    _add(g, inits, zname, np.zeros(zp.shape, np.int8))
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
                _add(g, inits, name, np.array(v, dtype=scale.dtype))
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
    _add(g, inits, cname, c)
    _add(g, inits, zname, np.zeros(zp.shape, np.int8))
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


def _fold_shift(g, sub, shift: tuple, inits) -> int:
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
        _add(g, inits, name, corr.astype(dtype))
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
        _add(g, inits, name, corr.astype(dtype))
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
    _add(g, inits, pname, np.array([0, 0, *pads[:nd], 0, 0, *pads[nd:]], np.int64))
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
        return _dequantize(dq, inits).astype(np.float64)
    return None


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
    zp = _zero_point(dq, inits)
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
    _add(g, inits, name, codes)
    _add(g, inits, zname, np.zeros((), np.int8))
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
            _add(g, inits, kname, np.full(shape, d, dtype=scale.dtype))
            box = onnx.helper.make_node("Conv", [r.input[0], kname], [term], name=term)
            box.attribute.extend(a for a in r.attribute)
            nodes = [box]
        else:
            axes, dname, rs = (unique_name(f"{term}_{v}", taken | set(inits)) for v in ("axes", "d", "rowsum"))
            _add(g, inits, axes, np.array([-1], np.int64))
            _add(g, inits, dname, np.array(d, dtype=scale.dtype))
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
    w = _dequantize(dq, inits)
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
    _add(g, inits, name, wq)
    _add(g, inits, sname, new.reshape(-1) if axis is not None else new.reshape(()))
    _add(g, inits, zname, np.zeros(w.shape[axis], np.int8) if axis is not None else np.zeros((), np.int8))
    dq.input[:] = [name, sname, zname]
    del dq.attribute[:]
    if axis is not None:
        dq.attribute.append(onnx.helper.make_attribute("axis", axis))
    return True


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
    names = [unique_name(f"{q.input[0]}_{k}", inits) for k in ("qmin", "qmax", "clamped")]
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


def _dequantize_dynamic(g, inits) -> int:
    """MatMulInteger/ConvInteger(DynamicQuantizeLinear(x), W_q) -> Cast -> Mul(scale_x * scale_w) becomes a float
    MatMul/Conv of x with W = (W_q - zp) * scale_w (ONNX Runtime's quantize_dynamic pattern). Returns the count."""
    producers, consumers = links(g)
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
        name = unique_name(node.input[1] + "_float", inits)
        inits[name] = numpy_helper.from_array(((wq - wzp) * ws).astype(np.float32), name)
        g.initializer.append(inits[name])
        op = "MatMul" if node.op_type == "MatMulInteger" else "Conv"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        new = onnx.helper.make_node(op, [dql.input[0], name], [mul.output[0]], name=(node.name or op) + "_float", **attrs)
        g.node.insert(list(g.node).index(mul), new)
        g.node.remove(mul)
        count += 1
    return count + sum(_float_lstm(g, n, inits) for n in [n for n in g.node if n.op_type == "DynamicQuantizeLSTM"])


def _float_lstm(g, node, inits) -> int:
    """com.microsoft DynamicQuantizeLSTM (ONNX Runtime's quantize_dynamic of an LSTM: int8 W [D, I, 4H] and R [D, H, 4H],
    transposed, with per-direction [D] or per-channel [D, 4H] scales and zero points) becomes the float ONNX LSTM it
    came from. Returns 1, or 0 when its weights are not constants."""
    names = list(node.input) + [""] * (12 - len(node.input))
    weights = []
    for w, s, z in ((names[1], names[8], names[9]), (names[2], names[10], names[11])):
        if w not in inits or s not in inits or (z and z not in inits):
            return 0
        wq = numpy_helper.to_array(inits[w]).astype(np.float64)
        scale = numpy_helper.to_array(inits[s]).astype(np.float64)
        zp = numpy_helper.to_array(inits[z]).astype(np.float64) if z else np.zeros_like(scale)
        per = (-1, 1, wq.shape[2]) if scale.ndim == 2 else (-1, 1, 1)  # [D, 4H] per channel, else [D]
        f = ((wq - zp.reshape(per)) * scale.reshape(per)).transpose(0, 2, 1)  # ONNX LSTM: [D, 4H, I]
        name = unique_name(w + "_float", inits)
        inits[name] = numpy_helper.from_array(f.astype(np.float32), name)
        g.initializer.append(inits[name])
        weights.append(name)
    ins = [names[0], *weights, *names[3:8]]
    while ins and not ins[-1]:
        ins.pop()
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    replace_node(g, node, [onnx.helper.make_node("LSTM", ins, list(node.output), name=(node.name or "LSTM") + "_float",
                                                 **attrs)])
    return 1
