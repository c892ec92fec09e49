"""FP32 -> FP16 ONNX conversion for strongly typed TensorRT(-RTX) builds.

TensorRT-RTX takes precision from the graph's tensor types, so the graph itself
has to be fp16.  This wraps onnxconverter-common's converter and works around
the problems it has with real models (see ``fp16_from_onnx``): which nodes stay
fp32 and why is decided here, the graph passes that convert and repair are in
tasks/fp16/passes.py, the hazards found on the user's data in tasks/fp16/hazards.py.
"""

from __future__ import annotations

import collections
import time

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from tasks.fp16.passes import (bypass_cast_round_trips, bypass_weight_identities, convert_graph, drop_dangling_value_info, fix_outer_scope_refs,
                               keep_float_value_info, restore_fp32_outputs, retarget_float_casts,
                               split_shared_initializers)
from tasks.graph.types import SHAPE_OPS, unify_input_types
from tasks.graph.edit import node_inputs, subgraphs, toposort, uniquify_node_names
from tasks.graph.fold import fold_constants
from tasks.graph.load import drop_initializer_inputs, opset_of, with_opset

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
      * the Log/Div/Reciprocal/Sqrt/Pow reading such a node's output when that
        node adds or clamps by its tiny constant (``log(x + 1e-10)``): the guard
        is fp32, but its output cast back to fp16 is 0 again (``_guarded_by_tiny_constants``);
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
    m, g, qdq_opset, folded = _prepared_copy(model)

    op_block = set(float16.DEFAULT_OP_BLOCK_LIST) | set(EXTRA_FP32_OPS)
    reasons, figures = _fp32_reasons(g, op_block, keep_fp32, cancel_fp32, tiny_fp32, keep_nodes)
    split_shared_initializers(g, set(reasons))
    kept = collections.Counter(n.op_type for n in g.node if n.name in reasons)

    fp32_outputs = [o.name for o in g.output if o.type.tensor_type.elem_type == TensorProto.FLOAT]
    del g  # let the pre-inference copy go
    m = onnx.shape_inference.infer_shapes(m)
    g = m.graph
    keep_float_value_info(g)  # only float value_info matters to the converter
    n_before = len(g.node)

    counts = _convert_and_repair(m, op_block, reasons, fp32_outputs)
    return m, _conversion_stats(reasons, kept, figures, keep_nodes, counts, n_before=n_before, n_after=len(g.node),
                                folded=folded, content=content, qdq_opset=qdq_opset, t0=t0)


