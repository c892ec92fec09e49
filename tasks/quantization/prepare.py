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


def prepare_graph(src: Path, dst: Path, feeds: list[Feed], ref: list[dict]) -> tuple[Path, dict]:
    """opset >= MIN_OPSET, Constants folded into initializers, every node named; checked against the original."""
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
    run = ort_runner(dst, stage=STAGE)
    cos = worst_feed_cosine([run(f) for f in feeds], ref)
    info["cosine_to_input"] = cos
    if cos < 0.99999:
        raise StageError(f"preparing the graph for quantization (opset {info['opset_in']} -> {info['opset']}, "
                         f"constant folding) changed its outputs: cosine {cos:.6f}", stage=STAGE, file=str(src),
                         fix="export the model at opset >= 13")
    return dst, info


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
