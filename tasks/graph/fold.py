"""Constant folding: Constant nodes into initializers, nodes computable from constants and static shapes (profiles
pin the dims they all fix), and If nodes whose condition is known (their taken branch inlined)."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.graph.edit import names_in, prune_unused, rename_values, subgraphs

# ops whose output is not a function of their inputs' values: never evaluated at export
NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
                    "Dropout"}
FOLD_MAX_ELEMENTS = 1 << 16  # a folded value is shape/index arithmetic or a small table, never a big activation


def fold_constants(g: onnx.GraphProto) -> int:
    """Move top-level Constant nodes into initializers.

    The converter clamps Constant node attributes blindly; as initializers they
    get range-checked and stay fp32 when consumed by a blocked node.
    """
    keep, n = [], 0
    for node in g.node:
        t = constant_tensor(node) if node.op_type == "Constant" else None
        if t is None:
            keep.append(node)
            continue
        t.name = node.output[0]
        g.initializer.append(t)
        n += 1
    if n:
        del g.node[:]
        g.node.extend(keep)
    return n


def constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    a = node.attribute[0] if len(node.attribute) == 1 else None
    if a is None:
        return None
    if a.name == "value":
        t = TensorProto()
        t.CopyFrom(a.t)
        return t
    simple = {
        "value_float": (TensorProto.FLOAT, [], [a.f]),
        "value_floats": (TensorProto.FLOAT, [len(a.floats)], list(a.floats)),
        "value_int": (TensorProto.INT64, [], [a.i]),
        "value_ints": (TensorProto.INT64, [len(a.ints)], list(a.ints)),
    }
    if a.name in simple:
        dtype, dims, vals = simple[a.name]
        return helper.make_tensor("", dtype, dims, vals)
    return None  # sparse / string constants: leave as nodes


def pin_fixed_dims(model: onnx.ModelProto, profiles: list[dict]) -> list[str]:
    """Input dims that every profile fixes to one value become static (the engine accepts no other), so the folds
    below can read shapes that depend on them; returns notes."""
    notes = []
    for inp in model.graph.input:
        if not profiles or any(inp.name not in p for p in profiles):
            continue
        dims = inp.type.tensor_type.shape.dim
        for i, d in enumerate(dims):
            values = {v for p in profiles for w in ("min", "opt", "max") for v in [p[inp.name][w][i]]}
            if len(values) == 1 and not d.HasField("dim_value"):
                old = d.dim_param or "?"
                d.dim_value = values.pop()
                notes.append(f"input {inp.name!r} dim {i} ({old}) fixed to {d.dim_value} by every profile")
    return notes


def static_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Shapes of the top-level values ONNX shape inference can tell (None for an unknown dim)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    try:
        m = onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:
        pass
    out = {}
    for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    for t in m.graph.initializer:
        out[t.name] = list(t.dims)
    return out


def _evaluate(node: onnx.NodeProto, values: dict[str, np.ndarray], opsets) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    ins = [i for i in node.input if i]
    try:
        graph = helper.make_graph([node], "fold", [helper.make_tensor_value_info(i, TensorProto.UNDEFINED, None)
                                                  for i in dict.fromkeys(ins)], [helper.make_value_info(o, onnx.TypeProto())
                                                                                 for o in node.output if o])
        ref = ReferenceEvaluator(helper.make_model(graph, opset_imports=opsets))
        return ref.run(None, {i: values[i] for i in ins})
    except Exception:
        return None


def _shape_value(node: onnx.NodeProto, shape: list[int]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(shape)), dtype=np.int64)
    a = {x.name: x.i for x in node.attribute}
    end = a.get("end")
    return np.array(shape[a.get("start", 0):len(shape) if end is None else end], dtype=np.int64)


def fold_constant_nodes(model: onnx.ModelProto, max_elements: int = FOLD_MAX_ELEMENTS, keep_ops: Iterable[str] = ()) -> int:
    """Top-level nodes computable now become initializers: every input a constant, a Shape/Size of a value whose
    shape is static, or a Gather of static dims from a Shape. Results larger than `max_elements` and nodes of
    `keep_ops` stay nodes. Returns how many nodes were folded."""
    keep_ops = set(keep_ops)
    g = model.graph
    folded = fold_constants(g)
    values = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    shapes = static_shapes(model)
    opsets = list(model.opset_import)
    keep, partial = [], {}  # partial: Shape outputs with unknown dims as -1
    for node in g.node:
        out = None
        if node.domain in ("", "ai.onnx") and node.op_type not in NONDETERMINISTIC and node.op_type not in keep_ops \
                and not subgraphs(node) and node.output:
            shape = shapes.get(node.input[0]) if node.input and node.input[0] not in values else None
            if node.op_type in ("Shape", "Size") and shape is not None and None not in shape:
                out = [_shape_value(node, shape)]
            elif node.op_type == "Shape" and shape is not None:
                partial[node.output[0]] = _shape_value(node, [-1 if d is None else d for d in shape])
            elif node.op_type == "Gather" and node.input[0] in partial and node.input[1] in values:
                picked = np.take(partial[node.input[0]], values[node.input[1]].astype(np.int64))  # the static dims read
                out = [picked] if (picked >= 0).all() else None
            elif node.input and all(i in values and values[i].size <= max_elements for i in node.input if i):
                out = _evaluate(node, values, opsets)
        if out is None or len(out) != len([o for o in node.output if o]) or any(
                np.asarray(a).size > max_elements for a in out):
            keep.append(node)
            continue
        for name, a in zip([o for o in node.output if o], out):
            values[name] = np.asarray(a)
            g.initializer.append(numpy_helper.from_array(np.asarray(a), name))
        folded += 1
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(keep)
    return folded


def unknown_conv_shapes(model: onnx.ModelProto) -> list[str]:
    """Convolutions whose filter shape or input channel count the graph does not tell (from its inferred value_info):
    TensorRT needs both at build time ("the channel dimension of a dynamic filter must have static length")."""
    shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in (*model.graph.input, *model.graph.value_info, *model.graph.output)
              if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
    unknown = []
    for n in model.graph.node:
        if n.op_type in ("Conv", "ConvTranspose") and len(n.input) > 1:
            w, x = shapes.get(n.input[1]), shapes.get(n.input[0])
            if w is None or None in w or x is None or len(x) < 2 or x[1] is None:
                unknown.append(n.name or n.output[0])
    return unknown


FOLD_FILTER_ELEMENTS = 1 << 24  # a filter computed from constants and shapes is folded up to this size


def fold_for_profiles(model: onnx.ModelProto, profiles: list[dict]) -> list[str]:
    """Where a convolution's filter shape or input channels are computed from shapes (TF converters' Reshape/Transpose
    around 1-D convolutions, filters reshaped at run time), fold constants and shapes for the profiles, as Polygraphy's
    ``surgeon sanitize --fold-constants`` does: dims every profile fixes become static, then every node computable
    from constants and static shapes becomes an initializer (Q/DQ stays as it is). Kept only when it tells TensorRT
    more convolutions' shapes; a graph whose convolutions are all known is left alone. Returns notes."""
    before = unknown_conv_shapes(model)
    if not before:
        return []
    trial = onnx.ModelProto()
    trial.CopyFrom(model)
    notes = pin_fixed_dims(trial, profiles)
    folded = fold_constant_nodes(trial, max_elements=FOLD_FILTER_ELEMENTS, keep_ops=("QuantizeLinear", "DequantizeLinear"))
    prune_unused(trial.graph)
    del trial.graph.value_info[:]
    try:
        trial = onnx.shape_inference.infer_shapes(trial, data_prop=True)
    except Exception:  # noqa: BLE001 - then the fold told nothing new
        return []
    after = unknown_conv_shapes(trial)
    if len(after) >= len(before):
        return []
    model.CopyFrom(trial)
    return notes + [f"{folded} nodes folded for the profiles (constants and shapes): the filter shape and input channels "
                    f"of {len(before) - len(after)} of {len(before)} convolutions are known now, as TensorRT needs them"]


