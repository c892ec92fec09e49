"""What quantizing each layer costs, measured cheaply: the search's two instruments.

* ``Switchable``: ONE ONNX Runtime session of the all-layers Q/DQ graph in which every layer reads its quantized or
  its float inputs through a ``Where`` on a boolean graph input of its own. Any subset of layers is scored by feeding
  flags: no graph is rebuilt and no session made per candidate (those cost more than the run itself: ~0.3 s of the
  ~0.45 s per candidate on PP-OCRv4 det). The float remainder is what is written: fp16 (converted and emulated as
  validate does) or fp32.
* ``local_errors``: each layer's own output error when only its inputs and weights are quantized, from the fp32
  activations of one pass (ONE probe graph computes every layer's quantized output from the fp32 inputs). Cheap and
  per range method, so the activation range of each tensor is chosen by the error it causes where it is consumed
  (entropy, percentile, max or MSE of the histogram), not by a whole-model run per layer and method.
"""
from __future__ import annotations

import threading

import numpy as np
import onnx
from onnx import TensorProto, helper

from tasks.accuracy.nonfinite import on_finite_reference
from tasks.accuracy.metrics import cosine, pooled_cosine_of, pooled_estimate, pooled_sums
from tasks.common.memory import release_freed_memory
from tasks.graph.edit import redirect_reads
from tasks.graph.footprint import elem_types, itemsize, value_bytes
from tasks.onnxrt.ort import RunControl, ordered_runs, ort_run, ort_session, run_workers, runs_alone
from tasks.search.judging import meets_target, output_norms

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
    """Scores any subset of ``q.layers`` quantized (the rest at ``q.high_precision``, as written) on ``feeds`` against
    ``refs`` with one session."""

    def __init__(self, q, feeds: list[dict], refs: list[dict], z: float = 1.0, judge=None, through=None):
        full = q.qdq(q.layers)  # every layer quantized (fp32; the fp16 remainder is made below)
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
        self.high_precision = q.high_precision
        if q.high_precision == "fp16":  # the remainder as written (``q.model``) and emulated
            m = _fp16_emulated(m, q)
        # each int8 layer computed on its codes as the written graph's emulation computes it (tasks/onnxrt/codes.py),
        # switched as a whole; the rest of the switches (residual Adds' skip inputs) by input
        m = _layers_switched_on_codes(m, set(self.flags.values()))
        self.model = _switched_by_if(m, set(self.flags.values()))  # what the session runs
        # ``workers`` runs at once, on ``threads`` each (tasks.onnxrt.ort.ordered_runs); through the rest of a hybrid
        # model (other sessions, run for each output) one at a time on ONNX Runtime's threads
        # (one on every core where a run computes more than LARGE_RUN_BYTES of values: IS-Net at 1024x1024), and then
        # without an arena, which would keep the largest run's values while the search's other session runs
        largest = max(feeds, key=lambda f: sum(np.size(v) for v in f.values())) if feeds else {}
        held = run_bytes(q.base, largest)
        self.workers, threads = run_workers(held) if through is None else (1, 0)
        self.session = ort_session(self.model.SerializeToString(), stage=STAGE, threads=threads, mem_pattern=False,
                                   arena=not runs_alone(held))
        self._count = threading.Lock()
        self._control = RunControl()  # the judgement's runs, by feed index: stopped when started ahead of a refusal
        self.feeds, self.refs, self.z = feeds, refs, z
        # a segment of a hybrid model (tasks.partition.segments.Through): candidates are judged on the model's outputs,
        # the rest of the model run on the segment's outputs (feed k of ``feeds`` is the model's feed k, ``refs`` its
        # fp32 outputs)
        self.through = through
        self.judged_feeds = through.feeds if through is not None else feeds  # what a metric is given as the inputs
        self.judged_refs = through.refs if through is not None else refs
        # another accuracy metric's value of one feed, higher is better (tasks.accuracy.metric.SearchJudge.value):
        # judged on the worst feed; None: the pooled cosine less z standard errors
        self.judge = judge
        self.runs = 0  # whole-model runs (one feed each)
        self.stopped = 0  # runs started ahead of a refusal and stopped before their end (not in ``runs``)
        self._norms = output_norms(self.judged_refs)
        self._miss: dict[int, float] = {}  # per feed: the largest error share it showed (the hardest run first)
        self.last: tuple[float, float, float] | None = None  # (cosine, standard error, bound) of the last full judgement
        # each subset met (every feed run): (its figure as ``last``, {feed index: the lowest cosine of its outputs})
        self.met: dict[frozenset, tuple[tuple[float, float, float] | None, dict[int, float]]] = {}
        self._sums: dict[frozenset, dict[int, dict]] = {}  # each subset judged: its feeds' pooled_sums by index

    def cosines(self, names, feeds: list[dict] | None = None, refs: list[dict] | None = None) -> list[float]:
        """Per feed (default: the search feeds): the lowest cosine of any of the graph's own outputs to its reference
        with exactly ``names`` quantized (never through the rest of a hybrid model: the search's ranking)."""
        return self.cosines_each([names], feeds, refs)[0]

    def cosines_each(self, subsets: list, feeds: list[dict] | None = None,
                     refs: list[dict] | None = None) -> list[list[float]]:
        """``cosines`` of each of ``subsets``, their runs ``workers`` at a time across subsets (the screen's runs of one
        feed each would otherwise run one at a time on one thread). The same figures as one ``cosines`` each."""
        feeds, refs = feeds or self.feeds, refs or self.refs
        pairs = [(set(names), k) for names in subsets for k in range(len(feeds))]
        outs = ordered_runs(lambda p: self._run(p[0], feeds[p[1]]), pairs, self.workers)
        per = [min(cosine(got[k], refs[i][k]) for k in refs[i])
               for got, i in ((on_finite_reference(o, refs[k]), k) for o, (_, k) in zip(outs, pairs))]
        return [per[j * len(feeds):(j + 1) * len(feeds)] for j in range(len(subsets))]

    def outputs(self, names) -> list[dict]:
        """Per search feed, what is judged with exactly ``names`` quantized: the graph's outputs, or through the rest of
        a hybrid model the model's; where the reference is not finite, its values (``on_finite_reference``)."""
        on = set(names)
        outs = ordered_runs(lambda f: self._run(on, f), self.feeds, self.workers)
        return [on_finite_reference(out if self.through is None else self.through(k, out), self.judged_refs[k])
                for k, out in enumerate(outs)]

    def estimate(self, names) -> tuple[float, float, float]:
        """(figure, standard error, bound) on every search feed: the pooled cosine (``tasks.accuracy.metrics.pooled_estimate``),
        or another metric's worst feed (no standard error)."""
        outs = self.outputs(names)
        if self.judge is not None:
            w = min((self.judge(o, r, f) for o, r, f in zip(outs, self.judged_refs, self.judged_feeds)), default=1.0)
            self.last = (w, 0.0, w)
        else:
            self.last = pooled_estimate([pooled_sums(r, o) for o, r in zip(outs, self.judged_refs)], self.z)
        return self.last

    def meets(self, names, target: float, again: bool = False) -> bool:
        """Whether the pooled cosine of the search feeds, less ``z`` standard errors, reaches ``target`` with ``names``
        quantized (another metric: every feed's value). The feeds that erred most before run first, and a candidate is
        refused as soon as the feeds run so far prove it cannot reach ``target`` even pooled alone (their error
        orthogonal to the reference already exceeds what the whole set allows; another metric: the first feed below):
        most failing candidates are judged in a run or two. A run started ahead of a refusal is stopped (it holds a
        core, and nobody reads it), unless ``again``: the same subset is judged again next (every layer quantized,
        first against the budget, then raced against other ranges), so what ran ahead is kept for that judgement."""
        on, at = set(names), {id(f): k for k, f in enumerate(self.judged_feeds)}
        # the feeds this subset ran before (judged against another target: every layer quantized, first against the
        # budget, then raced against other ranges) are not run again
        sums = self._sums.setdefault(frozenset(on), {}) if self.judge is None else {}
        ok, last = meets_target(lambda f: self._judged(on, at[id(f)]), self.judged_feeds, self.judged_refs, target,
                                self._miss, self._norms, self.z, self.judge, sums, self.workers,
                                None if again else self._control.stop)
        if last is not None:
            self.last = last
        if ok and last is not None:
            self.met[frozenset(on)] = (last, {i: min((pooled_cosine_of(*v) for v in s.values()), default=1.0)
                                              for i, s in sums.items()})
        return ok

    def _judged(self, on: set, k: int) -> dict:
        ro = self._control.options(k)
        try:
            out = self._run(on, self.feeds[k], ro)
        except Exception:
            if ro.terminate:  # stopped ahead of a refusal: not a run of the model
                with self._count:
                    self.runs -= 1
                    self.stopped += 1
            raise
        finally:
            self._control.done(k, ro)
        return on_finite_reference(out if self.through is None else self.through(k, out), self.judged_refs[k])

    def _run(self, on: set, feed: dict, options=None) -> dict:
        flags = {f: np.array(n in on) for n, f in self.flags.items()}
        with self._count:  # runs may go on several threads (ordered_runs)
            self.runs += 1
        return ort_run(self.session, {**feed, **flags}, stage=STAGE, options=options)


