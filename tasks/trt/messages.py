"""TensorRT's messages read as causes (without source locations and GPU-less driver noise, each once), and the fix a
failure suggests: what the builder's words point at, else the config keys that keep the failing ops out of TensorRT,
and the ONNX node an error names."""
from __future__ import annotations

import re


def unique(items) -> list:
    """The items in their order, each once (empty ones dropped)."""
    seen: set = set()
    return [x for x in items if x and not (x in seen or seen.add(x))]


def clean_message(msg: str) -> str:
    """A TensorRT message as a cause: without its source locations ("In op at /_src/...cpp:2699") and without the
    "[checkMacros.cpp::catchCudaError] ... cudaError 35" lines a host without a GPU adds to a parser error (parsing
    and building never need the GPU)."""
    import re

    from tasks.common.errors import cause

    return cause(re.sub(r"\s*In \w+ at /\S+", "", msg))


QUANTIZED_CONSTANT = re.compile(r"Quantized constant \(([^()]+)\) is only allowed before DQ")


def builder_fix(errors: list[str], ops: list[str], model_path: str = "") -> str:
    """The fix that matches what the builder said (Polygraphy's rule: say how to fix it), else route_around."""
    text = " ".join(errors)
    m = QUANTIZED_CONSTANT.search(text)
    if m:
        readers = sorted(_readers_of(model_path, m.group(1))) if model_path else []
        ops = readers or ops
        return (f"TensorRT reads an 8-bit constant ({m.group(1)}) only through a DequantizeLinear, and here "
                f"{'/'.join(readers) or 'another op'} reads it: write the weight as constant -> DequantizeLinear "
                "(the export does that for weight-only quantization written as Cast -> Mul(scale)), or "
                + (f"run {'/'.join(ops)} in ONNX Runtime with partition.exclude_ops=[{','.join(ops)}]" if ops else
                   "keep its readers out of TensorRT with partition.exclude_ops=[Op,...]"))
    if re.search(r"must (?:be of|have) same (?:input )?type", text):
        return ("a node reads two float types (a precision conversion fault; please report it with the model): "
                "precision=fp32 builds it" + (f", or partition.exclude_ops=[{','.join(sorted(set(ops)))}]" if ops else ""))
    return route_around(ops)


def _readers_of(model_path: str, tensor: str) -> set[str]:
    """Op types of the nodes that read ``tensor`` in an ONNX file (top level)."""
    import onnx

    try:
        g = onnx.load(model_path, load_external_data=False).graph
    except Exception:  # noqa: BLE001 - a hint only
        return set()
    return {n.op_type for n in g.node if tensor in n.input}


def route_around(ops: list[str]) -> str:
    """How to build anyway: the config keys that keep the failing ops (or small islands) out of TensorRT."""
    ops = sorted(set(ops))
    if ops:
        return (f"run {'it' if len(ops) == 1 else 'them'} in ONNX Runtime with partition.exclude_ops=[{','.join(ops)}] "
                "(or raise partition.min_subgraph_size=N to keep TensorRT islands smaller than N nodes native); "
                "partition.json lists the TensorRT subgraphs")
    return ("check the profiles (every shape between min and max must be valid for the model); to keep ops out of "
            "TensorRT: partition.exclude_ops=[Op,...] or partition.min_subgraph_size=N (partition.json lists the subgraphs)")


def node_named_in(model_path: str, messages: list[str]) -> tuple[str, str] | None:
    """(name, op) of the ONNX node a TensorRT error names (TensorRT names layers after their nodes); the longest match."""
    if not messages:
        return None
    import onnx

    from tasks.graph.edit import subgraphs

    text = "\n".join(messages)
    try:
        model = onnx.load(model_path, load_external_data=False)
    except Exception:
        return None
    best = None

    def visit(g):
        nonlocal best
        for n in g.node:
            if len(n.name) >= 3 and n.name in text and (best is None or len(n.name) > len(best[0])):
                best = (n.name, n.op_type)
            for sub in subgraphs(n):
                visit(sub)

    visit(model.graph)
    return best
