"""The one toolkit of graph edits the stages share (export sanitize, fp16 conversion, pre-quantized rewrites,
calibration): who makes and reads a value, fresh names, replacing and pruning nodes, renaming values, walking
subgraphs, topological order, and computing an fp16 model in fp32."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CONTROL_FLOW = ("If", "Loop", "Scan")


def links(g: onnx.GraphProto) -> tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    """{value: the node that makes it}, {value: the nodes that read it} (top level)."""
    producers = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    return producers, readers


def replace_node(g: onnx.GraphProto, node: onnx.NodeProto, nodes: list[onnx.NodeProto]) -> None:
    """Put `nodes` where `node` was (keeping the graph's order)."""
    at = list(g.node).index(node)
    g.node.remove(node)
    for i, n in enumerate(nodes):
        g.node.insert(at + i, n)


def keep_only(items, keep: Callable[[Any], bool]) -> int:
    """Filter a repeated protobuf field in place (one rebuild, not O(n^2) removes); returns how many went."""
    kept = [x for x in items if keep(x)]
    gone = len(items) - len(kept)
    if gone:
        copies = [type(x)() for x in kept]
        for c, x in zip(copies, kept):
            c.CopyFrom(x)
        del items[:]
        items.extend(copies)
    return gone


def unique_name(base: str, taken: Iterable[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first that `taken` does not hold."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


def name_allocator(g: onnx.GraphProto) -> Callable[[str], str]:
    """A function that returns a fresh name for `name` (unique_name) that no value, node or earlier answer of `g` has:
    models made by converters (ours included) already hold their usual names."""
    taken = names_in(g) | {n.name for n in g.node}

    def fresh(name: str) -> str:
        name = unique_name(name, taken)
        taken.add(name)
        return name

    return fresh


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


def names_in(g: onnx.GraphProto, skip: onnx.NodeProto | None = None) -> set[str]:
    """Every value name a graph and its subgraphs (but not `skip`'s) define or read."""
    names = {v.name for v in (*g.input, *g.output, *g.value_info)} | {t.name for t in g.initializer}
    for n in g.node:
        names.update(x for x in (*n.input, *n.output) if x)
        if n is not skip:
            for sub in subgraphs(n):
                names |= names_in(sub)
    return names


def rename_values(g: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename values in a graph and in what its subgraphs read from it (a subgraph's own same-named value shadows)."""
    for t in g.initializer:
        t.name = mapping.get(t.name, t.name)
    for vi in list(g.value_info) + list(g.output) + list(g.input):
        vi.name = mapping.get(vi.name, vi.name)
    for n in g.node:
        n.output[:] = [mapping.get(o, o) for o in n.output]
    redirect_reads(g.node, mapping)


def redirect_reads(nodes: Iterable[onnx.NodeProto], mapping: dict[str, str]) -> None:
    """``nodes`` read ``mapping[v]`` where they read ``v``: their inputs and what their control-flow bodies read from
    the outer scope (a body's own value of that name shadows it). A rewrite that makes a value under another name
    must redirect the bodies too: an If or Loop reads outer values without naming them as inputs."""
    if not mapping:
        return
    for n in nodes:
        n.input[:] = [mapping.get(i, i) for i in n.input]
        for sub in subgraphs(n):
            own = {o for x in sub.node for o in x.output} | {i.name for i in sub.input} | \
                {t.name for t in sub.initializer}
            inner = {k: v for k, v in mapping.items() if k not in own}
            if inner:
                rename_values(sub, inner)


def prune_unused(g: onnx.GraphProto, ops: Iterable[str] | None = None,
                 keep_initializer: Callable[[onnx.TensorProto], bool] | None = None) -> int:
    """Drop nodes none of whose outputs is used (by a node, a subgraph, or the graph outputs) -- only nodes of the op
    types `ops` when given -- then initializers nothing reads (unless `keep_initializer` says keep); returns how many
    nodes were dropped."""
    before = len(g.node)
    ops = set(ops) if ops is not None else None
    while True:
        used = {o.name for o in g.output} | {x for n in g.node for x in node_inputs(n)}
        if not keep_only(g.node, lambda n: (ops is not None and n.op_type not in ops)
                         or any(o in used for o in n.output if o)):
            break
    used = {o.name for o in g.output} | {x for n in g.node for x in node_inputs(n)}
    keep_only(g.initializer, lambda t: t.name in used or (keep_initializer is not None and keep_initializer(t)))
    return before - len(g.node)


def fp32_from_fp16(model: onnx.ModelProto) -> int:
    """Compute a model that works in fp16 in fp32 instead, keeping its interface: fp16 initializers and Constant values
    become fp32, Casts to fp16 cast to fp32, and an fp16 graph input or output gets a Cast at the border. For
    calibration: histograms of fp16 activations cannot hold 2048 distinct bins, and ranges are what the fp32 network
    computes (ModelOpt calibrates fp16 models in fp32 too). Returns the number of values changed; 0 leaves it as is."""
    H, F = TensorProto.FLOAT16, TensorProto.FLOAT
    changed = 0

    def upcast(t: onnx.TensorProto) -> onnx.TensorProto:
        return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)

    def visit(g: onnx.GraphProto) -> None:
        nonlocal changed
        for i, t in enumerate(g.initializer):
            if t.data_type == H:
                g.initializer[i].CopyFrom(upcast(t))
                changed += 1
        for n in g.node:
            for a in n.attribute:
                if n.op_type == "Cast" and a.name == "to" and a.i == H:
                    a.i, changed = F, changed + 1
                elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == H:
                    a.t.CopyFrom(upcast(a.t))
                    changed += 1
                for sub in (*a.graphs, *([a.g] if a.HasField("g") else [])):
                    visit(sub)
        for v in g.value_info:
            if v.type.tensor_type.elem_type == H:
                v.type.tensor_type.elem_type = F

    visit(model.graph)
    g = model.graph
    fresh = name_allocator(g)
    for inp in [i for i in g.input if i.type.tensor_type.elem_type == H]:  # fp16 in: cast up at the border
        inner = fresh(inp.name + "_fp32")
        for n in g.node:
            n.input[:] = [inner if x == inp.name else x for x in n.input]
        g.node.insert(0, helper.make_node("Cast", [inp.name], [inner], to=F, name=fresh(inner + "_cast")))
        changed += 1
    for out in [o for o in g.output if o.type.tensor_type.elem_type == H]:  # fp16 out: cast down at the border
        inner = fresh(out.name + "_fp32")
        for n in g.node:
            n.output[:] = [inner if x == out.name else x for x in n.output]
            n.input[:] = [inner if x == out.name else x for x in n.input]
        g.node.append(helper.make_node("Cast", [inner], [out.name], to=H, name=fresh(out.name + "_to_fp16")))
        changed += 1
    return changed
