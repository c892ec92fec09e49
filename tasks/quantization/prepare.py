"""The calibrate stage's first steps: its arguments checked, the fp32 graph prepared for quantization and the ranges
calibrated on it.

Preparing: opset >= 19 for fp16 Q/DQ scales and float8, Constant nodes folded into initializers so ORT's quantizer
sees weights as weights, every node named, every layer's bias its own initializer; the prepared graph is checked against
the input's outputs. Layers the
calibration data never reaches (computed from constants alone) have no activation range to learn.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from tasks.common.errors import ConfigError, StageError
from tasks.graph.edit import fp32_from_fp16, name_allocator, uniquify_node_names
from tasks.graph.fold import fold_constants
from tasks.graph.load import opset_of, with_opset
from tasks.accuracy.metrics import worst_feed_cosine
from tasks.onnxrt.ort import ort_runner
from tasks.quantization.qdq import PRECISIONS, QUANT_OPS
from tasks.quantization.ranges import METHODS, STAGE, ranges_from_feeds

HIGH_PRECISIONS = ("fp16", "fp32")
MIN_OPSET = 19  # float16 Q/DQ scales (the fp16 remainder) and float8 need opset 19
PREPARE_FEEDS = 2  # held-out samples the prepared graph (opset, folded constants) is checked on against the input's
Feed = dict[str, np.ndarray]


def check_arguments(method: str, precision: str, feeds: list, high_precision: str, min_cosine: float | None) -> None:
    if method not in METHODS:
        raise ConfigError(f"calibration method {method!r} is unknown", stage=STAGE, fix=f"use one of {', '.join(METHODS)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"quantized precision {precision!r} is unknown", stage=STAGE,
                          fix=f"use one of {', '.join(PRECISIONS)} (fp16/fp32 need no calibration)")
    if not feeds:
        raise ConfigError("no calibration samples", stage=STAGE, fix="give at least one input feed to calibrate on")
    if high_precision not in HIGH_PRECISIONS:
        raise ConfigError(f"high precision {high_precision!r} is unknown", stage=STAGE,
                          fix=f"use one of {', '.join(HIGH_PRECISIONS)}")
    if min_cosine is not None and not 0.0 < float(min_cosine) <= 1.0:
        raise ConfigError(f"min_cosine={min_cosine} is outside (0, 1]", stage=STAGE, fix="use e.g. 0.99, or None")


def check_layers(layers: list[str], unreached: list[str], no_layers_ok: bool, fp32_path: Path) -> None:
    """StageError for a graph without any layer to quantize, unless ``no_layers_ok`` (one segment of several)."""
    if not layers and not no_layers_ok:
        raise StageError(f"the model has no {'/'.join(QUANT_OPS)} node to quantize" + (
            f" that the calibration data reaches ({len(unreached)} compute from constants alone)" if unreached
            else ""), stage=STAGE, file=str(fp32_path), fix="keep this model at fp16/fp32")


def unreached_layers(model) -> tuple[list[str], bool]:
    """(the layers, Conv/ConvTranspose/MatMul/Gemm nodes and residual Adds, none of whose inputs depends on a graph
    input, whether any layer is reached). The calibration data never reaches such a layer: its values come from
    constants alone (a TensorRT segment without inputs, e.g. loop bookkeeping after a Loop that runs in ONNX Runtime),
    so there is no activation range to learn (and ONNX Runtime's calibrator collects nothing from a graph without
    inputs: "No data is collected"). A node with subgraphs (If, Loop, Scan) is reached when any input or any value its
    bodies read from the outer graph is."""
    from tasks.quantization.qdq import residual_adds

    g = model.graph
    reached = {i.name for i in g.input} - {t.name for t in g.initializer}

    def outer_reads(graph) -> set[str]:
        out = set()
        for n in graph.node:
            out.update(x for x in n.input if x)
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    out |= outer_reads(sub)
        return out

    for n in g.node:  # topological order
        reads = set(x for x in n.input if x)
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                reads |= outer_reads(sub)
        if reads & reached:
            reached.update(o for o in n.output if o)
    residual = residual_adds(g)
    layers = [n for n in g.node if n.op_type in QUANT_OPS or n.name in residual]
    unreached = [n.name for n in layers if not any(x in reached for x in n.input if x)]
    return unreached, len(unreached) < len(layers)


def onnx_model(path: Path):
    import onnx

    return onnx.load(str(path))


def prepare_graph(src: Path, dst: Path, feeds: list[Feed], ref: list[dict], metric=None,
                  random_inputs: bool = False) -> tuple[Path, dict]:
    """opset >= MIN_OPSET, Constants folded into initializers, every node named; checked against the original
    (``check_prepared``, by ``metric``: tasks.accuracy.metric.SearchJudge, default cosine)."""
    import onnx

    model = onnx.load(str(src))
    info: dict = {"opset_in": opset_of(model)}
    if fp32_from_fp16(model):  # calibrated in fp32; the Q/DQ graph's remainder is made fp16 again on the way out
        info["fp16_upcast"] = True
    if info["opset_in"] < MIN_OPSET:
        model, info["opset_upgrade"] = with_opset(model, MIN_OPSET)
    info["opset"] = opset_of(model)
    if model.ir_version >= 4:
        info["constants_folded"] = fold_constants(model.graph)
    uniquify_node_names(model.graph)
    info["biases_unshared"] = unshare_biases(model.graph)
    onnx.save(model, str(dst))
    check_prepared(src, dst, feeds, ref, info, metric, random_inputs)
    return dst, info


def check_prepared(src: Path, dst: Path, feeds: list[Feed], ref: list[dict], info: dict, metric=None,
                   random_inputs: bool = False) -> None:
    """StageError when the prepared graph ``dst`` changed the outputs of ``src`` (``ref`` on ``feeds``): by the user's
    metric (``metric``, tasks.accuracy.metric.SearchJudge: its own settings, without the search's margin) and, with
    cosine, within PREPARE_MIN_COSINE (preparing computes the same in fp32). Both judge the finite part of the
    reference (tasks.accuracy.nonfinite.on_finite_reference: a NaN of the input model has no value to keep); its count
    is in ``info`` (``nonfinite_reference_elements``). The fix names the step that changed them: the opset conversion
    (measured alone) or the rest (folding constants, an fp16 model computed in fp32)."""
    from tasks.accuracy.nonfinite import on_finite_reference

    run = ort_runner(dst, stage=STAGE, arena=False)  # a few runs: an arena would hold the largest one's activations
    outs = [on_finite_reference(run(f), r) for f, r in zip(feeds, ref)]
    cos = worst_feed_cosine(outs, ref)
    info["cosine_to_input"] = cos
    bad = sum(int(np.size(a) - np.isfinite(a).sum()) for r in ref for a in r.values() if np.asarray(a).dtype.kind == "f")
    if bad:
        info["nonfinite_reference_elements"] = bad
    user = metric is not None and metric.name != "cosine"
    exact = metric.metric.judge(0.0) if user else None  # the user's own settings, without the search's margin
    score = exact.worst(outs, ref, feeds) if user else cos
    if user:
        info[f"{metric.name}_to_input"] = score
    floor = exact.target if user else PREPARE_MIN_COSINE
    if score >= floor:
        return
    what = (f"accuracy.metric={metric.name}: {exact.label} {score:.6g} (worst sample), below {floor:.6g}" if user
            else f"cosine {cos:.6f} (worst sample), below {PREPARE_MIN_COSINE}")
    steps = [f"opset {info['opset_in']} -> {info['opset']}"] if info.get("opset_upgrade") else []
    steps += (["constants folded"] if info.get("constants_folded") else []) + (
        ["the fp16 model computed in fp32"] if info.get("fp16_upcast") else [])
    on = f" (the fp32 reference holds {bad} NaN/inf elements, left out)" if bad else ""
    msg = f"preparing the graph for quantization ({', '.join(steps)}) changed its outputs: {what}{on}"
    if info.get("opset_upgrade") and _opset_alone_changes(src, feeds, ref, floor, exact if user else None):
        fix = (f"export the model at opset >= {MIN_OPSET}: ONNX's version converter from opset {info['opset_in']} "
               f"changed its outputs (measured alone), and a graph exported at {MIN_OPSET} needs no conversion")
    elif info.get("fp16_upcast"):
        fix = ("export the model in fp32: its fp16 weights and ops computed in fp32 (as calibration needs) give other "
               "outputs than the fp16 model, which is the reference here; or build it at precision=fp16")
    else:
        fix = ("build this model at precision=fp16 (folding its constants into initializers, which int8 calibration "
               "needs, changed its outputs); if the change is acceptable, relax accuracy.metric's settings")
    raise StageError(msg, stage=STAGE, file=str(src), fix=fix)


PREPARE_MIN_COSINE = 0.99999  # the worst sample's cosine of the prepared graph to the input's (the same fp32 math)


def _opset_alone_changes(src: Path, feeds: list[Feed], ref: list[dict], floor: float, exact) -> bool:
    """Whether ``src`` converted to MIN_OPSET alone (nothing folded) misses ``floor`` (with ``exact``, the user's
    metric; else the worst sample's cosine) on ``feeds``."""
    from tasks.accuracy.nonfinite import on_finite_reference

    converted, _ = with_opset(onnx_model(src), MIN_OPSET)
    run = ort_runner(converted.SerializeToString(), stage=STAGE, arena=False)
    outs = [on_finite_reference(run(f), r) for f, r in zip(feeds, ref)]
    return (exact.worst(outs, ref, feeds) if exact is not None else worst_feed_cosine(outs, ref)) < floor


def unshare_biases(g) -> int:
    """Give every layer (Conv, ConvTranspose, Gemm) that shares its bias initializer with another layer a copy of its
    own, under a name no value of the graph has. ONNX Runtime's quantizer copies a shared bias itself, naming the copy
    the bias's name with a number appended, which can be another tensor's name (tf2onnx shares equal biases across
    layers: Basic Pitch's Conv bias ``conv1d_25`` + "2" is Conv ``conv1d_252``'s output), and the Q/DQ graph then feeds a
    layer another layer's activations as its bias ("Conv bias must be a 1D tensor of size output_channels"). Returns
    the number of copies made."""
    from onnx import TensorProto

    inits = {t.name: t for t in g.initializer}
    fresh = name_allocator(g)
    seen: set[str] = set()
    copies = 0
    for node in g.node:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.input) < 3 or node.input[2] not in inits:
            continue
        bias = node.input[2]
        if bias not in seen:
            seen.add(bias)
            continue
        copy = TensorProto()
        copy.CopyFrom(inits[bias])
        copy.name = fresh(f"{bias}_{node.name or 'layer'}")
        g.initializer.append(copy)
        node.input[2] = copy.name
        copies += 1
    return copies


def calibrate_ranges(prepared: Path, feeds: list[Feed], method: str, work: Path,
                     on_sample: Callable[[int, int], None] | None):
    """(the layers the calibration data never reaches, the ranges learnt on ``feeds``, whether they were reused).
    Those layers (computed from constants alone: a segment without inputs, after a Loop that runs in ONNX Runtime)
    have no activation range to learn: left unquantized, said in the details."""
    unreached, reachable = unreached_layers(onnx_model(prepared))
    if reachable:
        ranges, reused = ranges_from_feeds(prepared, feeds, method, work, on_sample)
    else:  # nothing to calibrate (ONNX Runtime's calibrator collects nothing from a graph without inputs)
        from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData
        ranges, reused = TensorsData(CalibrationMethod.MinMax, {}), False
    return unreached, ranges, reused
