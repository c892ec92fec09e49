"""What a model input means, where its graph shows it: the domain random inputs are drawn from.

Generic graph rules (no model names), followed from the input through ops that only move or retype values:

* **ids**: an input that indexes a Gather whose table is a weight (an embedding) is a row id in ``[0, rows)``;
  with several tables, the smallest bounds it (a token-type table of 2 rows beside a vocabulary of 30522).
* **mask**: an input that decides a Where (masked fill) or is scaled by a large negative constant before it is added
  (``(1 - mask) * -1e9``) marks valid and padded positions; which value keeps an element is read from the graph (the
  Where branch that is a constant fill, a ``Not``/``1 - x``/``x == 0`` on the way).
* **length**: an integer input that bounds a Range, is compared with one (``arange(T) < lengths``) or is an RNN's
  ``sequence_lens`` counts valid positions.
* **positive**: a float input taken by Log, Sqrt, Reciprocal, a fractional Pow or as a divisor (a diffusion model's
  noise level sigma) must be positive.
* **size**: a float input whose value, through arithmetic (Div, Mul, Round, Clip, CumSum, ...), sets a size: a
  Range's bounds, a ConstantOfShape/Expand/Tile/Pad/OneHot size, a Resize's scales or sizes, a Loop's trip count (a TTS
  model's speed divides the durations that set the audio's length). Drawn near 1 (log-uniform in [1/SIZE_SPAN,
  SIZE_SPAN]), so the shapes stay within SIZE_SPAN of the model's own: a random value near 0 would make the output
  (and the memory a build needs to run it) without bound.

Random values elsewhere (standard normal floats, 0/1 integers) are left as they are."""
from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

# ops that carry an input's values on unchanged in meaning (output 0)
CARRY = ("Cast", "CastLike", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand", "Transpose",
         "Slice", "Tile", "Gather")
DEPTH = 8  # ops followed from an input
SIZE_DEPTH = 16  # ops followed from a float input to a size it sets
SIZE_SPAN = 1.5  # a size-setting input is drawn in [1/SIZE_SPAN, SIZE_SPAN]
# ops whose output values follow their input's (arithmetic, reductions, moves), by the inputs that carry the value
VALUE_OPS = {**{op: None for op in ("Cast", "CastLike", "Identity", "Unsqueeze", "Squeeze", "Flatten", "Transpose",
                                    "Concat", "Add", "Sub", "Mul", "Div", "Round", "Ceil", "Floor", "Max", "Min", "Relu",
                                    "Neg", "Abs", "Exp", "Reciprocal", "Sqrt", "Pow", "Sum", "Mean")},
             **{op: (0,) for op in ("Reshape", "Slice", "Gather", "Clip", "CumSum", "Expand", "Tile", "ReduceSum",
                                    "ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd")},
             "Where": (1, 2)}
# the inputs of an op that set the size of its output
SIZE_INPUTS = {"Range": (0, 1, 2), "ConstantOfShape": (0,), "Expand": (1,), "Tile": (1,), "Resize": (2, 3),
               "Upsample": (1,), "Loop": (0,), "Pad": (1,), "OneHot": (1,)}
FILL_MAX = -1e3  # a constant at or below this that an input selects or scales is a masked fill (-1e4, -1e9, -inf)
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
INTEGER_TYPES = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
                 onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}


