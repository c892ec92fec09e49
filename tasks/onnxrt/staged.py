"""One model run as a few sessions in sequence (stages), each stage's inputs kept from earlier runs: a run whose
inputs to the first stages are those of an earlier run starts where they part.

The accuracy search judges hundreds of candidates that switch layers of one graph on and off (the switchable session,
tasks/quantization/sensitivity.py); its screen quantizes one layer at a time on top of the same base, on the same page,
so every activation before that layer is the base's. Cut into stages, a run reads the values crossing the last cut
before the first layer it switches differently from the cache and computes only the rest.

The same numbers as the whole graph in one session: a cut crosses only values made by a ``Cast`` (the fp16 rounding
of the emulated remainder, tasks/onnxrt/emulate.py), which no ONNX Runtime optimization fuses across, and every stage
is optimized at the same level as the whole (``basic``: what ``ort_session`` gives a graph with Q/DQ), so each node
computes on the same inputs with the same kernel. A graph with no such cut runs as one stage.
"""
from __future__ import annotations

import collections
import threading
from typing import Hashable

import numpy as np
import onnx
from onnx import helper

from tasks.graph.edit import node_inputs
from tasks.onnxrt.ort import ort_run, ort_session

CACHE_BYTES = 512 << 20  # the values kept at the cuts, least recently used dropped first
SMALL_INPUT = 64  # elements: an input this small is keyed by its value (a switch's flag), a larger one by identity


