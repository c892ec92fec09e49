"""Stage 2, partition: TensorRT where it can, native ONNX Runtime elsewhere (Paddle Inference's subgraph rule).

The TensorRT ONNX parser gives its verdict per node (`supports_model_v2`); supported subgraphs smaller than
`partition.min_subgraph_size` and ops in `partition.exclude_ops` stay native; `partition.strict` fails instead of
falling back. A fully supported model is one segment: the whole graph, one engine. When a TensorRT build fails, the
fallback (`build_fallback`) re-plans with what failed in ONNX Runtime.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tasks.trt.backend import Backend
from tasks.common.errors import StageError, cause
from tasks.partition.draw import draw_partition
from tasks.partition.narrow import refine
from tasks.partition.segments import Segment, boundary_names, extract_segment, segments_from_assignment, shape_ranges
from tasks.common.util import StageResult, write_json

FRAGMENTED = 4  # more TensorRT segments than this: boundaries likely cost more than TensorRT saves


def plan_from_onnx(onnx_path: Path, partition_cfg: Any, backend: Backend, out_dir: Path,
                   profile_feeds: list[list[dict[str, np.ndarray]]] | Callable[[], list],
                   dynamic_left_why: dict[str, str] | None = None) -> StageResult:
    """Write partition.json, graph.png and, for a hybrid model, one fp32 ONNX per segment.

    profile_feeds: per model profile, feeds at its [min, opt, max] shapes (to propagate shapes to boundaries),
    or a callable making them (only a model that does not fully parse needs them).
    dynamic_left_why: with model.dequantize_dynamic=true, the dynamic quantization it left native and why (export's
    prequantized details), so that a fragmentation warning says that instead of recommending the flag already set.
    """
    import onnx

    feeds = _feeds_on_demand(profile_feeds)
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(onnx_path))
    nodes = model.graph.node
    trt_nodes, reasons, parser_errors = _trt_nodes(model, onnx_path, partition_cfg, backend, feeds)
    segments, hybrid = _segments(model, trt_nodes, reasons, partition_cfg)
    fallback = [i for i in range(len(nodes)) if i not in trt_nodes]
    fallback_nodes = [{"index": i, "name": nodes[i].name, "op": nodes[i].op_type,
                       "domain": nodes[i].domain or "ai.onnx", "reason": reasons.get(i, ""),
                       "inputs": [x for x in nodes[i].input if x], "outputs": list(nodes[i].output)} for i in fallback]
    trt_segments = [s for s in segments if s.kind == "trt"]
    files: dict[str, Path] = {}
    plan: dict[str, Any] = {"nodes": len(nodes), "hybrid": hybrid, "fallback_nodes": fallback_nodes,
                            "parser_errors": parser_errors, "warnings": []}
    _check_plan(plan, segments, partition_cfg, onnx_path, out_dir)
    if hybrid:
        files.update(_write_segments(model, segments, feeds(), onnx_path, out_dir))
        boundaries = sum(len(s.inputs) for s in segments[1:])
        plan["boundary_tensors"] = boundaries
        if len(trt_segments) > FRAGMENTED:
            plan["warnings"].append(_fragmented(nodes, fallback, len(trt_segments), boundaries, dynamic_left_why))
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


def _feeds_on_demand(profile_feeds: list | Callable[[], list]) -> Callable[[], list]:
    """The profile feeds, made on first use when ``profile_feeds`` is the callable that makes them."""
    if not callable(profile_feeds):
        return lambda: profile_feeds
    make_feeds, made = profile_feeds, None

    def feeds() -> list:
        nonlocal made
        if made is None:
            made = make_feeds()
        return made

    return feeds


def _trt_nodes(model, onnx_path: Path, partition_cfg: Any, backend: Backend,
               feeds: Callable[[], list]) -> tuple[set[int], dict[int, str], list]:
    """The nodes TensorRT takes: the parser's supported subgraphs (each failing one narrowed down to the nodes that
    fail) less excluded ops, nodes of other domains, nodes the build stage's fallback found and nodes that would cut at
    a shape tensor. Returns (those node indices, why each other node runs natively, the parser's errors)."""
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
    return trt_nodes, reasons, with_parser.errors


def _segments(model, trt_nodes: set[int], reasons: dict[int, str], partition_cfg: Any) -> tuple[list[Segment], bool]:
    """The segments of ``trt_nodes``, and whether the model is hybrid. In a hybrid model, TensorRT subgraphs smaller
    than partition.min_subgraph_size stay native (Paddle's rule): they leave ``trt_nodes``, their reason recorded."""
    nodes = model.graph.node
    small: list[int] = []
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
            trt_nodes.difference_update(small)
            native_shape_inputs(nodes, trt_nodes, reasons)
            segments = segments_from_assignment(model, trt_nodes)
    return segments, hybrid


def _check_plan(plan: dict[str, Any], segments: list[Segment], partition_cfg: Any, onnx_path: Path,
                out_dir: Path) -> None:
    """StageError when TensorRT can take no node, or when partition.strict and some node would fall back, after
    writing partition.json with the plan so far."""
    fallback_nodes, n_nodes = plan["fallback_nodes"], plan["nodes"]

    def report_and_fail(msg: str, fix: str) -> None:
        plan["segments"] = [s.as_dict() for s in segments]
        write_json(out_dir / "partition.json", plan)
        shown = "; ".join(f"{f['name'] or '#' + str(f['index'])} ({f['op']}): {f['reason']}" for f in fallback_nodes[:4])
        raise StageError(f"{msg}: {shown}" + (f" and {len(fallback_nodes) - 4} more" if len(fallback_nodes) > 4 else ""),
                         stage="partition", file=str(onnx_path), fix=fix)

    if not any(s.kind == "trt" for s in segments):
        report_and_fail(f"TensorRT can take none of the {n_nodes} nodes",
                        "run this model with ONNX Runtime, or replace its unsupported ops")
    if fallback_nodes and partition_cfg["strict"]:
        report_and_fail(f"partition.strict=true and {len(fallback_nodes)} of {n_nodes} nodes would fall back to ONNX Runtime",
                        "set partition.strict=false to run them natively, or replace those ops")


def _write_segments(model, segments: list[Segment], feeds: list, onnx_path: Path, out_dir: Path) -> dict[str, Path]:
    """One fp32 ONNX per segment of a hybrid model, each TensorRT segment with its input shapes per model profile
    (propagated from ``feeds`` through ONNX Runtime). Returns the files."""
    files: dict[str, Path] = {}
    shapes = [_shape_ranges(model, boundary_names(segments), fs, onnx_path) for fs in feeds]
    for s in segments:
        s.onnx = f"segment{s.index}.{s.kind}.onnx"
        extract_segment(model, s, shapes[0], out_dir / s.onnx)
        files[f"segment{s.index}"] = out_dir / s.onnx
        if s.kind == "trt":
            s.profiles = [{n: {k: sh[n][k] for k in ("min", "opt", "max")} for n in s.inputs} for sh in shapes]
    return files


def _fragmented(nodes, fallback: list[int], trt_subgraphs: int, boundaries: int,
                dynamic_left_why: dict[str, str] | None = None) -> str:
    """The warning for a model cut into more than FRAGMENTED TensorRT subgraphs, with the fix. Dynamic quantization
    among the native nodes: the fix is model.dequantize_dynamic=true, or, when it is already set (dynamic_left_why
    given), what it left native and why."""
    from tasks.prequant.detect import DYNAMIC_OPS

    dynamic = sum(1 for i in fallback if nodes[i].op_type in DYNAMIC_OPS)
    if not dynamic:
        why = "raise partition.min_subgraph_size or replace the unsupported ops"
    elif dynamic_left_why is None:
        why = (f"{dynamic} of the native nodes are dynamic quantization, which TensorRT has no kernels for: "
               "model.dequantize_dynamic=true builds them as float layers in TensorRT")
    else:
        said = "; ".join(f"{n} because {r}" for r, n in Counter(dynamic_left_why.values()).most_common(3))
        said = f" ({said})" if said else ""
        why = (f"{dynamic} of the native nodes are dynamic quantization that model.dequantize_dynamic=true left native, "
               f"not being ONNX Runtime's quantize_dynamic pattern it dequantizes{said}; the export stage's "
               "prequant.json lists them under dynamic_left_why. Fix: build it as shipped "
               "(model.dequantize_dynamic=false, precision=fp16), or give model.source the float model it was "
               "quantized from")
    return (f"fragmented: {trt_subgraphs} TensorRT subgraphs and {boundaries} boundary tensors; each boundary is a "
            f"copy and a sync, so this can be slower than running natively ({why})")


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
