"""The graph passes around onnxconverter-common's fp16 converter (tasks/fp16/convert.py runs them): its conversion in
linear time, and the repairs of what it leaves wrong in real models (shared initializers, float Casts, fp32 graph
outputs, Cast round trips, subgraph references to outer-scope tensors)."""

from __future__ import annotations

import collections

import onnx
from onnx import TensorProto, helper

from tasks.graph.edit import name_allocator, names_in, node_inputs, rename_values, subgraphs, toposort

FP16_MAX = 65504.0


def convert_graph(graph: onnx.GraphProto, op_block: set[str], node_block: set[str]) -> None:
    """float16.convert_float_to_float16(keep_io_types=True, disable_shape_infer=True,
    max_finite_val=FP16_MAX), in place, minus its quadratic parts.

    Its topological sort and block-list cast insertion scan the whole graph per
    node (>1 min at 10k nodes); both are replaced by linear versions here.
    Outer-scope references from subgraphs are fixed up later (fix_outer_scope_refs).
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
            # removed later (fp32 consumer); fix_outer_scope_refs does it right.
            top = False
        level = next_level
    toposort(graph)
    # Not f.remove_unnecessary_cast_node: it ignores subgraph references (drops
    # Casts whose outputs If branches read) and runs before retarget_float_casts
    # (bypasses a Cast(to=FLOAT) still meant to output fp16); bypass_cast_round_trips
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


def bypass_weight_identities(g: onnx.GraphProto) -> int:
    """Readers of an Identity of a float initializer read the initializer itself; the Identity goes (unless its output
    is a graph output). torch.onnx shares a weight between layers that reuse a module through such Identities: computed
    from constants alone they counted as shape arithmetic and stayed fp32, so the weight stayed fp32 and each layer got
    a Cast of it to fp16, which TensorRT folds into one fp16 copy per layer (a graph transformer with one weight-shared
    layer applied 6 times: fp16 engine 4.47 MB beside the fp32 engine's 4.51 MB). Returns the number removed."""
    floats = {t.name for t in g.initializer if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)}
    outputs = {o.name for o in g.output}
    mapping: dict[str, str] = {}
    drop = []
    for node in g.node:  # topological order: an Identity of an Identity maps to the first one's initializer
        src = mapping.get(node.input[0], node.input[0]) if node.op_type == "Identity" and node.input else None
        if src in floats and node.output[0] not in outputs:
            mapping[node.output[0]] = src
            drop.append(node)
    if not drop:
        return 0
    for node in drop:
        g.node.remove(node)
    keep_vi = [v for v in g.value_info if v.name not in mapping]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    rename_values(g, mapping)
    return len(drop)


def split_shared_initializers(g: onnx.GraphProto, blocked: set[str]) -> None:
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


def keep_float_value_info(g: onnx.GraphProto) -> None:
    """Keep float value_info, minus entries for graph inputs/outputs and initializers.

    Shape inference (sanitize's data_prop pass) can list a graph output in
    value_info too; the converter then flips that copy to fp16 and
    retarget_float_casts turns the fp32 output Cast into an fp16 one.
    """
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16)
    # initializers too: a value_info entry for one (left by the version converter's shape inference) is flipped to
    # fp16 by the converter, which then casts a blocked node's fp32 initializer through fp16 (BN variances -> inf)
    io = {v.name for v in (*g.input, *g.output)} | {t.name for t in g.initializer}
    vi = [v for v in g.value_info if v.type.tensor_type.elem_type in floats and v.name not in io]
    del g.value_info[:]
    g.value_info.extend(vi)


def retarget_float_casts(g: onnx.GraphProto) -> int:
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
            n += retarget_float_casts(sub)
    return n


def restore_fp32_outputs(g: onnx.GraphProto, names: list[str]) -> None:
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


def drop_dangling_value_info(g: onnx.GraphProto) -> None:
    produced = {o for n in g.node for o in n.output}
    vi = [v for v in g.value_info if v.name in produced]
    del g.value_info[:]
    g.value_info.extend(vi)


def bypass_cast_round_trips(g: onnx.GraphProto) -> int:
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


def fix_outer_scope_refs(top: onnx.GraphProto, op_block: set[str], node_block: set[str]) -> int:
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