def _layers_switched_on_codes(m: onnx.ModelProto, flags: set[str]) -> onnx.ModelProto:
    """Each layer whose activation and weight are switched by ``Where(flag, dequantized, float)`` on the same flag as
    one ``If`` on that flag: its then-branch the layer on its int8 codes (``tasks.onnxrt.codes.layer_from_codes``, what
    ``precision_runner`` computes for the written graph's int8 layers), its else-branch the layer on the float inputs,
    each branch with the chain only it reads (the activation's QuantizeLinear and its fp16 rounding; the float input's
    rounding). Layers the codes rewrite does not know keep their input switches."""
    from tasks.graph.edit import name_allocator, prune_unused
    from tasks.onnxrt.codes import layer_from_codes

    g = m.graph
    made = {o: n for n in g.node for o in n.output}
    inits = {t.name: t for t in g.initializer}
    fresh = name_allocator(g)

    def switch(v: str):
        w = made.get(v)
        return w if w is not None and w.op_type == "Where" and w.input[0] in flags else None

    plans = {}
    for n in g.node:
        sw = [switch(x) for x in n.input[:2]]
        if len(sw) < 2 or None in sw or sw[0].input[0] != sw[1].input[0]:
            continue
        quantized = onnx.NodeProto()
        quantized.CopyFrom(n)
        quantized.input[0], quantized.input[1] = sw[0].input[1], sw[1].input[1]
        quantized.output[0] = fresh(n.output[0] + "__int8")
        codes = layer_from_codes(quantized, made, inits, g, fresh)
        if codes is None:
            continue
        high = onnx.NodeProto()
        high.CopyFrom(n)
        high.input[0], high.input[1] = sw[0].input[2], sw[1].input[2]
        high.output[0] = fresh(n.output[0] + "__high")
        plans[id(n)] = (sw[0].input[0], codes, high)
    if not plans:
        return m
    nodes = []
    for n in g.node:
        if id(n) not in plans:
            nodes.append(n)
            continue
        flag, codes, high = plans[id(n)]
        then = helper.make_graph([*codes, helper.make_node("Identity", [codes[-1].output[0]], [n.output[0] + "__then"])],
                                 n.output[0] + "_then", [], [onnx.ValueInfoProto(name=n.output[0] + "__then")])
        other = helper.make_graph([high, helper.make_node("Identity", [high.output[0]], [n.output[0] + "__else"])],
                                  n.output[0] + "_else", [], [onnx.ValueInfoProto(name=n.output[0] + "__else")])
        nodes.append(helper.make_node("If", [flag], [n.output[0]], name=n.name, then_branch=then, else_branch=other))
    del g.node[:]
    g.node.extend(nodes)
    prune_unused(g, ops=("Where", *QDQ_OPS))
    _move_into_branches(g)
    return m


