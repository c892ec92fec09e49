"""What type each value of an ONNX graph has (from the op schemas), which nodes mix input types where their schema
asks for one, and the Casts that unify them: shared by the fp16 converter and the build's type check."""
from __future__ import annotations

import collections

import onnx
from onnx import TensorProto, helper

from tasks.graph.edit import name_allocator

SHAPE_OPS = ("Shape", "Size")


def _schema(node: onnx.NodeProto, opsets: dict[str, int]):
    try:
        return onnx.defs.get_schema(node.op_type, opsets.get(node.domain or "", 1), node.domain or "")
    except Exception:  # noqa: BLE001 - an op ONNX does not define (contrib, custom): its types are its own business
        return None


def _input_groups(node: onnx.NodeProto, schema) -> dict[str, list[int]]:
    """{type constraint: the input positions it binds}: inputs of one group must have one type (a Conv's X, W and B;
    both operands of a Div). Variadic inputs count when homogeneous."""
    groups: dict[str, list[int]] = collections.defaultdict(list)
    formal = list(schema.inputs)
    for k, x in enumerate(node.input):
        if not x or not formal:
            continue
        f = formal[min(k, len(formal) - 1)]
        if k >= len(formal) and (f.option != onnx.defs.OpSchema.FormalParameterOption.Variadic or not f.is_homogeneous):
            continue
        if f.type_str.startswith("tensor(") or f.type_str.startswith("seq"):
            continue  # a fixed type (Resize's float scales): not tied to another input
        groups[f.type_str].append(k)
    return groups


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every top-level value, propagated through the graph with the ops' type constraints (a
    value_info entry only where an op's output type follows no input: ONNX's inference may have left values out)."""
    g = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    types = {v.name: v.type.tensor_type.elem_type for v in g.value_info if v.type.tensor_type.elem_type}
    types.update({v.name: v.type.tensor_type.elem_type for v in g.input})
    types.update({t.name: t.data_type for t in g.initializer})
    for node in g.node:
        _output_types(node, _schema(node, opsets), types)
    return types


def _output_types(node: onnx.NodeProto, schema, types: dict[str, int]) -> None:
    """Put the element types of ``node``'s outputs into ``types`` from its inputs' (its type constraints)."""
    if node.op_type == "Cast":
        types[node.output[0]] = next(a.i for a in node.attribute if a.name == "to")
        return
    if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
        types[node.output[0]] = node.attribute[0].t.data_type
        return
    if schema is None:
        return
    bound = {}
    for ts, ks in _input_groups(node, schema).items():
        have = [types.get(node.input[k]) for k in ks if types.get(node.input[k])]
        if have:
            bound[ts] = have[0]
    for k, o in enumerate(node.output):
        if not o or not schema.outputs:
            continue
        f = schema.outputs[min(k, len(schema.outputs) - 1)]
        if f.type_str in bound:
            types[o] = bound[f.type_str]
        elif f.type_str.startswith("tensor(") and f.type_str[7:-1] in TYPE_NAMES:
            types[o] = TYPE_NAMES[f.type_str[7:-1]]


TYPE_NAMES = {"float": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64,
              "int32": TensorProto.INT32, "bool": TensorProto.BOOL, "double": TensorProto.DOUBLE}


def mixed_input_types(model: onnx.ModelProto) -> list[tuple[str, str, str, str, str, str]]:
    """Top-level nodes whose float inputs of one type group have two types, which TensorRT refuses ("IConvolutionLayer
    `input` and `kernel` must be of same type"): (node, op, input a, its type, input b, its type)."""
    g = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    types = value_types(model)
    bad = []
    for node in g.node:
        schema = _schema(node, opsets)
        if schema is None:
            continue
        for ks in _input_groups(node, schema).values():
            floats = [(node.input[k], types[node.input[k]]) for k in ks if types.get(node.input[k]) in
                      (TensorProto.FLOAT, TensorProto.FLOAT16)]
            kinds = {t for _, t in floats}
            if len(kinds) > 1:
                (a, ta), (b, tb) = floats[0], next(f for f in floats if f[1] != floats[0][1])
                name = TensorProto.DataType.Name
                bad.append((node.name, node.op_type, a, name(ta).lower(), b, name(tb).lower()))
    return bad


def unify_input_types(model: onnx.ModelProto, fp32_nodes: set[str]) -> int:
    """Give each top-level node the float type it was meant to compute in on every float input that a type constraint
    ties to others (not a fixed-type input such as Resize's scales): fp32 for the nodes in ``fp32_nodes`` (kept in fp32),
    fp16 for the others, with a Cast before the node for each input of the other type (one per value and type).
    Returns the number of Casts added."""
    g = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    types = {v.name: v.type.tensor_type.elem_type for v in g.value_info if v.type.tensor_type.elem_type}
    types.update({v.name: v.type.tensor_type.elem_type for v in g.input})
    types.update({t.name: t.data_type for t in g.initializer})
    fresh = name_allocator(g)
    made: dict[tuple[str, int], str] = {}
    order: list[onnx.NodeProto] = []
    producer = {o: n for n in g.node for o in n.output if o}
    for node in g.node:
        schema = _schema(node, opsets)
        if schema is not None and node.op_type not in ("Cast", "CastLike", *SHAPE_OPS):
            want = TensorProto.FLOAT if node.name in fp32_nodes else TensorProto.FLOAT16
            for ks in _input_groups(node, schema).values():
                for k in ks:
                    x = node.input[k]
                    if types.get(x) not in (TensorProto.FLOAT, TensorProto.FLOAT16) or types[x] == want:
                        continue
                    up = producer.get(x)  # an fp16 value the converter cast to fp32: read it as it was (exact)
                    if want == TensorProto.FLOAT16 and up is not None and up.op_type == "Cast" and \
                            types.get(up.input[0]) == TensorProto.FLOAT16:
                        node.input[k] = up.input[0]
                        continue
                    if (x, want) not in made:
                        new = fresh(f"{x}_{'fp32' if want == TensorProto.FLOAT else 'fp16'}")
                        order.append(helper.make_node("Cast", [x], [new], to=want, name=fresh(f"{new}_cast")))
                        types[new] = want
                        made[(x, want)] = new
                    node.input[k] = made[(x, want)]
        _output_types(node, schema, types)  # after its inputs were settled
        order.append(node)
    if made:
        del g.node[:]
        g.node.extend(order)
    for v in g.value_info:  # what a rewired node now makes
        t = types.get(v.name)
        if t in (TensorProto.FLOAT, TensorProto.FLOAT16) and v.type.tensor_type.elem_type != t:
            v.type.tensor_type.elem_type = t
    return len(made)


# Ops whose output carries only metadata (shape) of their input, not its values.
