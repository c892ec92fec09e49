"""Stage 2, partition: TensorRT where it can, native ONNX Runtime elsewhere (Paddle Inference's subgraph rule).

The TensorRT ONNX parser gives its verdict per node (`supports_model_v2`); supported subgraphs smaller than
`partition.min_subgraph_size` and ops in `partition.exclude_ops` stay native; `partition.strict` fails instead of
falling back. A fully supported model is one segment: the whole graph, one engine.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tasks.trt.backend import Backend
from tasks.common.errors import StageError, cause
from tasks.partition.segments import Segment, boundary_names, extract_segment, segments_from_assignment, shape_ranges
from tasks.common.util import StageResult, write_json

FRAGMENTED = 4  # more TensorRT segments than this: boundaries likely cost more than TensorRT saves


def plan_from_onnx(onnx_path: Path, partition_cfg: Any, backend: Backend, out_dir: Path,
                   profile_feeds: list[list[dict[str, np.ndarray]]] | Callable[[], list]) -> StageResult:
    """Write partition.json, graph.png and, for a hybrid model, one fp32 ONNX per segment.

    profile_feeds: per model profile, feeds at its [min, opt, max] shapes (to propagate shapes to boundaries),
    or a callable making them (only a model that does not fully parse needs them).
    """
    import onnx

    if callable(profile_feeds):
        make_feeds = profile_feeds
        profile_feeds = None

    def feeds() -> list:
        nonlocal profile_feeds
        if profile_feeds is None:
            profile_feeds = make_feeds()
        return profile_feeds

    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(onnx_path))
    nodes = model.graph.node
    with_parser = backend.support_report(Path(onnx_path).read_bytes(), str(onnx_path))
    reasons: dict[int, str] = {}
    for e in with_parser.errors:
        if 0 <= e["node"] < len(nodes):
            reasons.setdefault(e["node"], e["reason"] or "not supported by the TensorRT ONNX parser")
    exclude = set(partition_cfg["exclude_ops"] or [])
    trt_domains = set(partition_cfg.get("trt_domains", ["trt", "trt.plugins"]) or []) | {"", "ai.onnx"}
    foreign = {i for i, n in enumerate(nodes) if n.domain not in trt_domains}
    for i in foreign:
        reasons.setdefault(i, f"op {nodes[i].op_type} of domain {nodes[i].domain} runs in ONNX Runtime (TensorRT's parser reads "
                      f"ops by name only; add the domain to partition.trt_domains to let TensorRT take it)")
    trt_nodes: set[int] = set()
    small: list[int] = []
    supported = [sg["nodes"] for sg in with_parser.subgraphs if sg["supported"]]
    unsupported = [sg["nodes"] for sg in with_parser.subgraphs if not sg["supported"]]
    if unsupported:  # the parser's subgraphs are coarse: narrow each failing one down to the nodes that fail
        every = [o for n in model.graph.node for o in n.output if o] + [i.name for i in model.graph.input]
        shapes = _shape_ranges(model, every, [f for fs in feeds() for f in fs[:2]], onnx_path)
        for sg in unsupported:
            supported += refine(model, sg, backend, shapes, reasons)
    for sg in supported:
        keep = [i for i in sg if nodes[i].op_type not in exclude and i not in foreign]
        trt_nodes.update(keep)
    # nodes TensorRT parsed but could not build (the build stage's fallback found them): native, with the builder's words
    for k, why in (partition_cfg.get("exclude_nodes") or {}).items():
        if 0 <= int(k) < len(nodes):
            trt_nodes.discard(int(k))
            reasons[int(k)] = why
    for i in range(len(nodes)):
        if nodes[i].op_type in exclude:
            reasons[i] = f"excluded by partition.exclude_ops ({nodes[i].op_type})"
        elif i not in trt_nodes:
            reasons.setdefault(i, "outside every subgraph the TensorRT parser supports")
    native_shape_inputs(nodes, trt_nodes, reasons)
    segments = segments_from_assignment(model, trt_nodes)
    hybrid = any(s.kind == "native" for s in segments)
    if hybrid:  # Paddle's min_subgraph_size: small TensorRT islands stay native
        min_size = int(partition_cfg["min_subgraph_size"])
        for s in segments:
            if s.kind == "trt" and len(s.nodes) < min_size:
                small += s.nodes
                for i in s.nodes:
                    reasons[i] = f"in a TensorRT subgraph of {len(s.nodes)} nodes < partition.min_subgraph_size={min_size}"
        if small:
            trt_nodes -= set(small)
            native_shape_inputs(nodes, trt_nodes, reasons)
            segments = segments_from_assignment(model, trt_nodes)
    fallback = [i for i in range(len(nodes)) if i not in trt_nodes]
    fallback_nodes = [{"index": i, "name": nodes[i].name, "op": nodes[i].op_type,
                       "domain": nodes[i].domain or "ai.onnx", "reason": reasons.get(i, ""),
                       "inputs": [x for x in nodes[i].input if x], "outputs": list(nodes[i].output)} for i in fallback]
    trt_segments = [s for s in segments if s.kind == "trt"]
    files: dict[str, Path] = {}
    plan: dict[str, Any] = {"nodes": len(nodes), "hybrid": hybrid, "fallback_nodes": fallback_nodes,
                            "parser_errors": with_parser.errors, "warnings": []}

    def report_and_fail(msg: str, fix: str) -> None:
        plan["segments"] = [s.as_dict() for s in segments]
        write_json(out_dir / "partition.json", plan)
        shown = "; ".join(f"{f['name'] or '#' + str(f['index'])} ({f['op']}): {f['reason']}" for f in fallback_nodes[:4])
        raise StageError(f"{msg}: {shown}" + (f" and {len(fallback) - 4} more" if len(fallback) > 4 else ""),
                         stage="partition", file=str(onnx_path), fix=fix)

    if not trt_segments:
        report_and_fail(f"TensorRT can take none of the {len(nodes)} nodes",
                        "run this model with ONNX Runtime, or replace its unsupported ops")
    if fallback and partition_cfg["strict"]:
        report_and_fail(f"partition.strict=true and {len(fallback)} of {len(nodes)} nodes would fall back to ONNX Runtime",
                        "set partition.strict=false to run them natively, or replace those ops")
    if hybrid:
        shapes = [_shape_ranges(model, boundary_names(segments), fs, onnx_path) for fs in feeds()]
        for s in segments:
            s.onnx = f"segment{s.index}.{s.kind}.onnx"
            extract_segment(model, s, shapes[0], out_dir / s.onnx)
            files[f"segment{s.index}"] = out_dir / s.onnx
            if s.kind == "trt":
                s.profiles = [{n: {k: sh[n][k] for k in ("min", "opt", "max")} for n in s.inputs} for sh in shapes]
        boundaries = sum(len(s.inputs) for s in segments[1:])
        plan["boundary_tensors"] = boundaries
        if len(trt_segments) > FRAGMENTED:
            from tasks.prequant.detect import DYNAMIC_OPS

            dynamic = sum(1 for i in fallback if nodes[i].op_type in DYNAMIC_OPS)
            plan["warnings"].append(
                f"fragmented: {len(trt_segments)} TensorRT subgraphs and {boundaries} boundary tensors; each boundary is a "
                "copy and a sync, so this can be slower than running natively (" + (
                    f"{dynamic} of the native nodes are dynamic quantization, which TensorRT has no kernels for: "
                    "model.dequantize_dynamic=true builds them as float layers in TensorRT" if dynamic else
                    "raise partition.min_subgraph_size or replace the unsupported ops") + ")")
    plan["segments"] = [s.as_dict() for s in segments]
    write_json(out_dir / "partition.json", plan)
    files["partition"] = out_dir / "partition.json"
    if hybrid:  # a fully supported model is one green island: no picture needed
        try:
            files["graph"] = draw_partition(model, segments, out_dir / "partition.png")
        except Exception as e:  # a picture is a nicety
            plan["warnings"].append(f"no graph picture: {e}")
    metrics = {"trt_subgraphs": len(trt_segments), "fallback_nodes": len(fallback),
               "trt_nodes": len(trt_nodes), "partition_seconds": time.perf_counter() - t0}
    return StageResult(files=files, metrics=metrics, details=plan)


# inputs TensorRT reads as shape tensors (values needed at build time, per profile), by op and input position
SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "ConstantOfShape": (0,),
                "Resize": (1, 2, 3), "Upsample": (1,), "Pad": (1, 3), "TopK": (1,), "Range": (0, 1, 2), "OneHot": (1,),
                "Squeeze": (1,), "Unsqueeze": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
                "ReduceMin": (1,), "ReduceProd": (1,), "ReduceL2": (1,), "CumSum": (1,), "Split": (1,),
                "NonMaxSuppression": (2,), "RandomNormalLike": (), "Trilu": (1,)}


def native_shape_inputs(nodes, trt_nodes: set[int], reasons: dict[int, str]) -> None:
    """Never cut at a shape tensor: a TensorRT node whose shape input (a Reshape's shape, a Slice's starts, ...) comes
    from a node that runs natively would make it a segment input whose values the engine needs at build time; such a
    node runs natively too (repeated until no cut is left)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    changed = True
    while changed:
        changed = False
        for i in sorted(trt_nodes):
            n = nodes[i]
            for pos in SHAPE_INPUTS.get(n.op_type, ()):
                x = n.input[pos] if pos < len(n.input) else ""
                j = producer.get(x)
                if x and j is not None and j not in trt_nodes:
                    trt_nodes.discard(i)
                    reasons[i] = (f"reads {x!r} as a shape (input {pos} of {n.op_type}) from a node that runs in ONNX "
                                  "Runtime: a segment input TensorRT would need the values of at build time")
                    changed = True
                    break


