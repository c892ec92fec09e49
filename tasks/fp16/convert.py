"""FP32 -> FP16 ONNX conversion for strongly typed TensorRT(-RTX) builds.

TensorRT-RTX takes precision from the graph's tensor types, so the graph itself
has to be fp16.  This wraps onnxconverter-common's converter and works around
the problems it has with real models (see ``fp16_from_onnx``).
"""

from __future__ import annotations

import collections
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.graph.types import SHAPE_OPS, unify_input_types
from tasks.graph.edit import name_allocator, names_in, node_inputs, subgraphs, toposort, uniquify_node_names
from tasks.graph.fold import fold_constants
from tasks.graph.load import drop_initializer_inputs, opset_of, with_opset

FP16_MAX = 65504.0
# Initializers whose fp16 rounding error (relative L2) exceeds this keep their
# consumers in fp32 (plain fp16 rounding is <= 2**-11 ~ 4.9e-4; denormal
# eps scalars like 1e-5 are ~1.4e-3 and harmless).
MAX_REL_ERROR = 1e-2
# Ops always kept in fp32 on top of onnxconverter-common's default block list.
# BatchNormalization: variances up to ~1e8 in PP-OCRv4 det overflow fp16.
EXTRA_FP32_OPS = ("BatchNormalization",)
def fp16_from_onnx(model: onnx.ModelProto, keep_fp32: dict[str, float] | None = None,
                   cancel_fp32: dict[str, float] | None = None, tiny_fp32: dict[str, float] | None = None,
                   keep_nodes: dict[str, float] | None = None) -> tuple[onnx.ModelProto, dict]:
    """fp16 copy of ``model``; the converter's per-value truncation warnings are silenced (the stats count them).
    From what the user's data holds (``fp16_hazards_from_data``): ``keep_fp32``, values beyond fp16's range (the nodes
    making and reading them stay fp32); ``cancel_fp32``, the values a cancelling subtraction is computed from (the
    nodes making them stay fp32); ``tiny_fp32``, values below fp16's normal range (the nodes making and reading them
    stay fp32). ``keep_nodes``: {node name: what it costs in fp16} that the accuracy search keeps fp32
    (tasks.fp16.search; names as this conversion gives them, the same on every call)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _fp16_from_onnx(model, keep_fp32 or {}, cancel_fp32 or {}, tiny_fp32 or {}, keep_nodes or {})


# A node reading or making values above this on the user's data stays fp32: 2x headroom under fp16's largest finite
# value (65504) for data the sample did not show. ModelOpt AutoCast's default is 512 (build.fp16_data_max=512 does
# the same), which on PP-OCRv4 det keeps convs reading ~3000-valued feature maps in fp32 (52% of its FLOPs measured)
# although fp16 holds them with its usual relative precision; 8192 still kept a conv whose outputs reach ~22000 (22%).
DATA_MAX = 32768.0
RANGE_FEEDS = 4  # feeds the range check runs on (each exposes every intermediate value at once)


# fp16's unit roundoff: an fp16 value is off by up to this fraction of itself
FP16_EPS = 2.0 ** -11
# fp16's smallest normal value (6.1e-5): below it values are subnormal (precision lost) or flushed to zero
FP16_TINY = 2.0 ** -14
# a value that fp16's subnormal range would leave more than this wrong (relative L2, from its elements below FP16_TINY
# alone) is kept fp32 with its nodes: as MAX_REL_ERROR does for initializers (values ~1e-7: ~17%; ~1e-5: ~0.2%)
UNDERFLOW_MAX = 1e-2
# A Sub/Add whose fp16 operands would make its result this wrong is a harmful cancellation: relative L2 error over the
# result, or, where it feeds a divisor, square root or log, the error of a tenth of its elements (the
# CANCEL_PERCENTILE-th percentile), each relative to itself
CANCEL_MAX_ERROR = 1e-2
CANCEL_PERCENTILE = 90
# ops that blow a small value's relative error up into the result (the input index that does, None: any)
AMPLIFIERS = {"Sqrt": 0, "Reciprocal": 0, "Log": 0, "Div": 1, "Pow": 0}
# ops a value passes through on its way to one (a LayerNorm's Max(var, 0), + eps, reshapes, casts, 1/n scaling)
PASS_THROUGH = ("Max", "Min", "Add", "Mul", "Reshape", "Expand", "Squeeze", "Unsqueeze", "Cast", "Identity",
                "Transpose", "Abs", "Relu", "Clip")
AMPLIFIER_DEPTH = 6
CANCEL_DEPTH = 12  # how far up the two operands' producers are followed to the value they share
CANCEL_CONE_MAX = 24  # a cone larger than this keeps only the subtraction and its operands' producers fp32


def fp16_hazards_from_data(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]],
                           data_max: float = DATA_MAX, underflow: bool = False) -> tuple[dict[str, float], ...]:
    """What fp16 would break on ``feeds`` (the user's data), judged on the fp32 model in ONNX Runtime with every float
    value exposed, one feed at a time (at most RANGE_FEEDS):

    * range: {value: max |value|} for every node output (or graph input) above ``data_max`` in magnitude or not
      finite; the nodes making or reading it stay fp32 (as ModelOpt AutoCast classifies nodes by magnitude);
    * cancellation: {value: estimated relative error} for the values a subtraction of nearly equal numbers is computed
      from. A Sub (or an Add of opposite signs) of operands rounded to fp16 is off by about FP16_EPS x (|a| + |b|),
      which is a large share of a - b when the two nearly cancel: x - mean(x) of values far from zero, and a
      variance taken as E[x^2] - E[x]^2 (Flax's LayerNorm, jax2tf exports), whose small elements 1/sqrt(var + eps)
      then blows up. Where the result would be more than CANCEL_MAX_ERROR wrong on the data (relative L2; for a
      result that divides or goes under a square root or log, a tenth of its elements each), its operands are
      computed in fp32 from the value the two share (e.g. the LayerNorm's input, which stays fp16): the producers
      between it and the subtraction, and the subtraction itself;
    * underflow (with ``underflow``, a third dict): {value: the relative L2 error fp16 gives its elements below fp16's
      normal range (FP16_TINY, ~6.1e-5, where fp16 is subnormal: steps of 6e-8)} for every value where it exceeds
      UNDERFLOW_MAX (a scaled-down intermediate); the nodes making or reading it stay fp32, as the range check does
      for values above ``data_max``.

    Values, not node names: names are given to unnamed nodes later."""
    import onnxruntime as ort

    if not feeds:
        return ({}, {}, {}) if underflow else ({}, {})
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.value_info, *g.output, *g.input)}
    floats = [o for n in g.node for o in n.output
              if o and types.get(o, TensorProto.FLOAT) in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)]
    have = {o.name for o in g.output}
    g.output.extend(onnx.ValueInfoProto(name=o) for o in floats if o not in have)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the values of the graph as written
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    consts = {t.name: t for t in g.initializer}
    subtractions = [n for n in g.node if n.op_type in ("Sub", "Add") and len(n.input) == 2 and all(n.input)]
    amplified = {id(n) for n in _amplified(g, subtractions)}
    peak: dict[str, float] = {}
    tiny: dict[str, float] = {}  # value -> fp16's error from its elements below the normal range (the worst feed)
    whole: dict[int, list[float]] = {}  # subtraction -> [sum |a|^2 + |b|^2 (broadcast), sum |result|^2] over the feeds
    spread: dict[int, list[np.ndarray]] = {}  # amplified subtraction -> its elements' fp16 relative errors
    for feed in feeds[:RANGE_FEEDS]:
        one = {k: (v[:1] if getattr(v, "ndim", 0) else v) for k, v in feed.items()} if _batched(feed) else feed
        try:
            values = sess.run(names, one)  # a sample of each feed (values do not grow with the batch)
        except Exception:  # noqa: BLE001 - a model that takes no other batch: the whole feed
            values, one = sess.run(names, feed), feed
        held = {**dict(zip(names, values)), **one}
        bad = set()  # values not finite in this feed
        for name, value in held.items():  # graph inputs too: their readers
            a = np.asarray(value)
            if a.dtype.kind != "f" or a.size == 0:
                continue
            top = max(float(a.max()), -float(a.min()))  # |x|'s max without a copy; NaN and inf propagate
            top = top if np.isfinite(top) else float("inf")
            peak[name] = max(peak.get(name, 0.0), top)
            if top == float("inf"):
                bad.add(name)
            elif underflow and top > 0:
                lost = _underflow_error(a)
                if lost > UNDERFLOW_MAX:
                    tiny[name] = max(tiny.get(name, 0.0), lost)
        norms: dict[str, float] = {}

        def square_norm(name: str, x: np.ndarray) -> float:  # of a value of this feed (one pass, no copy)
            if name not in norms:
                flat = np.ascontiguousarray(x, np.float32).ravel()
                with np.errstate(over="ignore", invalid="ignore"):
                    norms[name] = float(np.dot(flat, flat))
            return norms[name]

        for i, n in enumerate(subtractions):
            out = held.get(n.output[0])  # computed by ONNX Runtime already
            ops = [held.get(x) if x in held else (numpy_helper.to_array(consts[x]) if x in consts else None)
                   for x in n.input]
            if out is None or any(o is None or np.asarray(o).dtype.kind != "f" for o in ops) or \
                    bad & {n.output[0], *n.input}:
                continue
            a, b = (np.asarray(o) for o in ops)
            out = np.asarray(out)
            if out.size == 0 or out.size % a.size or out.size % b.size:
                continue
            # the operands' fp16 rounding errors are independent: the result's error has the squared norm
            # FP16_EPS^2 (|a|^2 + |b|^2), a broadcast operand counted once per copy (its error is repeated)
            s2 = sum(square_norm(x, o) * (out.size // o.size) for x, o in zip(n.input, (a, b)))
            o2 = square_norm(n.output[0], out)
            if not (np.isfinite(s2) and np.isfinite(o2)):
                continue  # beyond fp16's range anyway: the range check keeps these nodes
            acc = whole.setdefault(i, [0.0, 0.0])
            acc[0] += s2
            acc[1] += o2
            if id(n) in amplified:
                try:
                    size = np.broadcast_to(np.abs(a) + np.abs(b), out.shape)
                except ValueError:
                    continue
                with np.errstate(divide="ignore", invalid="ignore"):
                    rel = FP16_EPS * size / np.abs(out)  # each element's: fp16 operands' rounding, relative to it
                spread.setdefault(i, []).append(np.nan_to_num(rel.ravel(), nan=0.0, posinf=np.inf))
    over = {n: v for n, v in peak.items() if not v <= data_max}
    float_values = set(floats)
    cancel: dict[str, float] = {}
    producer = {o: n for n in g.node for o in n.output if o}
    for i, (size2, out2) in whole.items():
        err = FP16_EPS * (size2 / out2) ** 0.5 if out2 > 0 else 0.0  # the result's relative L2 error
        if i in spread:
            err = max(err, float(np.percentile(np.concatenate(spread[i]), CANCEL_PERCENTILE)))
        if err > CANCEL_MAX_ERROR:
            for v in _cancellation_cone(producer, subtractions[i]):
                if v in float_values:
                    cancel[v] = max(cancel.get(v, 0.0), err)
    if underflow:
        return over, cancel, {n: v for n, v in tiny.items() if n not in over}
    return over, cancel


def _underflow_error(a: np.ndarray, chunk: int = 1 << 22) -> float:
    """The relative L2 error (against all of ``a``) that fp16 gives ``a``'s elements below its normal range
    (FP16_TINY): subnormal fp16 keeps steps of 2^-24 there, so ~1e-7 values lose most of their digits. One float32 dot
    product first: the error is at most sqrt(n) 2^-25 / |a|, which rules out nearly every tensor at once."""
    flat = np.ascontiguousarray(a, np.float32).ravel()
    with np.errstate(over="ignore", invalid="ignore"):
        energy = float(np.dot(flat, flat))
    if not np.isfinite(energy) or flat.size * 2.0 ** -50 <= UNDERFLOW_MAX ** 2 * energy:
        return 0.0
    err = 0.0
    for i in range(0, flat.size, chunk):
        x = flat[i:i + chunk]
        tiny = x[np.abs(x) < FP16_TINY].astype(np.float64)
        d = tiny.astype(np.float16).astype(np.float64) - tiny
        err += float(np.dot(d, d))
    return (err / energy) ** 0.5 if energy > 0 else 0.0


def _amplified(g: onnx.GraphProto, subtractions: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The ``subtractions`` (Sub/Add nodes) whose result reaches a divisor, square root or log (AMPLIFIERS) within AMPLIFIER_DEPTH nodes
    through PASS_THROUGH ops: where a cancelled, mostly-rounding-error small value is blown up (a variance under
    1/sqrt(var + eps)). Elsewhere an fp16 cancellation's error stays small next to the tensor's other values."""
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = collections.defaultdict(list)
    for n in g.node:
        for k, x in enumerate(n.input):
            if x:
                readers[x].append((n, k))

    seen: dict[tuple[str, int], bool] = {}

    def amplified(value: str, depth: int) -> bool:
        if (value, depth) not in seen:
            seen[(value, depth)] = any(
                (r.op_type in AMPLIFIERS and AMPLIFIERS[r.op_type] in (None, k)) or
                (depth > 1 and r.op_type in PASS_THROUGH and any(amplified(o, depth - 1) for o in r.output if o))
                for r, k in readers.get(value, []))
        return seen[(value, depth)]

    return [n for n in subtractions if any(amplified(o, AMPLIFIER_DEPTH) for o in n.output if o)]


def _cancellation_cone(producer: dict[str, onnx.NodeProto], node: onnx.NodeProto) -> list[str]:
    """The values to compute in fp32 for ``node``'s subtraction to be exact up to fp32: its output, and every value
    on the paths from the nearest value its two operands share (not included) to its operands (included).
    ``producer``: value -> the node making it."""

    def upward(v: str) -> set[str]:
        seen, frontier = {v}, [v]
        for _ in range(CANCEL_DEPTH):
            frontier = [x for f in frontier if f in producer for x in producer[f].input if x and x not in seen]
            seen.update(frontier)
        return seen

    a, b = (upward(x) for x in node.input)
    shared = a & b
    upstream = set().union(*(upward(x) - {x} for x in shared)) if shared else set()
    cone = [v for v in (a | b) - shared - upstream if v in producer]
    if not shared or len(cone) > CANCEL_CONE_MAX:
        cone = [x for x in node.input if x in producer]
    return [o for o in node.output if o] + sorted(cone)


def _batched(feed: dict) -> bool:
    """Whether every input of a feed shares its leading (batch) axis, so that its first sample is a feed too."""
    lengths = {v.shape[0] for v in feed.values() if getattr(v, "ndim", 0)}
    return len(lengths) == 1 and lengths.pop() > 1


def _fp16_from_onnx(model: onnx.ModelProto, keep_fp32: dict[str, float], cancel_fp32: dict[str, float],
                    tiny_fp32: dict[str, float], keep_nodes: dict[str, float]) -> tuple[onnx.ModelProto, dict]:
    """Return an fp16 copy of ``model`` (graph inputs/outputs stay fp32) and stats.

    Nodes kept in fp32:
      * ops in onnxconverter-common's default block list + EXTRA_FP32_OPS;
      * nodes whose outputs don't depend on graph-input data except through
        Shape/Size (shape arithmetic such as anchor grids): mixing their fp32
        outputs with fp16 breaks TensorRT builds with dynamic shapes;
      * nodes reading or making a value beyond fp16's range on the user's data
        (``keep_fp32``) or below its normal range (``tiny_fp32``), and nodes
        making a value that a cancelling subtraction is computed from
        (``cancel_fp32``);
      * the nodes the accuracy search keeps (``keep_nodes``, by name);
      * nodes consuming a float initializer that fp16 can't hold: overflow
        (|x| > 65504) or most of its mass in the subnormal range (relative L2
        rounding error > MAX_REL_ERROR; stray denormal weights don't count);
      * a DequantizeLinear whose every reader is kept fp32 (a quantized Conv
        whose values leave fp16's range): it dequantizes to fp32 itself, since
        a Cast between a DQ and its layer stops TensorRT fusing them into an
        int8 layer (the layer ran in fp32 on dequantized values).
    Models that already contain fp16: if most float weights are fp16 the model
    is taken as converted and returned unchanged (``already_fp16`` in the
    stats); otherwise the rest is converted and existing fp16 parts are kept.

    Subgraphs (If/Loop/Scan bodies) are converted with their node; a subgraph
    reading an outer-scope tensor of the other float type gets a Cast in the
    scope that defines the tensor (``outer_scope_casts``).

    The input model is not modified.  Stats count nodes after Constant folding:
    ``fp16_nodes`` are those left to the fp16 graph (int-only ones included),
    ``casts_added`` is the net number of Cast nodes inserted.
    """
    from onnxconverter_common import float16

    t0 = time.perf_counter()
    content = _float_content(model.graph)
    if content["fp16_weights"] > content["fp32_weights"]:
        # Mostly fp16 already: the author chose the precisions (fp32 islands
        # around Softmax/LayerNorm/...); converting again would undo that.
        m = onnx.ModelProto()
        m.CopyFrom(model)
        return m, _unchanged_stats(m, content, t0)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph

    drop_initializer_inputs(m)  # legacy IR < 4: initializers listed as inputs too (export does this already)
    qdq_opset = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in m.graph.node) and opset_of(m) < 19
    if qdq_opset:  # the float part of a quantized model in fp16: fp16 Q/DQ scales need opset 19
        m, _ = with_opset(m, 19)
    toposort(g)  # the passes below walk nodes in order (export sorts already)
    folded = fold_constants(g)
    uniquify_node_names(g)

    op_block = set(float16.DEFAULT_OP_BLOCK_LIST) | set(EXTRA_FP32_OPS)
    reasons: dict[str, str] = {}
    for node in g.node:
        if node.op_type in op_block:
            reasons[node.name] = "op"
    for name in _shape_only_nodes(g):
        reasons.setdefault(name, "shape_only")
    for name in _range_unsafe_consumers(g):
        reasons.setdefault(name, "initializer_range")
    data_range = {}
    for node in g.node:  # a node reading or making a value beyond fp16's range (AutoCast checks inputs and outputs)
        over = [keep_fp32[v] for v in (*node.input, *node.output) if v in keep_fp32]
        if over:
            reasons.setdefault(node.name, "data_range")
            data_range[node.name] = max(over)
    underflow = {}
    for node in g.node:  # a node reading or making values that fp16 flushes (below its normal range, ~6.1e-5)
        tiny = [tiny_fp32[v] for v in (*node.input, *node.output) if v in tiny_fp32]
        if tiny:
            reasons.setdefault(node.name, "data_underflow")
            underflow[node.name] = max(tiny)
    for node in g.node:  # what the accuracy search keeps (tasks.fp16.search), after the data's own reasons
        if node.name in keep_nodes:
            reasons.setdefault(node.name, "accuracy")
    cancellation = {}
    for node in g.node:  # a node making a value a cancelling subtraction is computed from (or the subtraction)
        errs = [cancel_fp32[v] for v in node.output if v in cancel_fp32]
        if errs:
            reasons.setdefault(node.name, "cancellation")
            cancellation[node.name] = max(errs)
    for name in _dequantize_feeding_fp32(g, set(reasons)):
        reasons.setdefault(name, "dq_of_fp32_layer")
    _split_shared_initializers(g, set(reasons))
    kept = collections.Counter(n.op_type for n in g.node if n.name in reasons)

    fp32_outputs = [o.name for o in g.output if o.type.tensor_type.elem_type == TensorProto.FLOAT]
    del g  # let the pre-inference copy go
    m = onnx.shape_inference.infer_shapes(m)
    g = m.graph
    _keep_float_value_info(g)  # only float value_info matters to the converter
    n_before = len(g.node)

    _convert_graph(g, op_block, set(reasons))
    retargeted = _retarget_float_casts(g)
    _restore_fp32_outputs(g, fp32_outputs)
    bypassed = _bypass_cast_round_trips(g)
    outer_casts = _fix_outer_scope_refs(g, op_block, set(reasons))
    if outer_casts:
        toposort(g)
    uniquify_node_names(g)
    # what the converter left mixed (a graph output its own fp32 Cast now feeds to converted readers, a value without
    # value_info): kept nodes take fp32 on every float input of a type group, converted nodes fp16
    type_casts = unify_input_types(m, {n.name for n in g.node if n.name in reasons or n.op_type in op_block})
    _drop_dangling_value_info(g)

    by_reason = collections.Counter(reasons.values())
    n_fp32 = sum(kept.values())
    stats = {
        "fp16_nodes": n_before - n_fp32,
        "fp32_nodes": n_fp32,
        "kept_fp32_ops": dict(kept.most_common()),
        "fp32_reasons": dict(by_reason),
        "constants_folded": folded,
        "casts_added": len(g.node) - n_before,
        "casts_retargeted": retargeted,
        "cast_round_trips_removed": bypassed,
        "outer_scope_casts": outer_casts,
        "type_casts": type_casts,
        "fp16_tensors_before": content["fp16_tensors"],
        "already_fp16": False,
        "opset_upgraded_for_fp16_qdq": qdq_opset,
        "data_range": {n: v for n, v in data_range.items() if reasons.get(n) == "data_range"},
        # node -> the share of a value it reads or makes lost below fp16's normal range (relative L2)
        "data_underflow": {n: v for n, v in underflow.items() if reasons.get(n) == "data_underflow"},
        # node -> what it cost in fp16 (its error growth), kept fp32 by the accuracy search
        "accuracy": {n: keep_nodes[n] for n in keep_nodes if reasons.get(n) == "accuracy"},
        # node -> the estimated relative error fp16 would give the subtraction it feeds (it computes in fp32)
        "cancellation": {n: v for n, v in cancellation.items() if reasons.get(n) == "cancellation"},
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return m, stats


def _convert_graph(graph: onnx.GraphProto, op_block: set[str], node_block: set[str]) -> None:
    """float16.convert_float_to_float16(keep_io_types=True, disable_shape_infer=True,
    max_finite_val=FP16_MAX), in place, minus its quadratic parts.

    Its topological sort and block-list cast insertion scan the whole graph per
    node (>1 min at 10k nodes); both are replaced by linear versions here.
    Outer-scope references from subgraphs are fixed up later (_fix_outer_scope_refs).
    """
    from onnxconverter_common import float16 as f

    renamed_inputs: dict[str, str] = {}
    level, top = [graph], True
    while level:
        next_level = []
        for g in level:
            f.process_graph_input(g, top, True, renamed_inputs)
            vi_block = f.process_tensor_in_node(g, op_block, node_block, 1e-7, FP16_MAX)
            f.process_value_info(g, vi_block)
            _cast_around_blocked(g, op_block, node_block)
            f.process_initializers(g, op_block, node_block, 1e-7, FP16_MAX)
            f.process_graph_output(g, top, True)
            next_level.extend(f.get_next_level_graph(g, op_block, node_block))
            # Not f.process_node_input_output: it points subgraph references to
            # graph inputs at one of the per-consumer input Casts, which may be
            # removed later (fp32 consumer); _fix_outer_scope_refs does it right.
            top = False
        level = next_level
    toposort(graph)
    # Not f.remove_unnecessary_cast_node: it ignores subgraph references (drops
    # Casts whose outputs If branches read) and runs before _retarget_float_casts
    # (bypasses a Cast(to=FLOAT) still meant to output fp16); _bypass_cast_round_trips
    # does the same job afterwards.


def _cast_around_blocked(g: onnx.GraphProto, op_block: set[str], node_block: set[str]) -> None:
    """Linear-time float16.process_node_in_block_list: fp16 -> fp32 Casts before
    blocked nodes, fp32 -> fp16 Casts after them (same names as the converter)."""
    vi_in: dict[str, onnx.ValueInfoProto] = {}
    vi_out: dict[str, onnx.ValueInfoProto] = {}
    for v in g.value_info:
        vi_in.setdefault(v.name, v)
        vi_out.setdefault(v.name, v)
    for v in g.input:
        vi_in.setdefault(v.name, v)
    for v in g.output:
        vi_out.setdefault(v.name, v)

    fresh = name_allocator(g)  # a model converted by this converter before already has "<node>_input_cast_0"

    def add_vi(like, name, dtype):
        v = g.value_info.add()
        v.CopyFrom(like)
        v.name = name
        v.type.tensor_type.elem_type = dtype

    for node in list(g.node):  # snapshot: don't visit the Casts we append
        if node.op_type not in op_block and node.name not in node_block:
            continue
        for i, name in enumerate(node.input):
            v = vi_in.get(name)
            if v is not None and v.type.tensor_type.elem_type == TensorProto.FLOAT16:
                new = fresh(f"{node.name}_input_cast_{i}")
                add_vi(v, new, TensorProto.FLOAT)
                g.node.append(helper.make_node("Cast", [name], [new], to=TensorProto.FLOAT, name=fresh(f"{node.name}_input_cast{i}")))
                node.input[i] = new
        for i, name in enumerate(node.output):
            v = vi_out.get(name)
            if v is not None and v.type.tensor_type.elem_type == TensorProto.FLOAT:
                new = fresh(f"{node.name}_output_cast_{i}")
                add_vi(v, new, TensorProto.FLOAT)
                v.type.tensor_type.elem_type = TensorProto.FLOAT16
                g.node.append(helper.make_node("Cast", [new], [name], to=TensorProto.FLOAT16, name=fresh(f"{node.name}_output_cast{i}")))
                node.output[i] = new


def _shape_only_nodes(g: onnx.GraphProto) -> list[str]:
    """Names of nodes whose outputs don't depend on graph-input *values*.

    A tensor is "data" if it is a graph input, the output of a non-Shape/Size
    node with any data input, or a DequantizeLinear output (quantized weights:
    values that feed the math, not shapes).  Nodes producing no data tensors are
    shape arithmetic (or constant folding material) and are kept in fp32.
    """
    inits = {t.name for t in g.initializer}
    data = {i.name for i in g.input if i.name not in inits}
    out = []
    for node in g.node:  # ONNX requires topological order
        if node.op_type == "DequantizeLinear" or (
                node.op_type not in SHAPE_OPS and any(i in data for i in node_inputs(node))):
            data.update(node.output)
        else:
            out.append(node.name)
    return out


def _dequantize_feeding_fp32(g: onnx.GraphProto, fp32: set[str]) -> list[str]:
    """DequantizeLinear nodes all of whose readers are in ``fp32`` (kept fp32): converted, they would output fp16 and
    the converter would put a Cast between them and their layer, which TensorRT does not fuse into a quantized layer."""
    readers = collections.defaultdict(list)
    for node in g.node:
        for i in node_inputs(node):
            readers[i].append(node.name)
    outputs = {o.name for o in g.output}
    return [n.name for n in g.node if n.op_type == "DequantizeLinear" and n.name not in fp32
            and readers.get(n.output[0]) and n.output[0] not in outputs
            and all(r in fp32 for r in readers[n.output[0]])]


def _range_unsafe_consumers(g: onnx.GraphProto) -> set[str]:
    """Names of nodes consuming float initializers that don't survive fp16."""
    bad = {
        t.name
        for t in g.initializer
        if t.data_type == TensorProto.FLOAT and _fp16_rel_error(numpy_helper.to_array(t)) > MAX_REL_ERROR
    }
    if not bad:
        return set()
    return {n.name for n in g.node if bad.intersection(node_inputs(n))}


def _fp16_rel_error(a: np.ndarray, chunk: int = 1 << 20) -> float:
    """Relative L2 error of casting ``a`` to fp16: inf on overflow, large when
    the tensor's mass sits in fp16's subnormal/zero range.  A few denormal
    leftovers in trained weights (common) don't count.  Chunked to bound memory."""
    a = a.ravel()
    finite = np.isfinite(a)
    if not finite.all():
        a = a[finite]
    err = ref = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, a.size, chunk):
            x = a[i : i + chunk].astype(np.float64)
            d = x.astype(np.float16).astype(np.float64) - x
            err += float(np.square(d).sum())
            ref += float(np.square(x).sum())
    if err != err or err == np.inf:  # overflow -> inf/nan
        return np.inf
    return (err / ref) ** 0.5 if ref > 0 else 0.0


def _split_shared_initializers(g: onnx.GraphProto, blocked: set[str]) -> None:
    """Give fp16 consumers their own copy of float initializers shared with fp32 nodes.

    The converter keeps any initializer feeding a blocked node in fp32, which
    would hand fp32 weights to fp16 nodes sharing it.
    """
    floats = {t.name: t for t in g.initializer if t.data_type == TensorProto.FLOAT}
    users = collections.defaultdict(set)
    for node in g.node:
        for i in node.input:
            if i in floats:
                users[i].add(node.name in blocked)
    for name, kinds in users.items():
        if len(kinds) < 2:
            continue
        copy = g.initializer.add()
        copy.CopyFrom(floats[name])
        copy.name = f"{name}_fp16"
        for node in g.node:
            if node.name not in blocked:
                for k, i in enumerate(node.input):
                    if i == name:
                        node.input[k] = copy.name


def _keep_float_value_info(g: onnx.GraphProto) -> None:
    """Keep float value_info, minus entries for graph inputs/outputs and initializers.

    Shape inference (sanitize's data_prop pass) can list a graph output in
    value_info too; the converter then flips that copy to fp16 and
    _retarget_float_casts turns the fp32 output Cast into an fp16 one.
    """
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16)
    # initializers too: a value_info entry for one (left by the version converter's shape inference) is flipped to
    # fp16 by the converter, which then casts a blocked node's fp32 initializer through fp16 (BN variances -> inf)
    io = {v.name for v in (*g.input, *g.output)} | {t.name for t in g.initializer}
    vi = [v for v in g.value_info if v.type.tensor_type.elem_type in floats and v.name not in io]
    del g.value_info[:]
    g.value_info.extend(vi)


def _retarget_float_casts(g: onnx.GraphProto) -> int:
    """Cast(to=FLOAT) whose output the converter declared fp16 -> Cast(to=FLOAT16), subgraphs (If/Loop bodies) included.

    onnxconverter-common 1.16 changes the output type but not the ``to`` attribute.
    """
    fp16 = {v.name for v in g.value_info if v.type.tensor_type.elem_type == TensorProto.FLOAT16}
    fp16 -= {o.name for o in g.output if o.type.tensor_type.elem_type != TensorProto.FLOAT16}
    n = 0
    for node in g.node:
        if node.op_type == "Cast" and node.output[0] in fp16:
            for a in node.attribute:
                if a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = TensorProto.FLOAT16
                    n += 1
        for sub in subgraphs(node):
            n += _retarget_float_casts(sub)
    return n


def _restore_fp32_outputs(g: onnx.GraphProto, names: list[str]) -> None:
    """Make graph outputs that were fp32 fp32 again.

    When a blocked (fp32) node produces a graph output, the converter casts it
    to fp16 under the output's name and then skips its own fp32 output cast.
    """
    outputs = {o.name: o for o in g.output}
    producer = {o: n for n in g.node for o in n.output}
    for name in names:
        out = outputs[name]
        node = producer.get(name)
        if node is None:
            continue
        if node.op_type == "Cast":  # fp32 output cast, or the converter's fp32 -> fp16 one: make it fp32
            out.type.tensor_type.elem_type = TensorProto.FLOAT
            for a in node.attribute:
                if a.name == "to":
                    a.i = TensorProto.FLOAT
            continue
        if out.type.tensor_type.elem_type == TensorProto.FLOAT:
            continue
        out.type.tensor_type.elem_type = TensorProto.FLOAT
        k = list(node.output).index(name)
        node.output[k] = f"{name}_fp16"
        g.node.append(helper.make_node("Cast", [node.output[k]], [name], to=TensorProto.FLOAT, name=f"{name}_cast_fp32"))


def _drop_dangling_value_info(g: onnx.GraphProto) -> None:
    produced = {o for n in g.node for o in n.output}
    vi = [v for v in g.value_info if v.name in produced]
    del g.value_info[:]
    g.value_info.extend(vi)


def _bypass_cast_round_trips(g: onnx.GraphProto) -> int:
    """Rewire x(fp32) -> Cast(fp16) -> Cast(fp32) -> y to use x directly.

    The converter puts such pairs between chained fp32 nodes (e.g. shape
    arithmetic feeding several consumers); they only lose precision.
    Dead Casts left behind are removed.
    """
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    producer = {o: n for n in g.node for o in n.output}
    graph_outputs = {o.name for o in g.output}

    def cast_to(node):
        return next((a.i for a in node.attribute if a.name == "to"), None)

    rename = {}
    for node in g.node:
        if node.op_type != "Cast" or cast_to(node) != TensorProto.FLOAT:
            continue
        up = producer.get(node.input[0])
        if (
            up is not None
            and up.op_type == "Cast"
            and cast_to(up) == TensorProto.FLOAT16
            and types.get(up.input[0]) == TensorProto.FLOAT
            and node.output[0] not in graph_outputs
        ):
            rename[node.output[0]] = up.input[0]
    if not rename:
        return 0
    for node in g.node:
        for k, i in enumerate(node.input):
            if i in rename:
                node.input[k] = rename[i]

    # Drop Casts whose outputs are no longer used (the bypassed pairs).
    while True:
        used = set(graph_outputs)
        for node in g.node:
            used.update(node_inputs(node))
        keep = [n for n in g.node if n.op_type != "Cast" or n.output[0] in used]
        if len(keep) == len(g.node):
            return len(rename)
        del g.node[:]
        g.node.extend(keep)


FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)
# Ops whose output type doesn't follow their input's float type: never need an
# outer-scope Cast (Identity does: an fp32 input would leak fp32 into fp16 code).
ANY_TYPE_OPS = ("Cast", "Shape", "Size")


