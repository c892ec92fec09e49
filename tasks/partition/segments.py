"""Hybrid execution, as Paddle Inference and ONNX Runtime's TensorRT provider do it: the graph is cut into
segments in topological order; TensorRT segments become engines, the rest runs natively in ONNX Runtime.

- `segments_from_assignment`: connected components of TensorRT / native nodes, merged only where acyclic;
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

from tasks.graph.edit import node_inputs


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


def node_graph(g) -> tuple[list[set[int]], list[set[int]]]:
    """Predecessors and successors of each node (through tensors, including subgraphs' outer-scope inputs)."""
    producer = {o: i for i, node in enumerate(g.node) for o in node.output if o}
    preds: list[set[int]] = [set() for _ in g.node]
    succs: list[set[int]] = [set() for _ in g.node]
    for i, node in enumerate(g.node):
        for x in node_inputs(node):
            j = producer.get(x)
            if j is not None and j != i:
                preds[i].add(j)
                succs[j].add(i)
    return preds, succs


def _topo(keys: list[int], preds: dict[int, set[int]], rank: dict[int, int]) -> list[int]:
    """Kahn's order of `keys` (a DAG), ties broken by `rank` (so an already sorted graph keeps its order)."""
    import heapq

    left = {k: len(preds[k]) for k in keys}
    succ: dict[int, list[int]] = {k: [] for k in keys}
    for k in keys:
        for p in preds[k]:
            succ[p].append(k)
    heap = [(rank[k], k) for k in keys if left[k] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, k = heapq.heappop(heap)
        out.append(k)
        for s in succ[k]:
            left[s] -= 1
            if left[s] == 0:
                heapq.heappush(heap, (rank[s], s))
    if len(out) != len(keys):
        raise ValueError("the graph has a cycle")
    return out


def segments_from_assignment(model, trt_nodes: set[int]) -> list[Segment]:
    """Segments = connected components of same-kind nodes (TensorRT or native), merged along their edges only where
    that keeps the segments acyclic, so a native node on one branch does not split an independent branch (runs in
    node order would). Segments come in a topological order, which `Composed` runs them in."""
    g = model.graph
    preds, succs = node_graph(g)
    kinds = ["trt" if i in trt_nodes else "native" for i in range(len(g.node))]
    order = _topo(list(range(len(g.node))), dict(enumerate(preds)), {i: i for i in range(len(g.node))})
    pos = {i: k for k, i in enumerate(order)}
    parent = list(range(len(g.node)))  # union-find over nodes; a root is a cluster

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    c_succ: dict[int, set[int]] = {i: set(succs[i]) for i in range(len(g.node))}
    c_pred: dict[int, set[int]] = {i: set(preds[i]) for i in range(len(g.node))}

    def reaches_indirectly(a: int, b: int, limit: int) -> bool:
        """A path a -> ... -> b through some other cluster (merging a and b would then make a cycle). Nodes are
        visited in topological order, so a cluster rooted after `limit` is a lone later node that cannot lead back."""
        stack, seen = [c for c in c_succ[a] if c != b], set()
        while stack:
            c = stack.pop()
            if c == b:
                return True
            if c not in seen and pos[c] <= limit:
                seen.add(c)
                stack.extend(c_succ[c])
        return False

    for i in order:
        for j in sorted(preds[i], key=pos.get):
            a, b = find(j), find(i)
            if a == b or kinds[a] != kinds[b] or reaches_indirectly(a, b, pos[i]) or reaches_indirectly(b, a, pos[i]):
                continue
            parent[b] = a  # merge cluster b into a, rewiring b's edges
            for x in c_succ.pop(b):
                c_pred[x].discard(b)
                if x != a:
                    c_pred[x].add(a)
                    c_succ[a].add(x)
            for x in c_pred.pop(b):
                c_succ[x].discard(b)
                if x != a:
                    c_succ[x].add(a)
                    c_pred[a].add(x)
    members: dict[int, list[int]] = {}
    for i in order:
        members.setdefault(find(i), []).append(i)
    first = {c: pos[m[0]] for c, m in members.items()}
    segments = [Segment(k, kinds[members[c][0]], members[c]) for k, c in enumerate(_topo(list(members), c_pred, first))]
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

    from tasks.onnxrt.ort import ort_session

    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    graph_inputs = {i.name for i in m.graph.input}
    for n in names:
        if n not in existing and n not in graph_inputs:
            m.graph.output.append(onnx.ValueInfoProto(name=n))
    sess = ort_session(m.SerializeToString(), stage="partition")
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
    runs = tensor_shapes(model, names, feeds)
    out = {}
    for name in runs[0]:
        shapes = [list(r[name][0]) for r in runs if name in r]
        if len({len(s) for s in shapes}) != 1:
            continue
        out[name] = {"min": [min(d) for d in zip(*shapes)], "opt": shapes[min(opt, len(shapes) - 1)],
                     "max": [max(d) for d in zip(*shapes)], "dtype": runs[0][name][1]}
    return out


# ONNX Runtime's profile names element types by its own names; numpy's where they differ
_PROFILE_DTYPES = {"float": "float32", "double": "float64"}


def tensor_shapes(model, names: list[str], feeds: list[dict[str, np.ndarray]]) -> list[dict[str, tuple[list, str]]]:
    """Per feed, {name: (shape, numpy dtype name)} of the named tensors, read from ONNX Runtime's profile of plain runs
    of the model (each node's output shapes): the model computes only its own outputs, so memory is one run's working
    set however many tensors are asked for. Exposing the tensors as outputs instead keeps every one of them alive until
    the run ends: a TTS model's 3,600 tensors at 64 tokens passed 8 GB that way, against 1.8 GB for the run itself.
    Names the profile does not give (an optional output, a type numpy has no name for) come from a run that exposes
    only those."""
    import json
    import tempfile

    import onnxruntime as ort

    from tasks.common.errors import StageError, cause

    g = model.graph
    wanted = set(names)
    given = {n for f in feeds for n in f}
    tag = "__trtforge_shape_"
    old = [n.name for n in g.node]
    for i, n in enumerate(g.node):  # one unique name per node: the profile's events are named by node
        n.name = f"{tag}{i}"
    try:
        data = model.SerializeToString()
    finally:
        for n, name in zip(g.node, old):
            n.name = name
    runs: list[dict[str, tuple[list, str]]] = []
    with tempfile.TemporaryDirectory(prefix="trtforge-shapes-") as d:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # nodes as written, one event each
        so.log_severity_level = 4
        # with its arena (kept for this session only): without it the unoptimized graph's many small allocations
        # passed 7 GB on a TTS model at 64 tokens where the arena peaked at 1.2 GB
        so.enable_cpu_mem_arena = True
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(d) / "run")
        try:
            sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise StageError(f"ONNX Runtime cannot load the model: {cause(e)}", stage="partition") from e
        del data
        outs = [o.name for o in sess.get_outputs()]
        for feed in feeds:
            got = {n: (list(v.shape), str(v.dtype)) for n, v in feed.items() if n in wanted}
            got.update((n, (list(v.shape), str(v.dtype))) for n, v in zip(outs, sess.run(outs, feed)) if n in wanted)
            runs.append(got)
        events = json.loads(Path(sess.end_profiling()).read_text())
    bounds = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "Node" or not name.startswith(tag) or not name.endswith("_kernel_time"):
            continue
        k = next((k for k, (a, b) in enumerate(bounds) if a <= e["ts"] <= b), None)
        node = g.node[int(name[len(tag):-len("_kernel_time")])]
        typed = e.get("args", {}).get("output_type_shape") or []
        present = [o for o in node.output if o]
        if k is None or k >= len(runs) or len(typed) != len(present):
            continue  # an optional output left out of the profile: asked for below
        for o, ts in zip(present, typed):
            if o in wanted and len(ts) == 1:
                (kind, shape), = ts.items()
                dtype = _PROFILE_DTYPES.get(kind, kind)
                if _numpy_dtype(dtype):
                    runs[k].setdefault(o, (list(shape), dtype))
    missing = [n for n in names if n not in given and any(n not in r for r in runs)]
    if missing:
        for r, exposed in zip(runs, run_with_intermediates(model, missing, feeds)):
            r.update((n, (list(v.shape), str(v.dtype))) for n, v in exposed.items())
    return runs


def _numpy_dtype(name: str) -> bool:
    try:
        np.dtype(name)
        return True
    except TypeError:
        return False


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
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(s["dtype"])), dims)

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


