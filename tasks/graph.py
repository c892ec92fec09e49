"""Small ONNX graph edits shared by the stages (export sanitize, fp16 conversion, calibration)."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper


def drop_initializer_inputs(model: onnx.ModelProto) -> int:
    """IR < 4 -> IR 4: initializers stop being graph inputs too; returns how many inputs were dropped.

    Before IR 4 every initializer had to be listed as a graph input (a default a caller could override). The fp16
    converter retypes initializers but not those input entries, which ONNX Runtime then refuses ("Tensor element
    type mismatch"); TensorRT and the later stages treat them as weights anyway. Models at IR >= 4 are left alone.
    """
    if model.ir_version >= 4:
        return 0
    g = model.graph
    inits = {t.name for t in g.initializer}
    keep = [i for i in g.input if i.name not in inits]
    dropped = len(g.input) - len(keep)
    del g.input[:]
    g.input.extend(keep)
    model.ir_version = max(4, helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))
    return dropped


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


def uniquify_node_names(g: onnx.GraphProto, seen: set[str] | None = None) -> None:
    # node_block_list matches by name and the converter derives Cast names
    # from node names, so every node needs a distinct, non-empty name
    # (subgraphs included: the converter processes them the same way).
    seen = set() if seen is None else seen
    for i, node in enumerate(g.node):
        name = node.name or f"{node.op_type}_{i}"
        base, k = name, 1
        while name in seen:
            name = f"{base}_{k}"
            k += 1
        node.name = name
        seen.add(name)
    for node in g.node:
        for sub in subgraphs(node):
            uniquify_node_names(sub, seen)


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Inputs of a node, including names its subgraphs (If/Loop bodies) read from the outer scope."""
    names = [i for i in node.input if i]
    for g in subgraphs(node):
        inner = {o for n in g.node for o in n.output} | {i.name for i in g.input} | {i.name for i in g.initializer}
        for n in g.node:
            names += [i for i in node_inputs(n) if i not in inner]
    return names


def toposort(g: onnx.GraphProto) -> bool:
    """Stable topological sort (iterative DFS), recursing into subgraphs; True when some order changed."""
    nodes = list(g.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [[producer[x] for x in node_inputs(n) if x in producer] for n in nodes]
    done = [False] * len(nodes)
    order = []
    for root in range(len(nodes)):
        if done[root]:
            continue
        done[root] = True
        stack = [(root, 0)]
        while stack:
            i, k = stack[-1]
            if k < len(deps[i]):
                stack[-1] = (i, k + 1)
                j = deps[i][k]
                if not done[j]:
                    done[j] = True
                    stack.append((j, 0))
            else:
                stack.pop()
                order.append(i)
    changed = order != list(range(len(nodes)))
    if changed:
        del g.node[:]
        g.node.extend(nodes[i] for i in order)
    for node in g.node:
        for sub in subgraphs(node):
            changed |= toposort(sub)
    return changed