@dataclass(frozen=True)
class Domain:
    """Where an input's random values come from. ``kind``: ids | mask | length | positive; ``why``: what in the graph
    shows it (for the data notes)."""

    kind: str  # ids | mask | length | positive | size
    why: str
    high: int | None = None  # ids: the rows of the smallest table (exclusive bound); else ``of`` bounds them
    valid: int = 1  # mask: the value that keeps a position (1/True, or 0/False where True pads)
    of: tuple | None = None  # length, ids: (input, axis) whose size bounds the values, when the graph shows it
    segments: bool = False  # ids that a Scatter sums by (a node's graph): sorted, every id present where room allows

    def describe(self, name: str) -> str:
        if self.kind == "ids":
            what = f"ids in [0, {self.high})" if self.high is not None else \
                f"ids in [0, size of {self.of[0]!r} axis {self.of[1]})"
        elif self.kind == "length":
            what = "valid lengths (from half to the full length" + (
                f" of {self.of[0]!r} axis {self.of[1]})" if self.of else ")")
        elif self.kind == "positive":
            what = "positive values (log-normal)"
        elif self.kind == "size":
            what = f"values near 1 (log-uniform in [{1 / SIZE_SPAN:.2f}, {SIZE_SPAN:g}]: shapes bounded)"
        else:
            what = f"masks valid ({bool(self.valid)}) from the start, padded at the end, never all padded"
        return f"{name}: {what}, as {self.why}"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "why": self.why, **({"high": self.high} if self.high is not None else {}),
                **({"segments": True} if self.segments else {}),
                **({"valid": self.valid} if self.kind == "mask" else {}), **({"of": list(self.of)} if self.of else {})}


def input_domains(model: onnx.ModelProto, names: list[str]) -> dict[str, Domain]:
    """{input: Domain} for the inputs ``names`` of ``model`` whose graph shows what they mean (see the module doc)."""
    g = model.graph
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = collections.defaultdict(list)
    producer = {o: n for n in g.node for o in n.output}
    for n in g.node:
        for k, x in enumerate(n.input):
            if x:
                readers[x].append((n, k))
    consts = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.output:
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None:
                consts[n.output[0]] = value
    types = {i.name: i.type.tensor_type.elem_type for i in g.input}
    graph = _Graph(readers, producer, consts, {i.name for i in g.input}, model)
    out = {}
    for name in names:
        d = graph.domain(name, types.get(name) in INTEGER_TYPES, types.get(name) in FLOAT_TYPES)
        if d is not None:
            out[name] = d
    return out