def _prepared_copy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.GraphProto, bool, int]:
    """A copy of ``model`` for the passes: initializers no longer listed as inputs, opset 19 for a Q/DQ model below
    it, nodes sorted, constants folded, node names unique. Returns the model (with_opset's when the opset was
    upgraded), the copy's graph (the one sorted, folded and named here), whether the opset was upgraded and the number
    of constants folded."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph

    drop_initializer_inputs(m)  # legacy IR < 4: initializers listed as inputs too (export does this already)
    qdq_opset = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in m.graph.node) and opset_of(m) < 19
    if qdq_opset:  # the float part of a quantized model in fp16: fp16 Q/DQ scales need opset 19
        m, _ = with_opset(m, 19)
    toposort(g)  # the passes below walk nodes in order (export sorts already)
    folded = fold_constants(g)
    bypass_weight_identities(g)  # a weight shared through Identities stays one initializer: one fp16 copy
    uniquify_node_names(g)
    return m, g, qdq_opset, folded


def _fp32_reasons(g: onnx.GraphProto, op_block: set[str], keep_fp32: dict[str, float], cancel_fp32: dict[str, float],
                  tiny_fp32: dict[str, float], keep_nodes: dict[str, float]) -> tuple[dict[str, str], dict]:
    """{node name: why it stays fp32} for the nodes of ``g`` kept fp32 (``_fp16_from_onnx``'s list; a node keeps the
    first reason that applies, in this order), and {"data_range" | "data_underflow" | "cancellation": {node: the
    largest figure of the values that decided it}}."""
    reasons: dict[str, str] = {}
    for node in g.node:
        if node.op_type in op_block:
            reasons[node.name] = "op"
    for name in _shape_only_nodes(g):
        reasons.setdefault(name, "shape_only")
    for name in _range_unsafe_consumers(g):
        reasons.setdefault(name, "initializer_range")
    # a node reading or making a value beyond fp16's range (AutoCast checks inputs and outputs)
    data_range = _mark_nodes_by_values(g, keep_fp32, reasons, "data_range", reading=True)
    # a node reading or making values that fp16 flushes (below its normal range, ~6.1e-5)
    underflow = _mark_nodes_by_values(g, tiny_fp32, reasons, "data_underflow", reading=True)
    for name in _guarded_by_tiny_constants(g, {n for n, r in reasons.items() if r == "initializer_range"}):
        reasons.setdefault(name, "tiny_guard")
    for node in g.node:  # what the accuracy search keeps (tasks.fp16.search), after the data's own reasons
        if node.name in keep_nodes:
            reasons.setdefault(node.name, "accuracy")
    # a node making a value a cancelling subtraction is computed from (or the subtraction)
    cancellation = _mark_nodes_by_values(g, cancel_fp32, reasons, "cancellation", reading=False)
    for name in _dequantize_feeding_fp32(g, set(reasons)):
        reasons.setdefault(name, "dq_of_fp32_layer")
    return reasons, {"data_range": data_range, "data_underflow": underflow, "cancellation": cancellation}


def _mark_nodes_by_values(g: onnx.GraphProto, values: dict[str, float], reasons: dict[str, str], reason: str,
                          reading: bool) -> dict[str, float]:
    """{node name: the largest figure in ``values`` of the values it makes (with ``reading``: reads or makes)}; each
    such node gets ``reason`` in ``reasons`` unless it has one already."""
    marked = {}
    for node in g.node:
        hits = [values[v] for v in ((*node.input, *node.output) if reading else node.output) if v in values]
        if hits:
            reasons.setdefault(node.name, reason)
            marked[node.name] = max(hits)
    return marked


def _convert_and_repair(m: onnx.ModelProto, op_block: set[str], reasons: dict[str, str],
                        fp32_outputs: list[str]) -> tuple[int, int, int, int]:
    """Convert ``m``'s graph in place (ops in ``op_block`` and the nodes in ``reasons`` stay fp32), then repair what the
    converter leaves wrong (tasks/fp16/passes.py). Returns the numbers of Casts retargeted, Cast round trips removed,
    outer-scope Casts and type Casts added."""
    g = m.graph
    convert_graph(g, op_block, set(reasons))
    retargeted = retarget_float_casts(g)
    restore_fp32_outputs(g, fp32_outputs)
    bypassed = bypass_cast_round_trips(g)
    outer_casts = fix_outer_scope_refs(g, op_block, set(reasons))
    if outer_casts:
        toposort(g)
    uniquify_node_names(g)
    # what the converter left mixed (a graph output its own fp32 Cast now feeds to converted readers, a value without
    # value_info): kept nodes take fp32 on every float input of a type group, converted nodes fp16
    type_casts = unify_input_types(m, {n.name for n in g.node if n.name in reasons or n.op_type in op_block})
    drop_dangling_value_info(g)
    return retargeted, bypassed, outer_casts, type_casts


def _conversion_stats(reasons: dict[str, str], kept: collections.Counter, figures: dict, keep_nodes: dict[str, float],
                      counts: tuple[int, int, int, int], *, n_before: int, n_after: int, folded: int, content: dict,
                      qdq_opset: bool, t0: float) -> dict:
    """The stats of a conversion (``_fp16_from_onnx``'s): node counts, why nodes stay fp32, the passes' counts (as
    ``_convert_and_repair`` returns them) and, per node, the figure that kept it fp32."""
    retargeted, bypassed, outer_casts, type_casts = counts

    def decided_by(reason: str) -> dict[str, float]:  # the nodes that reason kept fp32, with their figures
        return {n: v for n, v in figures[reason].items() if reasons.get(n) == reason}

    by_reason = collections.Counter(reasons.values())
    n_fp32 = sum(kept.values())
    return {
        "fp16_nodes": n_before - n_fp32,
        "fp32_nodes": n_fp32,
        "kept_fp32_ops": dict(kept.most_common()),
        "fp32_reasons": dict(by_reason),
        "constants_folded": folded,
        "casts_added": n_after - n_before,
        "casts_retargeted": retargeted,
        "cast_round_trips_removed": bypassed,
        "outer_scope_casts": outer_casts,
        "type_casts": type_casts,
        "fp16_tensors_before": content["fp16_tensors"],
        "already_fp16": False,
        "opset_upgraded_for_fp16_qdq": qdq_opset,
        "data_range": decided_by("data_range"),
        # node -> the share of a value it reads or makes lost below fp16's normal range (relative L2)
        "data_underflow": decided_by("data_underflow"),
        # node -> what it cost in fp16 (its error growth), kept fp32 by the accuracy search
        "accuracy": {n: keep_nodes[n] for n in keep_nodes if reasons.get(n) == "accuracy"},
        # node -> the estimated relative error fp16 would give the subtraction it feeds (it computes in fp32)
        "cancellation": decided_by("cancellation"),
        "seconds": round(time.perf_counter() - t0, 3),
    }


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


GUARD_OPS = ("Add", "Sum", "Max", "Clip")  # ops that keep a value off zero by a constant (x + eps, max(x, eps))
# ops that turn a value fp16 flushes to zero into -inf/inf/NaN (or a huge error): Log(0), 1/0, x/0, Pow(0, -k)
ZERO_SENSITIVE = {"Log": (0,), "Reciprocal": (0,), "Div": (1,), "Pow": (0,), "Sqrt": (0,)}
THROUGH = ("Sqrt", "Pow", "Cast", "Identity", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand")  # on to a Div


def _guarded_by_tiny_constants(g: onnx.GraphProto, range_kept: set[str]) -> list[str]:
    """Names of the nodes that read, as a zero-sensitive input (``ZERO_SENSITIVE``), the output of a guard
    (``GUARD_OPS``) kept fp32 for its constant that fp16 cannot hold (``range_kept``), directly or through
    ``THROUGH`` ops (``Div(x, Sqrt(v + eps))``). The guard computes in fp32, but the converter casts its output back
    to fp16 for fp16 readers, and what the eps kept off zero (power spectra of silence, a variance of a constant row)
    is 0 again: Basic Pitch's ``Log(x^2 + 1e-10)`` gave -inf on quiet audio and every output NaN."""
    readers = collections.defaultdict(list)
    for node in g.node:
        for k, i in enumerate(node.input):
            if i:
                readers[i].append((node, k))
    out: list[str] = []
    seen: set[str] = set()
    frontier = [o for n in g.node if n.name in range_kept and n.op_type in GUARD_OPS for o in n.output if o]
    for _ in range(4):  # a few ops deep: Sqrt then Div, a Reshape on the way
        nxt = []
        for v in frontier:
            for node, k in readers.get(v, ()):
                if node.name in seen:
                    continue
                if k in ZERO_SENSITIVE.get(node.op_type, ()):
                    seen.add(node.name)
                    out.append(node.name)
                if node.op_type in THROUGH and k == 0:
                    nxt.extend(o for o in node.output if o)
        frontier = nxt
    return out


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