def _move_into_branches(g: onnx.GraphProto) -> None:
    """Into each ``If`` branch, the Q/DQ/Cast producers (not of constants) that only that branch reads, back along
    their inputs: a branch not taken computes nothing of its own."""
    made = {o: n for n in g.node for o in n.output}
    consts = {t.name for t in g.initializer}
    readers: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
        for b in (a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH):
            for x in {x for y in b.node for x in y.input}:
                readers[x] = readers.get(x, 0) + 1
    for o in g.output:
        readers[o.name] = readers.get(o.name, 0) + 1
    taken: set[int] = set()
    for n in g.node:
        if n.op_type != "If":
            continue
        for a in n.attribute:
            if a.type != onnx.AttributeProto.GRAPH:
                continue
            inner = {o for y in a.g.node for o in y.output}
            frontier = [x for y in a.g.node for x in y.input if x not in inner]
            chain = []
            while frontier:
                v = frontier.pop()
                p = made.get(v)
                if p is None or p.op_type not in ("QuantizeLinear", "DequantizeLinear", "Cast") or id(p) in taken or \
                        any(readers.get(o, 0) != 1 for o in p.output) or all(x in consts or not x for x in p.input):
                    continue
                taken.add(id(p))
                chain.append(p)
                frontier.extend(x for x in p.input if x not in consts)
            if chain:
                body = [onnx.NodeProto() for _ in chain]
                for c, p in zip(body, chain[::-1]):
                    c.CopyFrom(p)
                rest = list(a.g.node)
                del a.g.node[:]
                a.g.node.extend(body + rest)
    keep = [n for n in g.node if id(n) not in taken]
    del g.node[:]
    g.node.extend(keep)


