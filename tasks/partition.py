"""Stage 2, partition: which parts of the graph TensorRT can take (the parser's own verdict per node)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .backend import Backend
from .errors import StageError
from .util import StageResult, write_json


def plan_from_onnx(onnx_path: Path, partition_cfg: Any, backend: Backend, out_path: Path) -> StageResult:
    """Ask the TensorRT ONNX parser for supported subgraphs; write the partition report (JSON)."""
    import onnx

    t0 = time.perf_counter()
    model = onnx.load(str(onnx_path), load_external_data=False)
    nodes = model.graph.node
    report = backend.support_report(Path(onnx_path).read_bytes(), str(onnx_path))
    exclude = set(partition_cfg["exclude_ops"] or [])
    excluded = [i for i, n in enumerate(nodes) if n.op_type in exclude]
    trt_subgraphs = [sg["nodes"] for sg in report.subgraphs if sg["supported"]]
    covered = {i for sg in trt_subgraphs for i in sg}
    fallback = sorted(set(range(len(nodes))) - covered | set(excluded))
    reasons: dict[int, str] = {}
    for e in report.errors:
        if 0 <= e["node"] < len(nodes):
            reasons.setdefault(e["node"], e["reason"])
    for i in excluded:
        reasons.setdefault(i, "excluded by partition.exclude_ops")
    fallback_nodes = [{"index": i, "name": nodes[i].name, "op": nodes[i].op_type,
                       "reason": reasons.get(i, "outside every TensorRT-supported subgraph"),
                       "inputs": list(nodes[i].input), "outputs": list(nodes[i].output)} for i in fallback]
    plan = {
        "nodes": len(nodes),
        "fully_supported": report.fully_supported and not fallback,
        "subgraphs": [{"nodes": len(sg), "first": nodes[sg[0]].name if sg else None, "last": nodes[sg[-1]].name if sg else None}
                      for sg in trt_subgraphs],
        "fallback_nodes": fallback_nodes,
        "parser_errors": report.errors,
    }
    write_json(out_path, plan)
    metrics = {"trt_subgraphs": len(trt_subgraphs) if fallback else 1, "fallback_nodes": len(fallback),
               "partition_seconds": time.perf_counter() - t0}
    if fallback:
        shown = "; ".join(f"{f['name'] or '#' + str(f['index'])} ({f['op']}): {f['reason']}" for f in fallback_nodes[:5])
        more = f" and {len(fallback) - 5} more" if len(fallback) > 5 else ""
        raise StageError(
            f"{len(fallback)} of {len(nodes)} nodes cannot run in TensorRT: {shown}{more}",
            stage="partition", file=str(onnx_path),
            fix="replace the unsupported ops in the model (hybrid TensorRT + ONNX Runtime execution is not built yet); "
                f"the full report is in {out_path.name}")
    return StageResult(files={"partition": out_path}, metrics=metrics, details=plan)