def _fix_outer_scope_refs(top: onnx.GraphProto, op_block: set[str], node_block: set[str]) -> int:
    """Make subgraph references to outer-scope float tensors match the subgraph's precision.

    A subgraph converted with its node expects fp16; one of a kept-fp32 node (or
    a kept-fp32 node inside any subgraph) expects fp32.  The outer tensor may be
    of the other type: fp32 graph inputs (kept for drop-in I/O), fp32
    initializers of fp32 nodes, fp16 outputs of converted nodes.  Each mismatch
    gets one Cast in the scope that defines the tensor, and the reference is
    renamed.  Returns the number of Casts added.
    """
    casts: dict[tuple[int, str, int], str] = {}
    taken = names_in(top)

    def types_of(g):
        t = {v.name: v.type.tensor_type.elem_type for v in g.value_info}
        t.update({v.name: v.type.tensor_type.elem_type for v in g.output})
        t.update({v.name: v.type.tensor_type.elem_type for v in g.input})
        t.update({i.name: i.data_type for i in g.initializer})
        for n in g.node:
            if n.op_type == "Cast":
                t[n.output[0]] = next(a.i for a in n.attribute if a.name == "to")
            elif n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                t[n.output[0]] = n.attribute[0].t.data_type
        return t

    def defined_in(g):
        names = {v.name for v in g.input} | {i.name for i in g.initializer}
        names.update(o for n in g.node for o in n.output)
        return names

    def fix(name, want, scopes):
        for g, types, defined in reversed(scopes):
            if name in defined:
                break
        else:
            return name  # unknown name: leave it to the checker
        have = types.get(name)
        if have not in FLOATS or have == want:
            return name
        key = (id(g), name, want)
        if key not in casts:
            base = f"{name}_{'fp16' if want == TensorProto.FLOAT16 else 'fp32'}_outer"
            new, k = base, 1
            while new in taken:
                new, k = f"{base}_{k}", k + 1
            taken.add(new)
            g.node.append(helper.make_node("Cast", [name], [new], to=want, name=new))
            like = next((v for v in (*g.value_info, *g.input, *g.output) if v.name == name), None)
            if like is not None:
                v = g.value_info.add()
                v.CopyFrom(like)
                v.name = new
                v.type.tensor_type.elem_type = want
            types[new] = want
            defined.add(new)
            casts[key] = new
        return casts[key]

    def visit(g, scopes, converted):
        own = (g, types_of(g), defined_in(g))
        chain = [*scopes, own]
        local = own[2]
        for node in list(g.node):
            blocked = node.op_type in op_block or node.name in node_block
            if scopes and node.op_type not in ANY_TYPE_OPS:
                want = TensorProto.FLOAT16 if converted and not blocked else TensorProto.FLOAT
                for i, name in enumerate(node.input):
                    if name and name not in local:
                        node.input[i] = fix(name, want, scopes)
            for sub in subgraphs(node):
                visit(sub, chain, converted and not blocked)

    visit(top, [], True)
    return len(casts)


