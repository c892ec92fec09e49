"""Outputs produced by a final Softmax, Sigmoid or LogSoftmax, judged on their logits too: which outputs those are,
the model with the logits added as outputs, and the cosine and allclose share on the logits."""
from __future__ import annotations

import numpy as np

from tasks.accuracy.metric import Feed, Metric, within_tolerance
from tasks.accuracy.metrics import cosine

LOGIT_OPS = ("Softmax", "Sigmoid", "LogSoftmax")


def final_activations(model) -> dict[str, dict[str, str]]:
    """Graph outputs produced by a Softmax, Sigmoid or LogSoftmax (through Identity nodes): {output: {"op", "logits":
    the op's input}}."""
    import onnx

    m = onnx.load(str(model), load_external_data=False) if not isinstance(model, onnx.ModelProto) else model
    producer = {o: n for n in m.graph.node for o in n.output}
    out = {}
    for o in m.graph.output:
        n = producer.get(o.name)
        while n is not None and n.op_type == "Identity" and n.input:  # (exporters end graphs with an Identity)
            n = producer.get(n.input[0])
        if n is not None and n.op_type in LOGIT_OPS and n.input:
            out[o.name] = {"op": n.op_type, "logits": n.input[0]}
    return out


def with_outputs(model, names: list[str]):
    """A copy of ``model`` (a path or ModelProto) with ``names`` added as graph outputs (those it has as values)."""
    import onnx

    m = onnx.load(str(model)) if not isinstance(model, onnx.ModelProto) else model
    c = onnx.ModelProto()
    c.CopyFrom(m)
    have = {o.name for o in c.graph.output}
    values = {o for n in c.graph.node for o in n.output}
    for n in names:
        if n not in have and n in values:
            c.graph.output.append(onnx.ValueInfoProto(name=n))
    return c


def logit_report(metric: Metric, finals: dict[str, dict], outputs: list[Feed], references: list[Feed]) -> dict:
    """Per output from a final Softmax/Sigmoid/LogSoftmax: cosine (pooled) and allclose share (the metric's
    tolerances for that output) on its logits, and whether they meet the metric's rule at the logit level (cosine:
    min_cosine; allclose: min_within; other metrics: not applicable)."""
    out = {}
    for name, f in finals.items():
        t = f["logits"]
        pairs = [(o[t], r[t]) for o, r in zip(outputs, references) if t in o and t in r]
        if not pairs:
            continue
        a = np.concatenate([np.asarray(r, np.float64).ravel() for _, r in pairs])
        b = np.concatenate([np.asarray(c, np.float64).ravel() for c, _ in pairs])
        atol, rtol = metric.tolerance(name)
        within = within_tolerance(b, a, atol, rtol)
        row = {"op": f["op"], "logits": t, "cosine": cosine(b, a), "allclose_within": float(within.mean()),
               "atol": atol, "rtol": rtol, "max_abs": float(np.abs(a - b).max(initial=0))}
        if metric.name == "cosine":
            row["passed"] = row["cosine"] >= metric.min_cosine
        elif metric.name == "allclose":
            row["passed"] = row["allclose_within"] >= metric.min_within
        out[name] = row
    return out