class StagedSession:
    """``run(inputs)`` like one session of ``model`` (every graph output), through at most ``stages`` sessions cut at
    the cumulative ``weight`` (node name -> cost, e.g. FLOPs) shares i/stages; the values crossing each cut are kept
    per (the inputs the stages before it read), so a run repeating an earlier run's early inputs skips those stages.
    ``runs_from``: per stage, the runs that started there."""

    def __init__(self, model: onnx.ModelProto, *, stages: int, weight: dict[str, float], stage: str, threads: int = 0,
                 cache_bytes: int = CACHE_BYTES) -> None:
        g = model.graph
        self.outputs = [o.name for o in g.output]
        cuts = _cuts(g, stages, weight)
        bounds = [0, *cuts, len(g.node)]
        self.parts = [_stage_model(model, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
        self.sessions = [ort_session(m.SerializeToString(), optimization="basic", threads=threads, stage=stage)
                         for m, _, _ in self.parts]
        self._stage = stage
        graph_inputs = {i.name for i in g.input}
        # per cut (before stage k >= 1): the graph inputs stages < k read, and the values crossing it
        read: list[str] = []
        self._keyed: list[list[str]] = []
        self._crossing: list[list[str]] = []
        for k in range(1, len(self.parts)):
            read += [x for x in self.parts[k - 1][1] if x in graph_inputs and x not in read]
            self._keyed.append(list(read))
            later = {x for _, ins, _ in self.parts[k:] for x in ins} | set(self.outputs)
            self._crossing.append([v for _, _, outs in self.parts[:k] for v in outs if v in later])
        # crossing values an fp16 rounding made (a Cast to float of a Cast to float16): kept as float16, exactly
        made = {o: n for n in g.node for o in n.output}
        self._half = {v for c in self._crossing for v in c if _rounded_to_fp16(v, made)}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._bytes, self._limit = 0, cache_bytes
        self._lock = threading.Lock()
        self.runs_from = [0] * len(self.parts)

    def run(self, inputs: dict[str, np.ndarray], options=None) -> dict[str, np.ndarray]:
        keys = [self._key(k, inputs) for k in range(len(self._keyed))]
        env: dict[str, np.ndarray] = {}
        start, hit = 0, None
        with self._lock:
            for k in range(len(keys) - 1, -1, -1):  # the last cut whose values a run with these inputs left
                hit = self._cache.get(keys[k])
                if hit is not None:
                    for key in keys[:k + 1]:  # the same run's earlier cuts: as likely to serve the next run
                        if key in self._cache:
                            self._cache.move_to_end(key)
                    start = k + 1
                    break
            self.runs_from[start] += 1
        if hit is not None:
            env.update({v: a.astype(np.float32) if v in self._half else a for v, a in hit[0].items()})
        for s in range(start, len(self.parts)):
            _, ins, _ = self.parts[s]
            env.update(ort_run(self.sessions[s], {x: env[x] if x in env else inputs[x] for x in ins},
                               stage=self._stage, options=options))
            if s < len(keys):
                self._keep(keys[s], {v: env[v].astype(np.float16) if v in self._half else env[v]
                                     for v in self._crossing[s]}, inputs, s)
        return {o: env[o] for o in self.outputs}

    def _key(self, k: int, inputs: dict) -> tuple:
        out = []
        for name in self._keyed[k]:
            a = inputs[name]
            out.append((name, a.dtype.str, a.shape, a.tobytes()) if a.size <= SMALL_INPUT else (name, id(a)))
        return (k, *out)

    def _keep(self, key: Hashable, values: dict, inputs: dict, k: int) -> None:
        # the entry holds the large inputs it is keyed by: their ids stay theirs while it lives
        held = [inputs[n] for n in self._keyed[k] if inputs[n].size > SMALL_INPUT]
        size = sum(v.nbytes for v in values.values())
        if size > self._limit:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = (values, held, size)
            self._bytes += size
            while self._bytes > self._limit:
                _, (_, _, gone) = self._cache.popitem(last=False)
                self._bytes -= gone


def _cuts(g: onnx.GraphProto, stages: int, weight: dict[str, float]) -> list[int]:
    """Node positions (a stage starts there) nearest the cumulative weight shares i/stages, among the positions that
    only ``Cast`` outputs cross (see the module doc)."""
    if stages <= 1 or not g.node:
        return []
    reads = [set(node_inputs(n)) for n in g.node]
    made_at = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    last_read: dict[str, int] = {}
    for i, r in enumerate(reads):
        for x in r:
            last_read[x] = i
    for o in g.output:
        last_read[o.name] = len(g.node)
    is_cast = [n.op_type == "Cast" and n.domain in ("", "ai.onnx") for n in g.node]
    open_other = 0  # values made before p by another op than Cast and read at p or later
    closing = collections.Counter(last_read[o] for n, c in zip(g.node, is_cast) if not c
                                  for o in n.output if o in last_read and last_read[o] > made_at[o])
    total = sum(weight.get(n.name, 0.0) for n in g.node) or 1.0
    done, ok, share = 0.0, [], []
    for p in range(1, len(g.node)):
        n = g.node[p - 1]
        done += weight.get(n.name, 0.0)
        if not is_cast[p - 1]:
            open_other += sum(1 for o in n.output if o in last_read and last_read[o] > p - 1)
        open_other -= closing.get(p - 1, 0)
        if open_other == 0:
            ok.append(p)
            share.append(done / total)
    cuts: list[int] = []
    for i in range(1, stages):
        if not ok:
            break
        j = min(range(len(ok)), key=lambda j: abs(share[j] - i / stages))
        if 0 < share[j] < 1 and ok[j] not in cuts:
            cuts.append(ok[j])
    return sorted(cuts)


def _stage_model(model: onnx.ModelProto, lo: int, hi: int) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """The nodes [lo, hi) of ``model``'s graph as a model: (model, its inputs, its outputs). Inputs: what the nodes
    (and their subgraphs) read that is neither made among them nor an initializer; outputs: what they make that a later
    node or the graph's outputs read."""
    g = model.graph
    nodes = list(g.node[lo:hi])
    inits = {t.name: t for t in g.initializer}
    made = {o for n in nodes for o in n.output if o}
    ins: list[str] = []
    for n in nodes:
        for x in node_inputs(n):
            if x not in made and x not in inits and x not in ins:
                ins.append(x)
    later = {x for n in g.node[hi:] for x in node_inputs(n)} | {o.name for o in g.output}
    outs = [o for n in nodes for o in n.output if o and o in later]
    types = _types(g)
    used = {x for n in nodes for x in node_inputs(n)}
    graph = helper.make_graph(nodes, f"{g.name}_stage_{lo}", [types[x] for x in ins], [types[o] for o in outs],
                              [inits[x] for x in inits if x in used])
    m = helper.make_model(graph, opset_imports=model.opset_import)
    m.ir_version = model.ir_version
    return m, ins, outs


def _rounded_to_fp16(v: str, made: dict) -> bool:
    """Whether value ``v`` is a Cast to float of a Cast to float16 (a value float16 holds exactly)."""
    def cast_to(n, to) -> bool:
        return n is not None and n.op_type == "Cast" and any(a.name == "to" and a.i == to for a in n.attribute)
    n = made.get(v)
    return cast_to(n, onnx.TensorProto.FLOAT) and cast_to(made.get(n.input[0]), onnx.TensorProto.FLOAT16)


def _types(g: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    """value -> a ValueInfo giving its element type: the graph's inputs and outputs as declared, a Cast's output by
    its ``to`` (the only values a cut crosses besides graph inputs)."""
    out: dict[str, onnx.ValueInfoProto] = {}
    for n in g.node:
        if n.op_type == "Cast":
            to = next(a.i for a in n.attribute if a.name == "to")
            out[n.output[0]] = helper.make_tensor_value_info(n.output[0], to, None)
    for v in (*g.value_info, *g.input, *g.output):
        out[v.name] = v
    return out

