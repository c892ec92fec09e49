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