def _shape_ranges(model, names: list[str], feeds: list, onnx_path: Path) -> dict[str, dict]:
    """Shapes of tensors from running the fp32 model in ONNX Runtime: nodes TensorRT cannot take must run there."""
    try:
        return shape_ranges(model, names, feeds)
    except Exception as e:
        raise StageError(f"the model cannot run in ONNX Runtime either, where the nodes TensorRT cannot take would run: "
                         f"{cause(e)}", stage="partition", file=str(onnx_path),
                         fix="register the custom op's ONNX Runtime library, or replace the op") from None


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


def draw_partition(model, segments: list[Segment], path: Path) -> Path:
    """The graph laid out by depth, TensorRT islands in greens/blues, native nodes in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = model.graph
    producer = {o: i for i, n in enumerate(g.node) for o in n.output}
    depth = [0] * len(g.node)
    for i, n in enumerate(g.node):
        depth[i] = 1 + max((depth[producer[x]] for x in n.input if x in producer), default=-1)
    seg_of = {i: s for s in segments for i in s.nodes}
    rows: dict[int, int] = {}
    pos = []
    for i in range(len(g.node)):
        r = rows.get(depth[i], 0)
        rows[depth[i]] = r + 1
        pos.append((depth[i], r))
    width = max(6.0, min(40.0, (max(depth, default=0) + 1) * 0.12))
    height = max(3.0, min(20.0, max(rows.values(), default=1) * 0.4 + 1.5))
    fig, ax = plt.subplots(figsize=(width, height))
    palette = ["#2e7d32", "#1565c0", "#00838f", "#558b2f", "#283593"]
    for i, n in enumerate(g.node):
        for x in n.input:
            if x in producer:
                a, b = pos[producer[x]], pos[i]
                ax.plot([a[0], b[0]], [a[1], b[1]], color="#bbbbbb", lw=0.4, zorder=1)
    trt_ids = [s.index for s in segments if s.kind == "trt"]
    for i, (x, y) in enumerate(pos):
        s = seg_of[i]
        color = "#c62828" if s.kind == "native" else palette[trt_ids.index(s.index) % len(palette)]
        ax.scatter([x], [y], s=18 if s.kind == "trt" else 40, color=color, zorder=2,
                   marker="o" if s.kind == "trt" else "s")
        if s.kind == "native":
            ax.annotate(g.node[i].op_type, (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7, color=color)
    ax.set_title(f"partition: {len(trt_ids)} TensorRT subgraph(s) (green/blue), "
                 f"{sum(len(s.nodes) for s in segments if s.kind == 'native')} native node(s) (red)")
    ax.set_xlabel("depth (topological)")
    ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def without_control_flow(onnx_path: Path, partition_cfg: dict) -> tuple[dict, list[str]] | None:
    """TensorRT can parse If/Loop/Scan and still fail to build them (an internal assertion, not a parser verdict): the
    partition config that runs them in ONNX Runtime, and the ops, or None when that cannot help (no such nodes, they
    are native already, partition.strict, or partition.control_flow_fallback=false)."""
    import onnx

    from tasks.graph.edit import CONTROL_FLOW

    if not partition_cfg.get("control_flow_fallback", True) or partition_cfg.get("strict"):
        return None
    model = onnx.load(str(onnx_path), load_external_data=False)
    present = sorted({n.op_type for n in model.graph.node if n.op_type in CONTROL_FLOW})
    if not present or set(present) <= set(partition_cfg["exclude_ops"]):
        return None
    exclude = list(partition_cfg["exclude_ops"]) + [op for op in present if op not in partition_cfg["exclude_ops"]]
    return {**partition_cfg, "exclude_ops": exclude}, present


MAX_REDUCE_BUILDS = 16  # builds one bisection may try (a segment of n nodes needs about log2(n))
REDUCE_BUILD_SECONDS = 60.0  # one bisection build is cancelled after this (a prefix that builds takes seconds)
REDUCE_SECONDS = 300.0  # the whole bisection stops trying new builds after this


def failing_node(onnx_path: Path, nodes: list[int], feeds: list[dict[str, np.ndarray]],
                 build: Callable[[Any, list[dict]], str | None], cap: int = MAX_REDUCE_BUILDS,
                 progress: Callable[[int, int, float], None] | None = None,
                 seconds: float = REDUCE_SECONDS) -> tuple[int, str, int] | None:
    """The node of a TensorRT segment (``nodes``, in graph order) that its engine fails on, as Polygraphy's
    ``debug reduce`` finds it: bisect on prefixes of the segment, each built alone (``build(model, profiles)``: None
    or the builder's words; a build that timed out says so with TIMED_OUT) with its boundary shapes from ONNX Runtime
    runs on ``feeds`` ([min, opt, max] of the first profile). ``progress(try, cap, elapsed seconds)`` before each build.
    Returns (node index, the builder's words, builds tried), or None when no single node is found within ``cap``
    builds and ``seconds``, or a build timed out (its verdict is unknown)."""
    import onnx

    from tasks.partition.segments import io_of, submodel

    model = onnx.load(str(onnx_path))
    every = [o for i in nodes for o in model.graph.node[i].output if o] + \
        [x for i in nodes for x in model.graph.node[i].input if x]
    shapes = _shape_ranges(model, list(dict.fromkeys(every)), feeds, onnx_path)
    lo, hi, words, tries, t0 = 0, len(nodes), None, 0, time.perf_counter()
    while hi - lo > 1 and tries < cap and time.perf_counter() - t0 < seconds:
        mid = (lo + hi) // 2
        ins, outs = io_of(model, nodes[:mid])
        if any(n not in shapes for n in ins + outs):
            return None
        sub = submodel(model, nodes[:mid], ins, outs, shapes, "reduce")
        prof = [{n: {k: shapes[n][k] for k in ("min", "opt", "max")} for n in ins if shapes[n]["min"] != shapes[n]["max"]}]
        if progress is not None:
            progress(tries + 1, cap, time.perf_counter() - t0)
        err = build(sub, prof if prof[0] else [])
        tries += 1
        if err == TIMED_OUT:
            return None
        if err is None:
            lo = mid
        else:
            hi, words = mid, err
    if hi - lo != 1:
        return None
    return nodes[hi - 1], words, tries  # words None: only the whole segment failed, with its last node


TIMED_OUT = "timed out"  # what a bisection build that was cancelled at its deadline answers


def kind_of(model, index: int) -> tuple:
    """What makes a node "of its kind" for the fallback: its op, its attributes (not subgraphs) and what each input is
    (an initializer of which type, or a computed value). TensorRT fails the same way on every node of a kind (38 Casts
    of int8 constants, every TopK with the same K), so they are excluded together."""
    from onnx import AttributeProto, helper

    g = model.graph
    inits = {t.name: t.data_type for t in g.initializer}
    n = g.node[index]
    attrs = tuple(sorted((a.name, repr(helper.get_attribute_value(a))) for a in n.attribute
                         if a.type not in (AttributeProto.GRAPH, AttributeProto.GRAPHS)))
    inputs = tuple(("initializer", inits[x]) if x in inits else ("value",) if x else ("none",) for x in n.input)
    return n.domain or "", n.op_type, attrs, inputs


def describe_kind(model, index: int) -> str:
    """The kind of a node in words: "Cast nodes reading an int8 initializer"."""
    import onnx

    g = model.graph
    inits = {t.name: t.data_type for t in g.initializer}
    n = g.node[index]
    consts = sorted({onnx.TensorProto.DataType.Name(inits[x]).lower() for x in n.input if x in inits})
    return f"{n.op_type} nodes" + (f" reading {'/'.join(consts)} initializers" if consts else "") + \
        (" with the same attributes" if n.attribute else "")


def build_fallback(partition_cfg: dict, onnx_path: Path, plan: dict, error: Exception, feeds: Callable[[], list],
                   build: Callable[[Any, list[dict]], str | None],
                   progress: Callable[[int, int, float], None] | None = None) -> tuple[dict, str] | None:
    """After a TensorRT build failed: the partition config that runs what failed in ONNX Runtime, and what to say, or
    None when nothing can (partition.strict, partition.build_fallback=false, no single failing node found).
    Control flow first (TensorRT parses If/Loop/Scan and can still fail to build them), else the node a bisection of
    the failing segment finds, with every TensorRT node of its kind (kind_of): one re-plan for a failure many nodes
    share. ``progress``: told before each bisection build (failing_node)."""
    from tasks.common.errors import SegmentBuildError

    replan = without_control_flow(onnx_path, partition_cfg)
    if replan is not None:
        return replan[0], (f"re-planned after the TensorRT build failed ({getattr(error, 'message', error)}): "
                           f"{', '.join(replan[1])} nodes run in ONNX Runtime (partition.control_flow_fallback=true)")
    if partition_cfg.get("strict") or not partition_cfg.get("build_fallback", True) or \
            not isinstance(error, SegmentBuildError):
        return None
    seg = next((s for s in plan["segments"] if s["index"] == error.segment and s["kind"] == "trt"), None)
    if seg is None or len(seg["nodes"]) < 1:
        return None
    found = failing_node(onnx_path, seg["nodes"], feeds(), build, progress=progress)
    if found is None:
        return None
    node, words, tries = found
    words = words or getattr(error, "message", str(error))
    excluded = dict(partition_cfg.get("exclude_nodes") or {})
    if str(node) in excluded:
        return None
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    n = model.graph.node[node]
    kind = kind_of(model, node)
    trt_nodes = {i for s in plan["segments"] if s["kind"] == "trt" for i in s["nodes"]}
    same = [i for i in sorted(trt_nodes) if i != node and str(i) not in excluded and kind_of(model, i) == kind]
    why = f"TensorRT parsed it but could not build it (found by bisecting the segment, {tries} builds): {words}"
    excluded[str(node)] = why
    for i in same:
        excluded[str(i)] = (f"of the kind of node {n.name or '#' + str(node)} ({describe_kind(model, node)}), which "
                            f"TensorRT parsed but could not build (found by bisecting the segment, {tries} builds): {words}")
    also = f" with the {len(same)} other {describe_kind(model, node)} (one kind, excluded at once)" if same else ""
    return ({**partition_cfg, "exclude_nodes": excluded},
            f"re-planned after the TensorRT build failed: node {n.name or '#' + str(node)} ({n.op_type}){also} runs in "
            f"ONNX Runtime; the builder said: {words}")