def _switched_by_if(m: onnx.ModelProto, flags: set[str]) -> onnx.ModelProto:
    """Each switch ``Where(flag, quantized, float)`` as an ``If`` on its flag, the quantized input's own chain (its
    activation's QuantizeLinear, DequantizeLinear and fp16 rounding, read by nothing else) moved into the branch that
    takes it: a layer left at high precision computes no Q/DQ, and neither branch copies a tensor (a Where over every
    element of an activation costs a third of a run on PP-OCRv4 det). The same ops on the same values: the same
    numbers. Chains of constants (a weight's DequantizeLinear) stay outside, where ONNX Runtime folds them."""
    g = m.graph
    made = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    for o in g.output:
        readers[o.name] = readers.get(o.name, 0) + 1
    consts = {t.name for t in g.initializer}
    moved: dict[int, list] = {}
    taken: set[int] = set()
    for n in g.node:
        if n.op_type != "Where" or not n.input or n.input[0] not in flags:
            continue
        chain, frontier = [], [n.input[1]]
        while frontier:  # the producers of the quantized input that only it reads, back to the activation
            v = frontier.pop()
            p = made.get(v)
            if p is None or p.op_type not in ("QuantizeLinear", "DequantizeLinear", "Cast") or id(p) in taken or \
                    any(readers.get(o, 0) != 1 for o in p.output) or all(x in consts or not x for x in p.input):
                continue
            chain.append(p)
            frontier.extend(p.input[:1])
        if chain and not any(x in consts for x in chain[-1].input[:1]):
            taken.update(id(p) for p in chain)
            moved[id(n)] = chain[::-1]
    nodes = []
    for n in g.node:
        if id(n) in taken:
            continue
        if n.op_type != "Where" or not n.input or n.input[0] not in flags:
            nodes.append(n)
            continue
        flag, quantized, high = n.input
        out = n.output[0]
        branch = []
        for p in moved.get(id(n), []):
            c = onnx.NodeProto()
            c.CopyFrom(p)
            branch.append(c)
        then_out, else_out = out + "__then", out + "__else"
        then = helper.make_graph([*branch, helper.make_node("Identity", [quantized], [then_out])], out + "_then", [],
                                 [onnx.ValueInfoProto(name=then_out)])
        other = helper.make_graph([helper.make_node("Identity", [high], [else_out])], out + "_else", [],
                                  [onnx.ValueInfoProto(name=else_out)])
        nodes.append(helper.make_node("If", [flag], [out], name=n.name, then_branch=then, else_branch=other))
    del g.node[:]
    g.node.extend(nodes)
    return m


def _fp16_emulated(m: onnx.ModelProto, q) -> onnx.ModelProto:
    """The switchable graph with its float remainder in fp16 as ``q.model`` writes it (the same converter, the same
    fp32 keeps), rounded as validate emulates it (tasks.onnxrt.emulate.fp16_rounded): a quantized layer's flag off reads
    the fp16 tensor and fp16 weights, as the written graph's unquantized layer does. The search then judges the graph
    that ships, not its fp32-remainder sibling: on PP-OCRv4 det's flat text pages the two differ by up to 0.012 per
    page (int8 rounding of a flat background lands on either side of a step, so a tiny change of its value flips the
    page)."""
    from tasks.onnxrt.emulate import fp16_rounded

    m, _ = q.fp16(m)
    r = fp16_rounded(m)
    if r is None:  # control flow: ONNX Runtime's own fp16 execution, as precision_runner runs it
        return m
    return _without_exact_rounding(r)