def inline_if(g: onnx.GraphProto, index: int, taken: bool) -> str | None:
    """Replace the If node at `index` by the nodes and initializers of its taken branch, the branch outputs renamed to
    (or wired by Identity to) the If's outputs. A branch value whose name is already used elsewhere is renamed first.
    Returns a reason when the node cannot be inlined."""
    node = g.node[index]
    branch = next((a.g for a in node.attribute if a.name == ("then_branch" if taken else "else_branch")), None)
    if branch is None or len(branch.output) != len(node.output):
        return "its branch is missing or has another number of outputs"
    body = onnx.GraphProto()
    body.CopyFrom(branch)
    defined = {o for n in body.node for o in n.output if o} | {t.name for t in body.initializer}
    taken_names = names_in(g, skip=node)
    clash = {n for n in defined if n in taken_names}
    if clash:
        mapping = {}
        for n in sorted(clash):
            new, k = f"{n}__inlined", 1
            while new in taken_names or new in defined or new in mapping.values():
                new, k = f"{n}__inlined{k}", k + 1
            mapping[n] = new
        rename_values(body, mapping)
    # a branch output made by a branch node takes the If output's name; others (outer values, initializers, an output
    # given twice) are wired by Identity
    made = {o for n in body.node for o in n.output if o}
    outs = [b.name for b in body.output]
    rename_values(body, {b: o for b, o in zip(outs, node.output) if o and b in made and outs.count(b) == 1})
    wires = [helper.make_node("Identity", [b.name], [o], name=f"{node.name or 'If'}_out{i}")
             for i, (b, o) in enumerate(zip(body.output, node.output)) if o and b.name != o]
    g.initializer.extend(body.initializer)
    nodes = list(g.node)
    nodes[index:index + 1] = list(body.node) + wires
    del g.node[:]
    g.node.extend(nodes)
    g.value_info.extend(v for v in body.value_info if v.name not in taken_names)
    return None


def fold_ifs(model: onnx.ModelProto) -> list[str]:
    """Inline every top-level If whose condition is an initializer (after fold_constant_nodes); returns notes."""
    g = model.graph
    notes = []
    values = {t.name: t for t in g.initializer}
    i = 0
    while i < len(g.node):
        node = g.node[i]
        if node.op_type == "If" and node.domain in ("", "ai.onnx") and node.input[0] in values and \
                numpy_helper.to_array(values[node.input[0]]).size == 1:
            cond = bool(numpy_helper.to_array(values[node.input[0]]).reshape(-1)[0])
            name = node.name or f"(output {node.output[0]!r})"
            n_branch = sum(len(a.g.node) for a in node.attribute if a.name == ("then_branch" if cond else "else_branch"))
            why = inline_if(g, i, cond)
            if why:
                notes.append(f"WARNING: If {name} not folded: {why}")
                i += 1
                continue
            notes.append(f"If {name}: condition is {cond}, its {'then' if cond else 'else'} branch ({n_branch} nodes) inlined")
            values = {t.name: t for t in g.initializer}
            continue  # the inlined nodes start at i
        i += 1
    return notes
