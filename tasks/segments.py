"""Hybrid execution, as Paddle Inference and ONNX Runtime's TensorRT provider do it: the graph is cut into
segments in topological order; TensorRT segments become engines, the rest runs natively in ONNX Runtime.

- `segments_from_assignment`: contiguous runs of TensorRT / native nodes (always acyclic);
- `boundary_shapes`: run the fp32 model on min/opt/max inputs with every boundary tensor as an extra output,
  which gives each TensorRT segment's input profiles (shapes propagated through the native ops);
- `extract_segment`: one self-contained ONNX per segment;
- `Composed`: runs the segments in order (ONNX Runtime per segment, or a TensorRT engine per segment on a GPU).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .graph import node_inputs

NP_TO_ONNX = {np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int8): 3, np.dtype(np.int32): 6,
              np.dtype(np.int64): 7, np.dtype(np.bool_): 9, np.dtype(np.float16): 10, np.dtype(np.float64): 11}


@dataclass
class Segment:
    index: int
    kind: str  # "trt" | "native"
    nodes: list[int]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    onnx: str = ""  # file name of the extracted fp32 segment
    profiles: list = field(default_factory=list)  # trt: one per model profile, input name -> {min, opt, max}

    def as_dict(self) -> dict:
        return asdict(self)


def segments_from_assignment(model, trt_nodes: set[int]) -> list[Segment]:
    g = model.graph
    kinds = ["trt" if i in trt_nodes else "native" for i in range(len(g.node))]
    segments: list[Segment] = []
    for i, kind in enumerate(kinds):
        if not segments or segments[-1].kind != kind:
            segments.append(Segment(len(segments), kind, []))
        segments[-1].nodes.append(i)
    inits = {t.name for t in g.initializer}
    graph_outputs = [o.name for o in g.output]
    produced_in = {}
    for s in segments:
        for i in s.nodes:
            for o in g.node[i].output:
                if o:
                    produced_in[o] = s.index
    consumers: dict[str, set[int]] = {}
    for s in segments:
        for i in s.nodes:
            for name in node_inputs(g.node[i]):
                consumers.setdefault(name, set()).add(s.index)
    for s in segments:
        ins: list[str] = []
        for i in s.nodes:
            for name in node_inputs(g.node[i]):
                if name not in inits and produced_in.get(name) != s.index and name not in ins:
                    ins.append(name)
        outs = []
        for i in s.nodes:
            for o in g.node[i].output:
                if o and (o in graph_outputs or any(c != s.index for c in consumers.get(o, ()))):
                    outs.append(o)
        s.inputs, s.outputs = ins, outs
    return segments


def boundary_names(segments: list[Segment]) -> list[str]:
    names: list[str] = []
    for s in segments:
        for n in s.inputs + s.outputs:
            if n not in names:
                names.append(n)
    return names


def run_with_intermediates(model, names: list[str], feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Run the fp32 model in ONNX Runtime returning the named intermediate tensors as well."""
    import onnx
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    graph_inputs = {i.name for i in m.graph.input}
    for n in names:
        if n not in existing and n not in graph_inputs:
            m.graph.output.append(onnx.ValueInfoProto(name=n))
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    outs = [o.name for o in sess.get_outputs()]
    results = []
    for feed in feeds:
        env = dict(zip(outs, sess.run(outs, feed)))
        env.update(feed)
        results.append({n: env[n] for n in names if n in env})
    return results


def shape_ranges(model, names: list[str], feeds: list[dict[str, np.ndarray]], opt: int = 1) -> dict[str, dict]:
    """dtype and shape range of the named tensors over runs of the fp32 model on `feeds` (feeds[opt] is the opt
    shape) -> {name: {min, opt, max, dtype}}; tensors whose rank varies between runs are left out."""
    runs = run_with_intermediates(model, names, feeds)
    out = {}
    for name in runs[0]:
        shapes = [list(r[name].shape) for r in runs if name in r]
        if len({len(s) for s in shapes}) != 1:
            continue
        out[name] = {"min": [min(d) for d in zip(*shapes)], "opt": shapes[min(opt, len(shapes) - 1)],
                     "max": [max(d) for d in zip(*shapes)], "dtype": str(runs[0][name].dtype)}
    return out


def extract_segment(model, seg: Segment, shapes: dict[str, dict], path: Path) -> None:
    """One segment as a self-contained ONNX model (its initializers, typed boundary inputs and outputs)."""
    import onnx

    onnx.save(submodel(model, seg.nodes, seg.inputs, seg.outputs, shapes, f"seg{seg.index}"), str(path))


def io_of(model, node_ids: list[int]) -> tuple[list[str], list[str]]:
    """Boundary inputs and outputs of a set of nodes inside a model."""
    g = model.graph
    inside = set(node_ids)
    inits = {t.name for t in g.initializer}
    produced = {o for i in node_ids for o in g.node[i].output if o}
    ins: list[str] = []
    for i in node_ids:
        for name in node_inputs(g.node[i]):
            if name not in inits and name not in produced and name not in ins:
                ins.append(name)
    used_outside = {x for j, n in enumerate(g.node) if j not in inside for x in node_inputs(n)} | {o.name for o in g.output}
    outs = [o for i in node_ids for o in g.node[i].output if o and o in used_outside]
    if not outs and node_ids:
        outs = [o for o in g.node[node_ids[-1]].output if o]
    return ins, outs


def submodel(model, node_ids: list[int], inputs: list[str], outputs: list[str], shapes: dict[str, dict], tag: str):
    """Nodes of a model as a standalone ONNX model with typed inputs/outputs (dims that vary become symbolic)."""
    from onnx import helper

    g = model.graph
    nodes = [g.node[i] for i in node_ids]
    used = set()
    for n in nodes:
        used.update(node_inputs(n))
    inits = [t for t in g.initializer if t.name in used]

    def vi(name: str):
        s = shapes[name]
        dims: list[Any] = [lo if lo == hi else f"{name}_d{i}" for i, (lo, hi) in enumerate(zip(s["min"], s["max"]))]
        return helper.make_tensor_value_info(name, NP_TO_ONNX[np.dtype(s["dtype"])], dims)

    graph = helper.make_graph(nodes, f"{g.name or 'graph'}_{tag}", [vi(n) for n in inputs],
                              [vi(n) for n in outputs], initializer=inits)
    m = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="trtforge-partition")
    m.ir_version = model.ir_version
    return m


class Composed:
    """Runs the segments in order. `runner_for(segment)` returns a callable feed -> outputs for each segment."""

    def __init__(self, segments: list[dict], graph_outputs: list[str], runner_for: Callable[[dict], Callable]):
        self.segments = segments
        self.graph_outputs = graph_outputs
        self.runners = [runner_for(s) for s in segments]

    def __call__(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = dict(feed)
        for seg, run in zip(self.segments, self.runners):
            env.update(run({n: env[n] for n in seg["inputs"]}))
        return {n: env[n] for n in self.graph_outputs}


def ort_runner(path: Path, basic: bool = False) -> Callable:
    from .runtime import ort_run, ort_session

    sess = ort_session(path, basic=basic)
    return lambda feed: ort_run(sess, feed)