# ops whose output is one of their inputs' values (selected, reordered, clipped to bounds of the same type): fed fp16
# values they make fp16 values, so rounding their output to fp16 changes nothing
SELECTING_OPS = frozenset({"Where", "Relu", "Clip", "Concat", "MaxPool", "GlobalMaxPool", "Max", "Min", "ReduceMax",
                           "ReduceMin", "Reshape", "Transpose", "Slice", "Split", "Squeeze", "Unsqueeze", "Flatten",
                           "Identity", "Expand", "Tile", "Gather", "DepthToSpace", "SpaceToDepth", "Neg", "Abs", "Pad"})


def _without_exact_rounding(m: onnx.ModelProto) -> onnx.ModelProto:
    """The emulated graph without the fp16 rounding (a Cast to fp16 and back, tasks.onnxrt.emulate.fp16_rounded) of
    values that ``SELECTING_OPS`` make: such a value is fp16 in the written graph, so are the inputs it is selected
    from (ONNX types them alike) and the emulation rounded those where they were made: the rounding is the identity. The
    switchable graph computes the same numbers with fewer passes over the activations (PP-OCRv4 det: 173 of 466
    roundings, those after its Where switches, Clip and Relu)."""
    g = m.graph
    made = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    outputs = {o.name for o in g.output}
    drop, rename = set(), {}
    for n in g.node:  # raw -(Cast to fp16, "…_round")-> half -(Cast to fp32)-> back
        if n.op_type != "Cast" or not n.name.endswith("_round") or n.input[0] not in made:
            continue
        src, half = made[n.input[0]], n.output[0]
        if src.op_type not in SELECTING_OPS or src.domain not in ("", "ai.onnx") or half in outputs:
            continue
        back = readers.get(half, [])
        if len(back) != 1 or back[0].op_type != "Cast" or len(readers.get(n.input[0], [])) != 1:
            continue
        drop.update((id(n), id(back[0])))
        rename[back[0].output[0]] = n.input[0]
    if not drop:
        return m
    keep = [n for n in g.node if id(n) not in drop]
    for o in g.output:  # a rounded value that is a graph output keeps its name: the raw value is made under it
        if o.name in rename:
            raw = rename.pop(o.name)
            for n in keep:
                n.output[:] = [o.name if x == raw else x for x in n.output]
            rename[raw] = o.name  # a control-flow body that reads the raw value reads it under its new name
    # control-flow bodies too (Silero VAD's decoder If reads its encoder's Relu from the outer scope)
    redirect_reads(keep, rename)
    del g.node[:]
    g.node.extend(keep)
    return m


def probe_parts(q, full: onnx.ModelProto, fp32: onnx.ModelProto, layers=None) -> tuple[list, list[str], dict[str, str]]:
    """The nodes computing each of ``layers`` (default: all of ``q.layers``) from fp32 activations with only that layer
    quantized: the layer nodes and the Q/DQ nodes that feed them in the all-layers graph ``full``, each layer's other
    inputs (and its Q's inputs) read from graph inputs. Returns (nodes, their input names, {layer: the fp32 output it
    approximates})."""
    g = full.graph
    layers = set(q.layers if layers is None else layers)
    made_by = {o: n for n in g.node if n.op_type in QDQ_OPS for o in n.output}
    inits = {t.name for t in g.initializer}
    keep, seen = [], set()
    todo = [n for n in g.node if n.name in layers]
    while todo:  # the layers and the Q/DQ chains that feed them
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        keep.append(n)
        todo.extend(made_by[x] for x in n.input if x in made_by)
    order = {id(n): k for k, n in enumerate(g.node)}
    keep.sort(key=lambda n: order[id(n)])
    qdq_out = {o for n in keep if n.op_type in QDQ_OPS for o in n.output}
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
    need, outputs = _fp32_names(fp32, nodes, need, outputs)
    return nodes, need, outputs


def probe_model(q, full: onnx.ModelProto, fp32: onnx.ModelProto, layers=None,
                value_info: dict | None = None) -> tuple[onnx.ModelProto, list[str], dict[str, str]]:
    """The graph of ``probe_parts`` (``layers``: default all): it computes every layer's output from fp32 activations
    with only that layer quantized. ``value_info``: the fp32 model's values by name (shape inferred; default: inferred
    here). Returns (model, its input names, {layer: the fp32 output it approximates})."""
    nodes, need, outputs = probe_parts(q, full, fp32, layers)
    if value_info is None:
        value_info = fp32_value_info(fp32)
    inputs = [value_info[x] if x in value_info else helper.make_tensor_value_info(x, TensorProto.FLOAT, None)
              for x in need]
    graph = helper.make_graph(nodes, "probe", inputs, [onnx.ValueInfoProto(name=o + "__quantized")
                                                      for o in outputs.values()], list(full.graph.initializer))
    m = helper.make_model(graph, opset_imports=full.opset_import)
    m.ir_version = full.ir_version
    return m, need, outputs


