"""What quantizing each layer costs, measured cheaply: the search's two instruments.

* ``Switchable``: ONE ONNX Runtime session of the all-layers Q/DQ graph in which every layer reads its quantized or
  its float inputs through a ``Where`` on a boolean graph input of its own. Any subset of layers is scored by feeding
  flags: no graph is rebuilt and no session made per candidate (those cost more than the run itself: ~0.3 s of the
  ~0.45 s per candidate on PP-OCRv4 det). The float remainder is fp32 here; the graph that is written (its remainder
  in fp16) is scored once at the end.
* ``local_errors``: each layer's own output error when only its inputs and weights are quantized, from the fp32
  activations of one pass (ONE probe graph computes every layer's quantized output from the fp32 inputs). Cheap and
  per range method, so the activation range of each tensor is chosen by the error it causes where it is consumed
  (entropy, percentile, max or MSE of the histogram), not by a whole-model run per layer and method.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .metrics import cosine
from .ort import ort_run, ort_session

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
STAGE = "calibrate"


def _float_dq_inputs(q, full: onnx.ModelProto) -> dict[str, dict[int, str]]:
    """Per layer: {input index: float tensor} for the inputs the all-layers graph feeds through a DQ."""
    by_name = {n.name: n for n in full.graph.node}
    out = {}
    for name in q.layers:
        node = by_name.get(name)
        if node is None:
            continue
        floats = q._float_inputs[name]
        out[name] = {i: floats[i] for i, x in enumerate(node.input) if i < len(floats) and x != floats[i]}
    return out


class Switchable:
    """Scores any subset of ``q.layers`` quantized (the rest fp32) on ``feeds`` against ``refs`` with one session."""

    def __init__(self, q, feeds: list[dict], refs: list[dict], judge=None):
        full = q.qdq(q.layers)  # fp32 remainder; every layer quantized
        m = onnx.ModelProto()
        m.CopyFrom(full)
        g = m.graph
        swaps = _float_dq_inputs(q, full)
        have = {t.name for t in g.initializer}
        g.initializer.extend(t for n, t in q._weights.items() if n not in have and
                             any(n in s.values() for s in swaps.values()))
        self.layers = [n for n in q.layers if swaps.get(n)]
        self.flags = {n: f"trtforge_quantize_{i}" for i, n in enumerate(self.layers)}
        nodes = []
        for node in g.node:
            if node.name in self.flags:
                flag = self.flags[node.name]
                for i, float_in in swaps[node.name].items():
                    sel = f"{flag}_in{i}"
                    nodes.append(helper.make_node("Where", [flag, node.input[i], float_in], [sel], name=sel))
                    node.input[i] = sel
            nodes.append(node)
        del g.node[:]
        g.node.extend(nodes)
        g.input.extend(helper.make_tensor_value_info(f, TensorProto.BOOL, []) for f in self.flags.values())
        self.session = ort_session(m.SerializeToString(), stage=STAGE)
        self.feeds, self.refs = feeds, refs
        # the accuracy metric's value of one feed, higher is better (tasks/accuracy.SearchJudge.value); default: cosine
        self.judge = judge or (lambda got, ref, feed: min(cosine(got[k], ref[k]) for k in ref))
        self.runs = 0  # whole-model runs (one feed each)
        self._last: dict[int, float] = {}  # per search feed: the lowest cosine seen (hardest first)

    def cosines(self, names, feeds: list[dict] | None = None, refs: list[dict] | None = None) -> list[float]:
        """Per feed: the lowest cosine of any output to its reference with exactly ``names`` quantized."""
        return [min(cosine(o[k], r[k]) for k in r) for o, r in
                zip(self._outputs(set(names), feeds or self.feeds), refs or self.refs)]

    def values(self, names, feeds: list[dict] | None = None, refs: list[dict] | None = None) -> list[float]:
        """Per feed: the accuracy metric's value (``judge``) with exactly ``names`` quantized."""
        feeds, refs = feeds or self.feeds, refs or self.refs
        return [self.judge(o, r, f) for o, r, f in zip(self._outputs(set(names), feeds), refs, feeds)]

    def meets(self, names, target: float) -> bool:
        """Whether every search feed's value (``judge``: the accuracy metric) reaches ``target`` with ``names`` quantized: the feeds that failed or
        came lowest before are run first, and the first one below ends it (most candidates that fail are judged in
        one run, not one per feed)."""
        on = set(names)
        for i in sorted(range(len(self.feeds)), key=lambda i: self._last.get(i, 1.0)):
            c = self.judge(self._outputs(on, [self.feeds[i]])[0], self.refs[i], self.feeds[i])
            self._last[i] = min(self._last.get(i, 1.0), c)
            if c < target:
                return False
        return True

    def _outputs(self, on: set, feeds: list[dict]) -> list[dict]:
        flags = {f: np.array(n in on) for n, f in self.flags.items()}
        out = []
        for feed in feeds:
            out.append(ort_run(self.session, {**feed, **flags}, stage=STAGE))
            self.runs += 1
        return out


