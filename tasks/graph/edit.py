"""ONNX graphs: loading and checking, and the one toolkit of graph edits the stages share (export sanitize, fp16
conversion, pre-quantized rewrites, calibration): who makes and reads a value, fresh names, replacing and pruning
nodes, constant folding, topological order, binding inputs and folding what that decides."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.common.deps import note
from tasks.common.errors import ConfigError, cause
from tasks.graph.models import ONNX_DTYPES, value_dims


def load_onnx(path: Path, key: str = "model.source", load_external_data: bool = True) -> onnx.ModelProto:
    """Load and check an ONNX file; a corrupt or unreadable file is a ConfigError naming it. Nodes out of topological
    order (ONNX Runtime and TensorRT accept them; the stages need the order) are sorted."""
    try:
        model = onnx.load(str(path), load_external_data=False)
        side = external_data_files(model, Path(path).parent)
        note(*side)  # onnx reads them in C++: the audit hook cannot see it
        if side and load_external_data:
            from onnx.external_data_helper import load_external_data_for_model

            load_external_data_for_model(model, str(Path(path).parent))
    except Exception as e:  # protobuf DecodeError, missing external data, ...
        raise ConfigError(f"{key}: {path} is not a readable ONNX model ({type(e).__name__}: {cause(e)})",
                          file=str(path), fix="re-export the model, or point the key at the right file") from None
    if not model.graph.node:
        raise ConfigError(f"{key}: {path} has an empty graph", file=str(path), fix="re-export the model")
    for first in (True, False):
        try:
            onnx.checker.check_model(model, full_check=False)
            return model
        except Exception as e:
            if first and "topologically sorted" in str(e) and toposort(model.graph):
                continue
            raise ConfigError(f"{key}: {path} fails the ONNX checker: {cause(e)}", file=str(path),
                              fix="re-export the model with a supported opset") from None
    return model


def external_data_files(model: onnx.ModelProto, base: Path) -> list[Path]:
    """The side files an ONNX model keeps weights in (external data), resolved against its folder."""
    out = set()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc:
                out.add(base / loc)
    return sorted(out)


def opset_of(model: onnx.ModelProto) -> int:
    """The model's opset of the default ONNX domain (0 when it imports none)."""
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


# --- the edit toolkit -----------------------------------------------------------------------------------------------

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