def fp32_value_info(fp32: onnx.ModelProto) -> dict:
    m32 = onnx.shape_inference.infer_shapes(fp32)
    return {v.name: v for v in (*m32.graph.value_info, *m32.graph.input, *m32.graph.output)}


def _fp32_names(fp32: onnx.ModelProto, nodes: list, need: list[str], outputs: dict[str, str]):
    """A quantized tensor that is also a graph output (a segment's boundary) keeps its name on the DequantizeLinear's
    output, and its producer's output is renamed ``<name>_QuantizeLinear_Input`` (ONNX Runtime's quantizer): the probe
    reads such a value from the fp32 model under its own name, and its DequantizeLinear's output gets another."""
    from onnxruntime.quantization.quant_utils import QUANT_INPUT_SUFFIX

    made = {i.name for i in fp32.graph.input} | {o for n in fp32.graph.node for o in n.output}
    back = {x: x[:-len(QUANT_INPUT_SUFFIX)] for x in (*need, *outputs.values())
            if x not in made and x.endswith(QUANT_INPUT_SUFFIX) and x[:-len(QUANT_INPUT_SUFFIX)] in made}
    if not back:
        return need, outputs
    clash = {b: b + "__dequantized" for b in back.values()}
    layer_out = {x + "__quantized": b + "__quantized" for x, b in back.items()}
    for c in nodes:
        c.input[:] = [back.get(x) or clash.get(x, x) for x in c.input]
        c.output[:] = [layer_out.get(x) or clash.get(x, x) for x in c.output]
    return [back.get(x, x) for x in need], {k: back.get(v, v) for k, v in outputs.items()}


HELD_BYTES = 4 << 30  # the values the local errors of a group of layers hold at once (one feed's captured values and
# one method's probed outputs): more layers than fit go in groups, each captured again


def local_errors(quantizers: dict[str, object], fp32_path, feeds: list[dict],
                 worst: bool = False) -> dict[str, dict[str, float]]:
    """{method: {layer: relative squared error of the layer's output when only that layer is quantized with
    ``method``'s ranges}}, from one fp32 pass per feed (per feed and group of layers where their values would hold
    more than HELD_BYTES). ``quantizers``: {method: Quantizer}. Pooled over ``feeds``, or with ``worst`` the largest of
    any single feed: a range that clips suits most samples and fails the few whose values reach past it (PP-OCRv4
    det: pages in large type), which a pooled error hides."""
    fp32 = onnx.load(str(fp32_path))
    fulls = {method: q.qdq(q.layers) for method, q in quantizers.items()}
    parts = {method: probe_parts(q, fulls[method], fp32) for method, q in quantizers.items()}
    names = list(dict.fromkeys(x for _, need, outs in parts.values() for x in (*need, *outs.values())))
    # what one feed holds: its captured values and every method's probed outputs, at the largest feed's shapes
    largest = max(feeds, key=lambda f: sum(np.size(v) for v in f.values())) if feeds else {}
    sizes = _value_sizes(fp32, names, largest)
    held = sum(sizes.get(x, 0) for x in names) + sum(
        sizes.get(o, 0) for _, _, outs in parts.values() for o in outs.values())
    # feeds captured and probed a few at a time (tasks.onnxrt.ort.ordered_runs); past LARGE_RUN_BYTES one at a time,
    # one method's outputs at a time, sessions without an arena
    big = runs_alone(held)
    workers, threads = run_workers(held)
    layers = list(next(iter(quantizers.values())).layers) if quantizers else []
    groups = _layer_groups(layers, parts, sizes, HELD_BYTES) if held > HELD_BYTES else [layers]
    value_info = fp32_value_info(fp32)
    num = {method: {} for method in quantizers}
    den: dict[str, float] = {}
    top = {method: {} for method in quantizers}
    for k, group in enumerate(groups):
        probes = {method: probe_model(q, fulls[method], fp32, group, value_info) for method, q in quantizers.items()}
        if k == len(groups) - 1:
            fulls.clear()  # each a copy of the model's weights, as is each probe: not held while the feeds run
        captured = list(dict.fromkeys(x for _, need, outs in probes.values() for x in (*need, *outs.values())))
        # one capture session for every feed (one each: ~0.5 s on PP-OCRv4 det), of the group's values alone
        capture = _Capture(fp32, captured, threads)
        _accumulate(probes, capture, feeds, workers, threads, big, num, den, top)
        del capture
    if worst:
        return top
    return {method: {layer: _rel(v, den.get(layer, 0.0)) for layer, v in errs.items()} for method, errs in num.items()}