def probe_model(q, full: onnx.ModelProto, fp32: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str], dict[str, str]]:
    """The graph computing every layer's output from fp32 activations with only that layer quantized: the all-layers
    graph's Q/DQ and layer nodes, each layer's other inputs (and its Q's inputs) read from graph inputs.
    Returns (model, its input names, {layer: the fp32 output it approximates})."""
    g = full.graph
    layers = set(q.layers)
    keep = [n for n in g.node if n.op_type in QDQ_OPS or n.name in layers]
    qdq_out = {o for n in keep if n.op_type in QDQ_OPS for o in n.output}
    inits = {t.name for t in g.initializer}
    need: list[str] = []
    outputs: dict[str, str] = {}
    nodes = []
    for n in keep:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        for x in c.input:
            if x and x not in qdq_out and x not in inits and x not in need:
                need.append(x)
        if n.name in layers:
            outputs[n.name] = n.output[0]
            c.output[0] = n.output[0] + "__quantized"
        nodes.append(c)
    m32 = onnx.shape_inference.infer_shapes(fp32)
    vi = {v.name: v for v in (*m32.graph.value_info, *m32.graph.input, *m32.graph.output)}
    inputs = [vi[x] if x in vi else helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in need]
    graph = helper.make_graph(nodes, "probe", inputs, [onnx.ValueInfoProto(name=o + "__quantized")
                                                      for o in outputs.values()], list(g.initializer))
    m = helper.make_model(graph, opset_imports=full.opset_import)
    m.ir_version = full.ir_version
    return m, need, outputs


def local_errors(quantizers: dict[str, object], fp32_path, feeds: list[dict]) -> dict[str, dict[str, float]]:
    """{method: {layer: relative squared error of the layer's output (pooled over ``feeds``) when only that layer is
    quantized with ``method``'s ranges}}, from one fp32 pass per feed. ``quantizers``: {method: Quantizer}."""
    from .segments import run_with_intermediates

    fp32 = onnx.load(str(fp32_path))
    probes = {}
    for method, q in quantizers.items():
        probes[method] = probe_model(q, q.qdq(q.layers), fp32)
    names = list(dict.fromkeys(x for m, need, outs in probes.values() for x in (*need, *outs.values())))
    sessions = {method: ort_session(m.SerializeToString(), stage=STAGE) for method, (m, _, _) in probes.items()}
    num = {method: {} for method in probes}
    den: dict[str, float] = {}
    for feed in feeds:
        cap = run_with_intermediates(fp32, names, [feed])[0]
        for method, (_, need, outs) in probes.items():
            got = ort_run(sessions[method], {x: cap[x] for x in need}, stage=STAGE)
            for layer, o in outs.items():
                ref = cap[o].astype(np.float64, copy=False)
                d = got[o + "__quantized"].astype(np.float64, copy=False) - ref
                num[method][layer] = num[method].get(layer, 0.0) + float(np.vdot(d, d))
                if method == next(iter(probes)):
                    den[layer] = den.get(layer, 0.0) + float(np.vdot(ref, ref))
    return {method: {layer: (v / den[layer] if den.get(layer) else (0.0 if v == 0 else float("inf")))
                     for layer, v in errs.items()} for method, errs in num.items()}