def trt_segments(plan: dict, plan_files: dict, whole_model: Path, profiles: list[dict]) -> list[dict]:
    """The TensorRT segments of a partition plan with their fp32 ONNX and profiles; a fully supported model is one
    segment, the whole graph."""
    if not plan.get("hybrid"):
        return [{"index": 0, "onnx": Path(whole_model), "profiles": profiles, "name": ""}]
    return [{"index": s["index"], "onnx": Path(plan_files[f"segment{s['index']}"]), "profiles": s["profiles"],
             "name": f".sg{s['index']}"} for s in plan["segments"] if s["kind"] == "trt"]


def segment_feeds(model_path: Path, plan: dict, segment: int, feeds: list[dict[str, np.ndarray]]) -> list[dict]:
    """What one TensorRT segment of a hybrid model sees when the model runs on ``feeds`` (the native parts in ONNX
    Runtime); the feeds themselves for a model that is one segment."""
    if not plan.get("hybrid"):
        return feeds
    import onnx

    names = next(s["inputs"] for s in plan["segments"] if s["index"] == segment)
    model = onnx.load(str(model_path))
    return [{n: r[n] for n in names} for r in run_with_intermediates(model, names, feeds)]


def all_segment_feeds(model_path: Path, plan: dict, feeds: list[dict[str, np.ndarray]]) -> dict[int, list[dict]]:
    """``segment_feeds`` for every TensorRT segment at once: one run of the model exposing every segment's inputs
    (a model of 119 segments is run once, not 119 times). {segment index: its feeds}."""
    trt = [s for s in plan.get("segments", []) if s.get("kind", "trt") == "trt"]
    if not plan.get("hybrid"):
        return {s["index"]: feeds for s in trt} or {0: feeds}
    import onnx

    names = list(dict.fromkeys(n for s in trt for n in s["inputs"]))
    runs = run_with_intermediates(onnx.load(str(model_path)), names, feeds)
    return {s["index"]: [{n: r[n] for n in s["inputs"]} for r in runs] for s in trt}