def _value_sizes(fp32: onnx.ModelProto, names: list[str], feed: dict) -> dict[str, int]:
    """{name: bytes} of the fp32 model's values ``names`` at ``feed``'s shapes: from shape inference where it knows
    them all, else measured by a run (``_measured_sizes``; IS-Net: inference knows 14 of its 578 values)."""
    known = value_bytes(fp32, {k: list(np.shape(v)) for k, v in feed.items()})
    if all(x in known for x in names):
        return {x: known[x][0] for x in names}
    return _measured_sizes(fp32, names, feed)


_RUN_BYTES: dict = {}  # (id of a graph, its node count, its feed's shapes) -> its run's bytes (a graph is not held:
# an id reused by another graph of as many nodes at the same shapes only changes how many runs go at once)


def run_bytes(model: onnx.ModelProto, feed: dict) -> int:
    """The bytes of every value a run of ``model`` computes at ``feed``'s shapes (more than one run holds at once:
    ONNX Runtime frees a value after its last reader), 0 where they cannot be measured; memoised per graph and
    shapes (a search makes several sessions of one graph)."""
    key = (id(model), len(model.graph.node), tuple(sorted((k, tuple(np.shape(v))) for k, v in feed.items())))
    if key not in _RUN_BYTES:
        names = list(dict.fromkeys([*(i.name for i in model.graph.input), *(o for n in model.graph.node
                                                                            for o in n.output if o)]))
        try:
            sizes = _value_sizes(model, names, feed)
        except Exception:  # noqa: BLE001 - a value Shape cannot take (a sequence): not known, runs as any other
            sizes = {}
        while len(_RUN_BYTES) >= 16:
            _RUN_BYTES.pop(next(iter(_RUN_BYTES)))
        _RUN_BYTES[key] = sum(sizes.values())
    return _RUN_BYTES[key]


def _rel(v: float, d: float) -> float:
    return v / d if d else (0.0 if v == 0 else float("inf"))


def _layer_groups(layers: list[str], parts: dict, sizes: dict[str, int], limit: int) -> list[list[str]]:
    """``layers`` in runs (graph order) whose values (each layer's fp32 inputs and output, and one method's probed
    output) hold at most ``limit`` bytes together; a layer larger than that alone."""
    reads: dict[str, set[str]] = {n: set() for n in layers}  # each layer's captured values
    for nodes, need, outs in parts.values():
        made, needs = {o: c for c in nodes for o in c.output}, set(need)
        for layer, o in outs.items():
            reads.setdefault(layer, set()).add(o)
            todo, seen = [made[o + "__quantized"]], set()
            while todo:  # the layer's node and the Q/DQ chains feeding it, back to the values they read
                c = todo.pop()
                if id(c) in seen:
                    continue
                seen.add(id(c))
                for x in c.input:
                    if x in needs:
                        reads[layer].add(x)
                    elif x in made:
                        todo.append(made[x])
    out_of = {layer: o for _, _, outs in parts.values() for layer, o in outs.items()}
    groups: list[list[str]] = []
    held: set[str] = set()
    used = 0
    def cost(values: set[str], n: str) -> int:  # the values, and the layer's probed output beside them
        return sum(sizes.get(x, 0) for x in values) + sizes.get(out_of.get(n), 0)

    for n in layers:
        mine = reads.get(n, set())
        if groups and used + cost(mine - held, n) <= limit:
            groups[-1].append(n)
            used += cost(mine - held, n)
            held |= mine
        else:
            groups.append([n])
            held, used = set(mine), cost(mine, n)
    return groups


