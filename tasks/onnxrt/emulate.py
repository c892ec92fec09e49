"""A faithful CPU emulation of an fp16 graph: every fp16 value rounded to fp16, arithmetic in fp32.

ONNX Runtime's CPU provider has no fp16 kernel for most ops: it wraps them in casts to fp32 and back, and drops the
casts between two such ops, so a chain of fp16 ops runs in fp32 end to end. Values that overflow fp16 (a power
spectrum of 16-bit audio: ~1e10) or lose precision in it never do, and an fp16 graph validates as if it were fp32
(measured: a mel front end whose naive fp16 graph TensorRT would compute as inf gave cosine 0.999999 in ONNX Runtime).

``fp16_rounded`` rewrites the graph in fp32 with an explicit Cast to fp16 and back after every op whose output was
fp16 (ONNX Runtime keeps explicit round trips: they change values), fp16 weights as their exact fp32 values, and the
graph's fp16 inputs and outputs kept fp16 at the border. This is what TensorRT's strongly typed fp16 network stores
between layers; inside a layer TensorRT may accumulate in fp32, as the emulation does.

A dequantized value read only by layers TensorRT fuses its DequantizeLinear into (``FUSED_READERS``) is not rounded:
TensorRT never stores it. Its int8 kernel multiplies the codes, sums the products exactly in int32 and scales the sum
in fp32 (``int8_layers_from_codes``, tasks/onnxrt/codes.py); the dequantized value, an int8 code times an fp16 scale,
is exact in fp32, and rounding it to fp16 would add an error the engine does not make.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from tasks.graph.edit import name_allocator, redirect_reads, subgraphs

H, F = TensorProto.FLOAT16, TensorProto.FLOAT
# layers TensorRT fuses a DequantizeLinear on their input into (the int8 kernel and its epilogue, e.g. a residual Add);
# ``Where``/``Identity`` only hand a value on (the accuracy search's switches, tasks/quantization/sensitivity.py): their
# readers decide
FUSED_READERS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Add")
PASSING_READERS = ("Where", "Identity")


def has_fp16(model: onnx.ModelProto) -> bool:
    def graph_has(g: onnx.GraphProto) -> bool:
        return any(t.data_type == H for t in g.initializer) or \
            any(a.name == "to" and a.i == H for n in g.node if n.op_type == "Cast" for a in n.attribute) or \
            any(v.type.tensor_type.elem_type == H for v in (*g.input, *g.output, *g.value_info)) or \
            any(graph_has(s) for n in g.node for s in subgraphs(n))
    return graph_has(model.graph)


def fp16_rounded(model: onnx.ModelProto) -> onnx.ModelProto:
    """The fp32 graph that rounds like the fp16 one (see the module doc). Control-flow bodies (If/Loop/Scan) are
    rewritten the same way: every fp16 value they make is rounded where it is made, their fp16 inputs, outputs and
    loop-carried values become fp32 holding fp16 values (the loop of an autoregressive decoder feeds back what fp16
    computed, step after step)."""
    m = onnx.shape_inference.infer_shapes(model)
    fresh = name_allocator(m.graph)  # values and node names of every scope (subgraphs read outer names)
    node_name = fresh

    def rewrite(g: onnx.GraphProto, top: bool) -> None:
        fp16 = {v.name for v in (*g.value_info, *g.output) if v.type.tensor_type.elem_type == H}
        fp16 -= fused_dequantized(g)
        for n in g.node:  # what the producers say, where inference left a value untyped
            if n.op_type == "Cast" and any(a.name == "to" and a.i == H for a in n.attribute):
                fp16.add(n.output[0])
        for i, t in enumerate(g.initializer):  # fp16 weights: their exact values, in fp32
            if t.data_type == H:
                g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype("float32"), t.name))
        for v in (*g.value_info, *([] if top else (*g.input, *g.output))):
            if v.type.tensor_type.elem_type == H:
                v.type.tensor_type.elem_type = F
        nodes = []
        if top:
            for inp in g.input:  # an fp16 input stays fp16 at the border; inside, its fp32 copy
                if inp.type.tensor_type.elem_type == H:
                    inner = fresh(inp.name + "_emul_f32")
                    redirect_reads(g.node, {inp.name: inner})
                    nodes.append(helper.make_node("Cast", [inp.name], [inner], to=F, name=node_name(inner + "_cast")))
        outputs16 = {o.name for o in g.output if o.type.tensor_type.elem_type == H} if top else set()
        renamed: dict[str, str] = {}
        border: set[int] = set()
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == H:  # Constant, ConstantOfShape values
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype("float32"), a.t.name))
                elif a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i == H:
                    a.i = F  # computes in fp32; the rounding below makes it fp16's value
            for sub in subgraphs(n):
                rewrite(sub, False)
            nodes.append(n)
            for k, out in enumerate(n.output):
                if out not in fp16:
                    continue
                raw, half = fresh(out + "_emul_raw"), fresh(out + "_emul_f16")
                n.output[k] = raw
                nodes.append(helper.make_node("Cast", [raw], [half], to=H, name=node_name(half + "_round")))
                back = out if out not in outputs16 else fresh(out + "_emul_f32")
                nodes.append(helper.make_node("Cast", [half], [back], to=F, name=node_name(out + "_back")))
                if out in outputs16:  # an fp16 graph output: the fp16 value itself; other readers take the fp32 copy
                    nodes.append(helper.make_node("Identity", [half], [out], name=node_name(out + "_out")))
                    border.add(id(nodes[-1]))
                    renamed[out] = back
        redirect_reads([n for n in nodes if id(n) not in border], renamed)
        del g.node[:]
        g.node.extend(nodes)

    rewrite(m.graph, True)
    return m


def fused_dequantized(g: onnx.GraphProto) -> set[str]:
    """Outputs of DequantizeLinear nodes of ``g`` that only ``FUSED_READERS`` read (directly or through
    ``PASSING_READERS``), no graph output and no subgraph: values TensorRT computes inside a fused layer, never stores."""
    readers: dict[str, list] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    elsewhere = {o.name for o in g.output} | {x for n in g.node for s in subgraphs(n) for x in _read_in(s)}

    def fused(value: str, depth: int = 0) -> bool:
        if value in elsewhere or depth > 4 or not readers.get(value):
            return False
        return all(r.op_type in FUSED_READERS or
                   (r.op_type in PASSING_READERS and all(fused(o, depth + 1) for o in r.output)) for r in readers[value])

    found = {n.output[0] for n in g.node if n.op_type == "DequantizeLinear" and fused(n.output[0])}
    passed = found
    while passed:  # what a switch hands on of a fused dequantized value is not stored either
        passed = {o for n in g.node if n.op_type in PASSING_READERS and set(n.input) & passed
                  for o in n.output if fused(o)} - found
        found |= passed
    return found


def _read_in(g: onnx.GraphProto) -> set[str]:
    """Every value name the nodes of ``g`` and its nested subgraphs read."""
    return {x for n in g.node for x in n.input} | {x for n in g.node for s in subgraphs(n) for x in _read_in(s)}


SAME_ON_ANY_CPU = "the same figure on any x86-64 host"
INT8_EMULATION = ("int8 layers as TensorRT's fused int8 kernels compute them: the int8 codes multiplied and summed "
                  "exactly, the sum scaled in fp32 by the activation's scale times the weight's; computed in float, "
                  f"never by ONNX Runtime's CPU-specific integer kernels: {SAME_ON_ANY_CPU}")
FP8_EMULATION = ("fp8 layers as written, in float: fp8 values times their scales (exact in fp32), products summed "
                 f"in fp32: {SAME_ON_ANY_CPU}")
FP16_EMULATION = "every fp16 value rounded to fp16 after each op, arithmetic in fp32"
FUSED_NOT_ROUNDED = "dequantized values read by fused layers kept exact in fp32, as TensorRT never stores them"


def emulation_label(precision: str) -> str:
    """What computed an accuracy figure of a graph at ``precision`` on a host that cannot run the engine (int8 and fp8
    with the float remainder as ``precision_runner`` emulates it)."""
    rest = f"; the rest {FP16_EMULATION}, {FUSED_NOT_ROUNDED}"
    how = {"fp16": FP16_EMULATION, "int8": INT8_EMULATION + rest, "fp8": FP8_EMULATION + rest}.get(precision)
    return f"onnxruntime emulation of {precision}" + (f" ({how})" if how else "")


def precision_runner(path, optimization: str = "all", arena: bool = True, stage: str = "validate"):
    """(feed -> outputs, how) for a precision graph in ONNX Runtime: an fp16 graph through ``fp16_rounded`` (what
    TensorRT stores between layers), its int8 layers through ``int8_layers_from_codes`` (what TensorRT's fused int8
    kernels compute), every other Q/DQ as written (``ort_session``'s exact mode)."""
    from tasks.onnxrt.codes import int8_layers_from_codes
    from tasks.onnxrt.ort import ort_runner

    model = onnx.load(str(path)) if not isinstance(path, onnx.ModelProto) else path
    hows = []
    if has_fp16(model):
        model = fp16_rounded(model)
        hows.append(f"{FP16_EMULATION} (control-flow bodies included), {FUSED_NOT_ROUNDED}")
    model, codes = int8_layers_from_codes(model)
    if codes:
        hows.append(f"{codes} int8 layers on their codes, summed exactly, scaled in fp32")
    return ort_runner(model.SerializeToString(), optimization, stage, arena), "; ".join(hows) or "as written"