def _float_content(g: onnx.GraphProto, acc: dict | None = None) -> dict:
    """Float weight elements by type and the number of fp16 tensors/Casts, subgraphs included."""
    acc = {"fp16_weights": 0, "fp32_weights": 0, "fp16_tensors": 0} if acc is None else acc
    key = {TensorProto.FLOAT16: "fp16_weights", TensorProto.FLOAT: "fp32_weights"}

    def weight(t):
        if t.data_type in key:
            acc[key[t.data_type]] += int(np.prod(t.dims, dtype=np.int64))
            acc["fp16_tensors"] += t.data_type == TensorProto.FLOAT16

    for t in g.initializer:
        weight(t)
    for v in (*g.input, *g.output, *g.value_info):
        acc["fp16_tensors"] += v.type.tensor_type.elem_type == TensorProto.FLOAT16
    for n in g.node:
        for a in n.attribute:
            if a.HasField("t"):
                weight(a.t)
            for t in a.tensors:
                weight(t)
        if n.op_type == "Cast":
            acc["fp16_tensors"] += any(a.name == "to" and a.i == TensorProto.FLOAT16 for a in n.attribute)
        for sub in subgraphs(n):
            _float_content(sub, acc)
    return acc


def _unchanged_stats(m: onnx.ModelProto, content: dict, t0: float) -> dict:
    """Stats for a model returned as is (already mostly fp16)."""
    return {
        "fp16_nodes": len(m.graph.node),
        "fp32_nodes": 0,
        "kept_fp32_ops": {},
        "fp32_reasons": {},
        "constants_folded": 0,
        "casts_added": 0,
        "casts_retargeted": 0,
        "cast_round_trips_removed": 0,
        "outer_scope_casts": 0,
        "fp16_tensors_before": content["fp16_tensors"],
        "already_fp16": True,
        "seconds": round(time.perf_counter() - t0, 3),
    }