def drop_initializer_inputs(model: onnx.ModelProto) -> int:
    """Initializers that are also listed as graph inputs become weights only; returns how many inputs were dropped.
    IR < 4 models move to IR 4 (before IR 4 every initializer had to be listed as an input).

    Such an input is a default a caller could override (older exporters list every weight so, at any IR); TensorRT
    and the later stages treat them as weights anyway, and the fp16 converter retypes the initializer but not its
    input entry, which ONNX Runtime then refuses ("initializer ... has element type float16 but usage of initializer in
    graph expects float")."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    keep = [i for i in g.input if i.name not in inits]
    dropped = len(g.input) - len(keep)
    if dropped:
        del g.input[:]
        g.input.extend(keep)
    if model.ir_version < 4:
        model.ir_version = max(4, helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))
    return dropped


@functools.lru_cache(maxsize=1)
def runtime_max_ir() -> int:
    """The newest ONNX IR version the installed ONNX Runtime loads (probed once with an Identity model)."""
    import onnxruntime as ort

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    so = ort.SessionOptions()
    so.log_severity_level = 4
    for ir in range(onnx.IR_VERSION, 3, -1):
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        m.ir_version = ir
        try:
            ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            return ir
        except Exception:  # noqa: BLE001 - too new for this runtime: try the next older IR
            continue
    return 3


def lower_ir(model: onnx.ModelProto) -> str | None:
    """A model written with a newer IR than ONNX Runtime loads (onnx 1.23's make_model writes IR 14; ONNX Runtime 1.31
    loads <= 13) gets the newest IR the runtime loads, when its opsets allow it (onnx.helper.VERSION_TABLE): the same
    graph. Returns the note, or None when nothing changed; a ConfigError when the opsets need the newer IR."""
    top = runtime_max_ir()
    if model.ir_version <= top:
        return None
    need = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    if need > top:
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
        raise ConfigError(f"the model needs ONNX IR {need} for its opsets ({opsets}), newer than the IR {top} the "
                          "installed ONNX Runtime loads", fix="export the model at an older opset, or upgrade onnxruntime")
    old, model.ir_version = model.ir_version, top
    return f"IR {old} -> {top}: the newest the installed ONNX Runtime loads (its opsets need IR {need})"


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


# --- binding inputs to constants and folding what that decides (model.constants) --------------------------------

CONTROL_FLOW = ("If", "Loop", "Scan")
# ops whose output is not a function of their inputs' values: never evaluated at export
NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
                    "Dropout"}
FOLD_MAX_ELEMENTS = 1 << 16  # a folded value is shape/index arithmetic or a small table, never a big activation


def array_from_constant(name: str, value: Any, dtype: str, shape: list) -> np.ndarray:
    """A `model.constants.<name>` value (scalar or nested list) as an array of the input's own dtype and shape;
    a ConfigError naming the key when its rank, static dims or type do not fit the input."""
    key = f"model.constants.{name}"
    try:
        arr = np.asarray(value)
    except Exception:
        arr = np.asarray(None, dtype=object)
    want = f"rank {len(shape)} {list(shape)}, {dtype}"
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise ConfigError(f"{key}: input {name!r} has type {dtype}, which model.constants cannot bind",
                          fix=f"remove {key}") from None
    if arr.dtype.kind not in "biuf":
        raise ConfigError(f"{key}={value!r} is not a number or a list of numbers (input {name!r} is {want})",
                          fix=f"give {key} a value of input {name!r}'s shape, e.g. {key}={_example(dtype, shape)}")
    if arr.ndim != len(shape) or any(isinstance(d, int) and d != n for d, n in zip(shape, arr.shape)):
        raise ConfigError(f"{key}={value!r} has shape {list(arr.shape)} but input {name!r} is {want}",
                          fix=f"give {key} a value of that shape, e.g. {key}={_example(dtype, shape)}")
    if np_dtype.kind in "iub" and arr.dtype.kind == "f" and not np.all(arr == np.round(arr)):
        raise ConfigError(f"{key}={value!r} is not integral but input {name!r} is {dtype}",
                          fix=f"give {key} whole numbers, e.g. {key}={_example(dtype, shape)}")
    if np_dtype.kind == "b" and not np.isin(arr, (0, 1)).all():
        raise ConfigError(f"{key}={value!r} is not boolean but input {name!r} is bool", fix=f"use true/false for {key}")
    if np_dtype.kind in "iu" and not np.all((arr >= np.iinfo(np_dtype).min) & (arr <= np.iinfo(np_dtype).max)):
        raise ConfigError(f"{key}={value!r} does not fit input {name!r}'s type {dtype}", fix=f"give {key} a value in range")
    return arr.astype(np_dtype)


def _example(dtype: str, shape: list) -> str:
    one = "1" if np.dtype(dtype).kind in "iub" else "1.0"
    if np.prod([d if isinstance(d, int) else 1 for d in shape]) > 8:
        return f"<a nested list of shape {list(shape)}>"
    for d in reversed(shape):
        one = "[" + ", ".join([one] * (d if isinstance(d, int) else 1)) + "]"
    return one


def bind_inputs(model: onnx.ModelProto, constants: dict[str, Any]) -> list[str]:
    """Each graph input named in `constants` becomes an initializer of the input's own dtype and shape (its name
    kept, so every reader, subgraphs included, reads the value); returns notes."""
    g = model.graph
    notes = []
    keep = []
    for inp in g.input:
        if inp.name not in constants:
            keep.append(inp)
            continue
        dtype = ONNX_DTYPES.get(inp.type.tensor_type.elem_type, str(inp.type.tensor_type.elem_type))
        arr = array_from_constant(inp.name, constants[inp.name], dtype, value_dims(inp))
        g.initializer.append(numpy_helper.from_array(arr, inp.name))
        notes.append(f"input {inp.name!r} bound to {constants[inp.name]!r} (model.constants)")
    del g.input[:]
    g.input.extend(keep)
    found = {t.name for t in g.initializer}
    notes += [f"WARNING: model.constants.{n} names no input of the exported model" for n in constants if n not in found]
    return notes


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
        n.input[:] = [mapping.get(i, i) for i in n.input]
        n.output[:] = [mapping.get(o, o) for o in n.output]
        for sub in subgraphs(n):
            own = {o for x in sub.node for o in x.output} | {i.name for i in sub.input} | {t.name for t in sub.initializer}
            inner = {k: v for k, v in mapping.items() if k not in own}
            if inner:
                rename_values(sub, inner)


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


def specialise(model: onnx.ModelProto, constants: dict[str, Any], profiles: list[dict]) -> list[str]:
    """model.constants: bind those inputs, then fold what they decide (If nodes on them, and the Ifs that open up
    inside the inlined branches, e.g. on shapes that are static now) and drop what no output needs. Returns notes."""
    notes = bind_inputs(model, constants)
    notes += pin_fixed_dims(model, profiles)
    n_nodes = len(model.graph.node)
    for _ in range(100):  # each round inlines at least one If; nested Ifs surface one level per round
        fold_constant_nodes(model)
        done = fold_ifs(model)
        notes += [n for n in done if n not in notes]
        if not any(not n.startswith("WARNING") for n in done):
            break
    fold_constants(model.graph)
    dropped = prune_unused(model.graph)
    toposort(model.graph)
    left = sorted({n.op_type for n in model.graph.node if n.op_type in CONTROL_FLOW})
    notes.append(f"{n_nodes} -> {len(model.graph.node)} top-level nodes ({dropped} unused dropped)"
                 + (f"; still control flow: {', '.join(left)}" if left else "; no control flow left"))
    return notes


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


def with_opset(model: onnx.ModelProto, opset: int) -> tuple[onnx.ModelProto, str]:
    """``model`` at default-domain ``opset`` (newer): onnx's version converter, or, where it cannot convert an op,
    the opset relabelled (the ops used mean the same in both). Returns the model and how it was done."""
    try:
        from onnx import version_converter

        return version_converter.convert_version(model, opset), "version_converter"
    except Exception as e:  # noqa: BLE001 - fall back to relabelling the default domain
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = opset
        return model, f"relabelled ({type(e).__name__}: {str(e)[:120]})"