def _accumulate(probes: dict, capture, feeds: list[dict], workers: int, threads: int, big: bool,
                num: dict, den: dict, top: dict) -> None:
    """Each probed layer's squared error (``num``, ``top``: the worst feed's share) and its fp32 output's squared norm
    (``den``) over ``feeds``, from ``probes`` ({method: probe_model(...)}): its fp32 values captured once per feed,
    every method's outputs at once (``big``: one at a time, sessions without an arena)."""
    sessions = {method: ort_session(m.SerializeToString(), stage=STAGE, threads=threads, arena=not big)
                for method, (m, _, _) in probes.items()}

    def probe(method: str, cap: dict) -> dict:
        return ort_run(sessions[method], {x: cap[x] for x in probes[method][1]}, stage=STAGE)

    def probed(feed: dict) -> tuple[dict, dict | None]:
        cap = capture(feed)
        return cap, None if big else {method: probe(method, cap) for method in probes}

    first = next(iter(probes))
    for cap, by_method in ordered_runs(probed, feeds, workers):
        norms: dict[str, float] = {}  # each fp32 output's squared norm, once per feed
        finite: dict[str, np.ndarray] = {}  # where an fp32 output holds NaN/inf: its finite places (judged alone)
        for method, (_, need, outs) in probes.items():
            got = by_method.pop(method) if by_method is not None else probe(method, cap)
            for layer, o in outs.items():
                if o not in norms:
                    norms[o] = _square_sum(np.array(cap[o], dtype=np.float32))
                    if not np.isfinite(norms[o]):  # no range approaches a NaN/inf of the fp32 model
                        finite[o] = np.isfinite(cap[o])
                        norms[o] = _square_sum(np.array(cap[o][finite[o]], dtype=np.float32))
                r = norms[o]
                quantized, exact = got[o + "__quantized"], cap[o]
                if o in finite:
                    quantized, exact = quantized[finite[o]], exact[finite[o]]
                e = _square_sum(np.subtract(quantized, exact, dtype=np.float32))
                num[method][layer] = num[method].get(layer, 0.0) + e
                top[method][layer] = max(top[method].get(layer, 0.0), _rel(e, r))
                if method == first:
                    den[layer] = den.get(layer, 0.0) + r
            del got
        del cap, by_method  # not held while the next feed is captured
        if big:
            release_freed_memory()


def _square_sum(x: np.ndarray) -> float:
    """Sum of x**2 (x float32, squared in place), accumulated in float64: half the time of converting x to float64
    first (local errors: 72 layers x 3 ranges x 8 feeds of PP-OCRv4 det); the float32 squares are within 6e-8 of
    float64's, far below any difference between two ranges' errors."""
    np.square(x, out=x)
    return float(x.sum(dtype=np.float64))


class _Capture:
    """feed -> {name: array} of the fp32 model's values ``names`` (graph inputs included), from one session of
    ``threads`` threads (0: ONNX Runtime's default) without an arena. Each of ``names`` is a graph output of its
    session, and ONNX Runtime holds every graph output to the end of a run, fetched or not: a group of values is
    captured by a session of its own."""

    def __init__(self, model: onnx.ModelProto, names: list[str], threads: int = 0):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        inputs = {i.name for i in m.graph.input}
        have = {o.name for o in m.graph.output}
        m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in have and n not in inputs)
        self.session = ort_session(m.SerializeToString(), stage=STAGE, threads=threads, arena=False)
        self.fetch = [n for n in names if n not in inputs]
        self.names = names

    def __call__(self, feed: dict) -> dict:
        env = dict(zip(self.fetch, self.session.run(self.fetch, feed)))
        env.update(feed)
        return {n: env[n] for n in self.names if n in env}


def _measured_sizes(model: onnx.ModelProto, names: list[str], feed: dict) -> dict[str, int]:
    """{name: bytes} of ``model``'s values ``names`` at ``feed``'s shapes, from one run of a session whose outputs are
    only their shapes (no value is held past its last reader) on every core without an arena; an element of a type
    shape inference does not name counts 4 bytes."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inputs = {i.name for i in m.graph.input}
    del m.graph.output[:]
    shape_of = {n: f"{n}__trtforge_shape" for n in names if n not in inputs}
    m.graph.node.extend(helper.make_node("Shape", [n], [s], name=s) for n, s in shape_of.items())
    m.graph.output.extend(helper.make_tensor_value_info(s, TensorProto.INT64, None) for s in shape_of.values())
    session = ort_session(m.SerializeToString(), stage=STAGE, arena=False)
    shapes = dict(zip(shape_of, session.run(list(shape_of.values()), {k: v for k, v in feed.items() if k in inputs})))
    types = elem_types(model)
    out = {n: int(np.prod(s, dtype=np.int64)) * (itemsize(types.get(n)) or 4) for n, s in shapes.items()}
    out.update({n: int(np.asarray(v).nbytes) for n, v in feed.items() if n in names})
    return out
