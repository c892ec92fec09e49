"""Where a model's non-finite outputs (NaN, +inf, -inf) arise: the first node that makes them from finite inputs, and
the model inputs that reach it, found by running the model once with every value of its graph exposed.

A Log of a random noise level <= 0, a Where that writes NaN where a random mask is false, a Softmax over a row that
an all-False attention mask filled with -inf: the node names the cause, and the inputs that reach it are the ones to
give real values for (the rest of the model's inputs cannot have caused it)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from tasks.onnxrt.ort import ort_run, ort_session


def nonfinite_origins(model: Path | onnx.ModelProto, feed: dict[str, np.ndarray], outputs: list[str],
                      stage: str = "validate") -> dict[str, dict]:
    """Per output of ``outputs`` that is non-finite on ``feed``: ``{"node", "op", "inputs"}``: the first node (in
    graph order) among its producers whose output is non-finite while every float value it reads is finite, and the
    model inputs (not initializers) that reach that node. An output without such a node (a non-finite input, a node
    inside a subgraph) names the model inputs that reach the output, with ``node`` None."""
    m = onnx.load(str(model)) if not isinstance(model, onnx.ModelProto) else model
    g = m.graph
    inits = {t.name for t in g.initializer}
    graph_inputs = [i.name for i in g.input if i.name not in inits]
    producer = {o: n for n in g.node for o in n.output if o}
    exposed = onnx.ModelProto()
    exposed.CopyFrom(m)
    have = {o.name for o in exposed.graph.output}
    exposed.graph.output.extend(onnx.ValueInfoProto(name=o) for o in producer if o not in have)
    session = ort_session(exposed.SerializeToString(), stage=stage)
    values = {**feed, **ort_run(session, feed, stage=stage)}

    def bad(name: str) -> bool:
        a = values.get(name)
        if a is None:
            return False
        a = np.asarray(a)
        return a.dtype.kind in "fc" and not np.isfinite(a).all()

    def reaching(names: list[str]) -> list[str]:
        seen, stack, found = set(), list(names), set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in graph_inputs:
                found.add(v)
            n = producer.get(v)
            if n is not None:
                stack.extend(x for x in n.input if x)
        return [i for i in graph_inputs if i in found]

    def ancestors(name: str) -> set[str]:
        seen, stack = set(), [name]
        while stack:
            n = producer.get(stack.pop())
            if n is not None and n.name not in seen:
                seen.add(n.name or id(n))
                stack.extend(x for x in n.input if x)
        return seen

    first = [n for n in g.node if any(bad(o) for o in n.output if o) and not any(bad(x) for x in n.input if x)]
    out = {}
    for name in outputs:
        if not bad(name):
            continue
        above = ancestors(name)
        node = next((n for n in first if (n.name or id(n)) in above), None)
        out[name] = ({"node": node.name, "op": node.op_type, "inputs": reaching([x for x in node.input if x])}
                     if node is not None else {"node": None, "op": None, "inputs": reaching([name])})
    return out
