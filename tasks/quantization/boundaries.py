"""Precision boundaries of a choice of quantized layers, on the ONNX graph the search works on: the same rule as the
TensorRT network's estimate (tasks/trt/boundaries.py; TensorRT fuses DQ -> layer -> pointwise epilogue -> Q, so a
tensor changes precision where a quantized layer meets a float one), used to prefer, of two choices that both meet
the budget, the one with fewer boundaries (tasks/quantization/layer_search.py ``fewer_boundaries``)."""
from __future__ import annotations

# ONNX ops that pass a tensor on inside a fused Q/DQ pattern (as tasks.trt.boundaries.CARRIERS: pointwise epilogues
# and data movement)
CARRIER_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Relu", "LeakyRelu", "PRelu", "Sigmoid",
                         "HardSigmoid", "HardSwish", "Clip", "Tanh", "Elu", "Selu", "Softplus", "Abs", "Neg", "Sqrt",
                         "Exp", "Erf", "BatchNormalization", "Reshape", "Transpose", "Flatten", "Squeeze",
                         "Unsqueeze", "Slice", "Concat", "Identity", "Pad", "Cast", "QuantizeLinear",
                         "DequantizeLinear"})


GRAPH_INPUT, GRAPH_OUTPUT = "<graph input>", "<graph output>"


def neighbours(graph, layers: list[str]) -> dict[str, set[str]]:
    """For each layer, the layers whose outputs it reads or that read its outputs through carriers only, and
    GRAPH_INPUT / GRAPH_OUTPUT where it reads a graph input or feeds a graph output that way (a float edge: quantizing
    the layer moves a boundary there rather than removing it)."""
    names = set(layers)
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def up(t: str, seen: set[str]) -> set[str]:
        n = producer.get(t)
        if t in inputs:
            return {GRAPH_INPUT}
        if n is None or t in seen:
            return set()
        seen.add(t)
        if n.name in names:
            return {n.name}
        if n.op_type not in CARRIER_OPS:
            return set()
        return set().union(*(up(i, seen) for i in n.input if i)) if n.input else set()

    def down(t: str, seen: set[str]) -> set[str]:
        if t in seen:
            return set()
        seen.add(t)
        out: set[str] = {GRAPH_OUTPUT} if t in outputs else set()
        for n in readers.get(t, []):
            if n.name in names:
                out.add(n.name)
            elif n.op_type in CARRIER_OPS:
                for o in n.output:
                    out |= down(o, seen)
        return out

    by_name = {n.name: n for n in graph.node if n.name in names}
    return {L: (set().union(*(up(i, set()) for i in by_name[L].input if i)) | set().union(
        *(down(o, set()) for o in by_name[L].output))) - {L} for L in layers if L in by_name}


def isolated_restored(graph, layers: list[str], chosen: list[str]) -> list[str]:
    """The layers kept in high precision whose neighbours (``neighbours``) are all quantized layers, with at least one:
    each adds a boundary on its way in and one on its way out, which quantizing it removes."""
    on = set(chosen)
    near = neighbours(graph, layers)
    return [L for L in layers if L not in on and near.get(L) and near[L] <= on]