class _Graph:
    def __init__(self, readers, producer, consts, inputs, model):
        self.readers, self.producer, self.consts, self.inputs = readers, producer, consts, inputs
        self.model = model
        self._dims: dict[str, list] | None = None

    def dims(self, name: str) -> list:
        """A value's dims (ints, or the symbolic names ONNX shape inference carries from the inputs), [] unknown."""
        if self._dims is None:
            self._dims = {}
            try:
                m = onnx.shape_inference.infer_shapes(self.model)
            except Exception:  # noqa: BLE001 - a graph ONNX cannot infer: no bound from its shapes
                m = self.model
            for v in (*m.graph.value_info, *m.graph.input, *m.graph.output):
                self._dims[v.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param
                                      for d in v.type.tensor_type.shape.dim]
            self._named = {}  # dim name -> (input, axis)
            for v in m.graph.input:
                for i, d in enumerate(v.type.tensor_type.shape.dim):
                    if d.dim_param:
                        self._named.setdefault(d.dim_param, (v.name, i))
        return self._dims.get(name, [])

    def axis_bound(self, name: str, axis: int) -> tuple[int | None, tuple | None]:
        """(size, None) or (None, (input, axis)) of ``name``'s axis where shape inference knows it, else (None, None)."""
        dims = self.dims(name)
        if not -len(dims) <= axis < len(dims):
            return None, None
        d = dims[axis]
        if isinstance(d, int) and d > 0:
            return d, None
        return None, self._named.get(d) if d else None

    def const(self, name: str) -> np.ndarray | None:
        """The value of a weight or Constant (followed up through Cast/DequantizeLinear/Identity), else None."""
        for _ in range(4):
            if name in self.consts:
                return numpy_helper.to_array(self.consts[name])
            p = self.producer.get(name)
            if p is None or p.op_type not in ("Cast", "DequantizeLinear", "Identity") or not p.input:
                return None
            name = p.input[0]
        return None

    def table_rows(self, gather: onnx.NodeProto) -> int | None:
        table = self.const(gather.input[0])
        if table is None or table.ndim == 0:
            return None
        axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
        return int(table.shape[axis])

    def is_fill(self, name: str) -> bool:
        v = self.const(name)
        return v is not None and v.size > 0 and v.dtype.kind == "f" and float(v.max()) <= FILL_MAX

    def from_range(self, name: str) -> onnx.NodeProto | None:
        """The Range ``name`` is the output of (through carrying ops), else None."""
        for _ in range(DEPTH):
            p = self.producer.get(name)
            if p is None:
                return None
            if p.op_type == "Range":
                return p
            if p.op_type not in CARRY or not p.input:
                return None
            name = p.input[0]
        return None

    def extent(self, name: str) -> tuple[str, int] | None:
        """(input, axis) when ``name`` is the size of an input's axis (Gather(Shape(input), axis)), else None."""
        p = self.producer.get(name)
        while p is not None and p.op_type in ("Cast", "Squeeze", "Unsqueeze", "Reshape", "Identity") and p.input:
            p = self.producer.get(p.input[0])
        if p is None or p.op_type != "Gather" or len(p.input) < 2:
            return None
        shape, axis = self.producer.get(p.input[0]), self.const(p.input[1])
        if shape is None or shape.op_type != "Shape" or axis is None or axis.size != 1:
            return None
        src = self.source_input(shape.input[0])
        start = next((a.i for a in shape.attribute if a.name == "start"), 0)
        return (src[0], int(axis.ravel()[0]) + start) if src else None

    def source_input(self, name: str) -> tuple[str, int] | None:
        """The graph input ``name`` comes from through carrying ops that keep axis 0 (RNN's X), else None."""
        for _ in range(DEPTH):
            if name in self.inputs:
                return name, 0
            p = self.producer.get(name)
            if p is None or p.op_type not in ("Cast", "Identity") or not p.input:
                return None
            name = p.input[0]
        return None

    def size_set(self, name: str) -> str | None:
        """How float input ``name``'s value sets a size (the ops from it to the size input of a Range, ConstantOfShape,
        ...; SIZE_INPUTS), else None."""
        todo, seen = [(name, ())], {name}
        while todo:
            v, path = todo.pop(0)
            for n, k in self.readers.get(v, []):
                op = n.op_type
                if k in SIZE_INPUTS.get(op, ()):
                    steps = " -> ".join((*path, op))
                    return f"its value sets the size of {op} {n.name or ''}".rstrip() + f" ({steps})"
                carried = op in VALUE_OPS and (VALUE_OPS[op] is None or k in VALUE_OPS[op])
                if carried and len(path) < SIZE_DEPTH:
                    for o in n.output[:1]:
                        if o and o not in seen:
                            seen.add(o)
                            todo.append((o, (*path, op)))
        return None

    def domain(self, name: str, integer: bool, floating: bool = False) -> Domain | None:
        found: dict[str, Domain] = {}
        if floating:
            sets = self.size_set(name)
            if sets is not None:
                found["size"] = Domain("size", sets)
        rows: list[int] = []
        seen = set()
        todo = [(name, 0, 0)]  # (value, depth, inversions)
        while todo:
            v, depth, flips = todo.pop()
            if (v, flips % 2) in seen or depth > DEPTH:
                continue
            seen.add((v, flips % 2))
            for n, k in self.readers.get(v, []):
                op = n.op_type
                if op == "Gather" and k == 1 and self.table_rows(n) is not None:
                    rows.append(self.table_rows(n))
                    continue
                if op in ("Gather", "GatherElements", "ScatterElements", "GatherND", "ScatterND") and k == 1 and integer:
                    # indices into another value (a graph's edges into its nodes, a node's graph id): bounded by that
                    # value's axis, where it is an input's or shape inference carries an input's dim to it
                    axis = 0 if op.endswith("ND") else next((a.i for a in n.attribute if a.name == "axis"), 0)
                    src = self.source_input(n.input[0])
                    high, of = (None, (src[0], axis)) if src else self.axis_bound(n.input[0], axis)
                    if high is not None or of is not None:
                        what = f"size of {of[0]!r} axis {of[1]}" if of else str(high)
                        found.setdefault("ids", Domain(
                            "ids", f"it indexes a value of {what} on axis {axis} ({op} {n.name or ''})".replace(" )", ")"),
                            high=high, of=of, segments=op.startswith("Scatter")))
                    continue
                if op == "Where" and k == 0:  # masked_fill(mask, -inf) is Where(mask, -inf, x): True pads
                    keeps = 0 if self.is_fill(n.input[1]) and not self.is_fill(n.input[2]) else 1
                    found.setdefault("mask", Domain("mask", f"it selects a Where ({n.name or 'unnamed'})",
                                                    valid=keeps if flips % 2 == 0 else 1 - keeps))
                    continue
                if op == "Mul" and any(self.is_fill(x) for x in n.input if x != v):
                    # (1 - m) * -1e9: positions where the value is 1 get the fill (are padded)
                    found.setdefault("mask", Domain("mask", f"it scales a large negative fill ({n.name or 'unnamed'})",
                                                    valid=0 if flips % 2 == 0 else 1))
                    continue
                if op == "Range" and k == 1 and integer:
                    found.setdefault("length", Domain("length", f"it bounds a Range ({n.name or 'unnamed'})"))
                    continue
                if op in ("LSTM", "GRU", "RNN") and k == 4:
                    src = self.source_input(n.input[0])
                    found.setdefault("length", Domain("length", f"it is the sequence_lens of {op} {n.name or ''}".strip(),
                                                      of=src))
                    continue
                if op in ("Less", "Greater", "LessOrEqual", "GreaterOrEqual") and integer and \
                        self.from_range(n.input[1 - k]) is not None:
                    r = self.from_range(n.input[1 - k])
                    found.setdefault("length", Domain("length", f"it is compared with positions from a Range "
                                                                f"({n.name or 'unnamed'})", of=self.extent(r.input[1])))
                    continue
                if op in ("Log", "Sqrt", "Reciprocal") and k == 0 or op == "Div" and k == 1 or \
                        op == "Pow" and k == 0 and not _integer_exponent(self.const(n.input[1])):
                    found.setdefault("positive", Domain("positive", f"{op} {n.name or ''} takes it".replace("  ", " ")))
                    continue
                if op in CARRY and not (op == "Gather" and k != 0):
                    todo.append((n.output[0], depth + 1, flips))
                elif op == "Not" or op == "Sub" and k == 1 and _is_one(self.const(n.input[0])):
                    todo.append((n.output[0], depth + 1, flips + 1))
                elif op == "Equal" and not floating and _is_zero(self.const(n.input[1 - k])):
                    todo.append((n.output[0], depth + 1, flips + 1))
                elif op in ("And", "Or") or not floating and (  # a float compared (x > 0) is no mask: a leaky ReLU
                        op == "Equal" and _is_one(self.const(n.input[1 - k])) or
                        op == "Greater" and k == 0 and _is_zero(self.const(n.input[1]))):
                    todo.append((n.output[0], depth + 1, flips))
                elif op == "Mul" and _positive_const(self.const(n.input[1 - k])) or op == "Div" and k == 0 and \
                        _positive_const(self.const(n.input[1])):
                    todo.append((n.output[0], depth + 1, flips))  # scaled: a positive value stays positive
        if rows and integer:
            return Domain("ids", f"it indexes an embedding table of {min(rows)} rows" if len(set(rows)) == 1 else
                          f"it indexes embedding tables of {sorted(set(rows))} rows", high=min(rows))
        for kind in ("ids", "length", "mask", "size", "positive"):
            if kind in found and (kind != "positive" or not integer):
                return found[kind]
        return None


def _is_one(v: np.ndarray | None) -> bool:
    return v is not None and v.size > 0 and bool(np.all(v == 1))


def _is_zero(v: np.ndarray | None) -> bool:
    return v is not None and v.size > 0 and bool(np.all(v == 0))


def _positive_const(v: np.ndarray | None) -> bool:
    return v is not None and v.size > 0 and v.dtype.kind in "fiu" and bool(np.all(v > 0))


def _integer_exponent(v: np.ndarray | None) -> bool:
    return v is not None and v.size > 0 and bool(np.all(np.asarray(v, np.float64) == np.round(np.asarray(v, np.float64))))
