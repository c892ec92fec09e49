"""A run of nodes the TensorRT parser rejects as a whole, narrowed down to the runs it takes (as ONNX Runtime's TensorRT
provider does): each run is parsed alone and cut at the node the parser names, or at the end of the shortest prefix
that fails to parse when it names none."""
from __future__ import annotations

import re

from tasks.trt.backend import Backend


def refine(model, node_ids: list[int], backend: Backend, shapes: dict[str, dict], reasons: dict[int, str],
           depth: int = 0) -> list[list[int]]:
    """Split a node run that does not parse into runs that do (as ONNX Runtime's TensorRT provider does): parse the
    run alone; at the node the parser rejects, cut, record its reason, and recurse on both sides."""
    from tasks.partition.segments import io_of, submodel

    if not node_ids:
        return []
    ins, outs = io_of(model, node_ids)
    if any(n not in shapes for n in ins + outs) or depth > 200:
        for i in node_ids:
            reasons.setdefault(i, "could not be checked alone (no shape for its boundary tensors)")
        return []
    sub = submodel(model, node_ids, ins, outs, shapes, "check")
    errors = backend.parse_errors(sub.SerializeToString())
    if not errors:
        return [node_ids]
    k = errors[0]["node"]
    bad_init = re.findall(r"Failed to import initializer: ([^\s,;]+)$", (errors[0]["reason"] or "").strip())
    if not 0 <= k < len(node_ids) and bad_init:  # the parser imports every initializer before any node (node -1):
        name = bad_init[-1]  # the nodes that read this one stay native, the rest is checked again
        readers = [i for i in node_ids if name in model.graph.node[i].input]
        if readers:
            for i in readers:
                reasons[i] = f"reads initializer {name}, whose type TensorRT cannot import ({errors[0]['reason']})"
            runs, run = [], []
            for i in node_ids:
                if i in readers:
                    runs.append(run)
                    run = []
                else:
                    run.append(i)
            return [r for part in runs + [run] for r in refine(model, part, backend, shapes, reasons, depth + 1)]
    found = ""
    if not 0 <= k < len(node_ids) and len(node_ids) > 1:  # the parser names no node (an error about a tensor's
        k = _failing_prefix(model, node_ids, backend, shapes)  # shape found later): the shortest prefix that fails
        found = f" (the parser named no node: the shortest run of nodes that fails to parse ends here)" \
            if k is not None else ""
        k = -1 if k is None else k
    if not 0 <= k < len(node_ids):
        for i in node_ids:
            reasons.setdefault(i, errors[0]["reason"])
        return []
    reasons[node_ids[k]] = (errors[0]["reason"] or "rejected by the TensorRT ONNX parser") + found
    return refine(model, node_ids[:k], backend, shapes, reasons, depth + 1) + \
        refine(model, node_ids[k + 1:], backend, shapes, reasons, depth + 1)


def _failing_prefix(model, node_ids: list[int], backend: Backend, shapes: dict[str, dict]) -> int | None:
    """The index in ``node_ids`` (topological) of the last node of the shortest prefix that does not parse, by binary
    search (log2 of the run's length parses); None when a prefix's boundary shapes are unknown."""
    from tasks.partition.segments import io_of, submodel

    def parses(ids: list[int]) -> bool | None:
        ins, outs = io_of(model, ids)
        if any(n not in shapes for n in ins + outs):
            return None
        return not backend.parse_errors(submodel(model, ids, ins, outs, shapes, "check").SerializeToString())

    lo, hi = 0, len(node_ids)  # a prefix of lo nodes parses, the whole run (hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = parses(node_ids[:mid])
        if ok is None:
            return None
        lo, hi = (mid, hi) if ok else (lo, mid)
    return hi - 1