def composed_runner(plan: dict, graph_outputs: list[str], runner_for: Callable[[dict], Callable]) -> Callable:
    """The model as it runs: one runner per TensorRT segment (an engine, or its precision graph in ONNX Runtime) and
    ONNX Runtime for the native ones, composed in order; the single runner of a model that is one segment."""
    if plan.get("hybrid"):
        return Composed(plan["segments"], graph_outputs, runner_for)
    return runner_for({"kind": "trt", "index": 0})


def downstream_of(plan: dict, segment: int) -> list[dict]:
    """The segments of a hybrid plan that read ``segment``'s outputs, directly or through other segments, in the plan's
    (topological) order: what must run again when that segment's outputs change."""
    changed = set(next(s for s in plan["segments"] if s["index"] == segment)["outputs"])
    out = []
    for s in plan["segments"]:
        if s["index"] != segment and changed & set(s["inputs"]):
            out.append(s)
            changed |= set(s["outputs"])
    return out


class Rest:
    """The rest of a hybrid model around each of its TensorRT segments, on a fixed set of model feeds: a segment's
    candidate outputs in, the model's own outputs out. Everything a candidate does not change is computed once, by one
    fp32 run of the model per feed exposing every boundary tensor (``captures``); a candidate then runs only the
    segments downstream of its own (``downstream_of``), composed as validate composes them (``Composed``): native
    segments in ONNX Runtime, other TensorRT segments by ``runner_for`` (default: their fp32 graphs in ONNX Runtime;
    each segment's candidate is judged by the error it adds alone). ``refs``: the model's fp32 outputs per feed."""

    def __init__(self, model_path: Path, plan: dict, plan_files: dict, graph_outputs: list[str],
                 feeds: list[dict[str, np.ndarray]], runner_for: Callable[[dict], Callable] | None = None):
        import onnx

        from tasks.onnxrt.ort import ort_runner

        self.plan, self.graph_outputs, self.feeds = plan, list(graph_outputs), list(feeds)
        names = list(dict.fromkeys([n for s in plan["segments"] for n in (*s["inputs"], *s["outputs"])]
                                   + self.graph_outputs))
        self.captures = run_with_intermediates(onnx.load(str(model_path)), names, self.feeds)
        self.refs = [{o: c[o] for o in self.graph_outputs} for c in self.captures]
        self._runners: dict[int, Callable] = {}
        self._runner_for = runner_for or (lambda s: ort_runner(plan_files[f"segment{s['index']}"], arena=False))

    def runner(self, seg: dict) -> Callable:
        if seg["index"] not in self._runners:  # one session per segment, shared by every TensorRT segment's search
            self._runners[seg["index"]] = self._runner_for(seg)
        return self._runners[seg["index"]]

    def after(self, segment: int) -> "Through":
        """The model's outputs from ``segment``'s candidate outputs on feed k: ``Through(k, outputs)``."""
        return Through(self, Composed(downstream_of(self.plan, segment), self.graph_outputs, self.runner))


class Through:
    """One TensorRT segment's view of ``Rest``: ``self(k, outputs)`` is the model's outputs on ``feeds[k]`` with the
    segment's outputs replaced by ``outputs``; ``feeds`` and ``refs`` are the model's inputs and fp32 outputs. A
    candidate whose outputs the rest of the model cannot run on (ONNX Runtime fails) gets non-finite outputs, which
    every metric fails."""

    def __init__(self, rest: Rest, composed: Composed):
        self.rest, self.composed = rest, composed
        self.feeds, self.refs = rest.feeds, rest.refs

    def __call__(self, k: int, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tasks.common.errors import StageError

        try:
            return self.composed({**self.rest.captures[k], **outputs})
        except StageError:
            return {n: np.full(np.shape(r), np.nan, np.float32) for n, r in self.refs[k].items()}
