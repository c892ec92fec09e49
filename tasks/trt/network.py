"""The precision profile of an engine: where its FLOPs are computed (fp32, fp16, int8, fp8), measured on the network
TensorRT builds -- no GPU needed.

The precision graph that is built (fp32/fp16 ONNX, or the Q/DQ graph) is parsed into a TensorRT(-RTX)
INetworkDefinition with its dynamic inputs fixed at the optimization profile's opt shape, so every layer's tensors
have concrete shapes. Each layer then gets:

* FLOPs (an estimate, multiply-add = 2): convolution 2 * out elements * Cin/groups * kernel area; deconvolution
  2 * in elements * Cout/groups * kernel area; matrix multiply 2 * out elements * K; pooling out elements * window;
  reduce: input elements; every other computing layer (elementwise, activation, unary, scale, resize, softmax,
  normalization, select, ...) its output element count. Layers that only move, reshape, cast or (de)quantize data
  (constant, shuffle, slice, concatenation, gather, cast, Q/DQ, shape, ...) count 0 FLOPs: TensorRT fuses Q/DQ into
  the layers around them, and copies are memory-bound, not compute.
* a precision, from the network's own tensor types (networks are strongly typed, so these are the types the engine
  computes in): a convolution, deconvolution or matrix multiply whose data and weight inputs both come from
  DequantizeLinear layers of int8 (fp8) tensors (directly or through the parser's reshapes: a 2-D MatMul weight for a
  batched input, the Unsqueeze that makes a 1-D Conv 2-D) runs in int8 (fp8), as TensorRT fuses DQ -> op -> Q; any
  other layer
  runs in the float type of its output (float32 -> fp32, float16 -> fp16, bfloat16 counted as fp16), or of its
  input when the output is not a float (comparisons). Layers on integer/bool tensors only (shape arithmetic) have no
  float precision: counted as ``other`` and left out of the FLOP shares.

``flops_share`` = FLOPs per precision / all FLOPs (all four keys, summing to 1). ``conv_int8_share`` (``conv_fp8_
share``) is the share of convolution/deconvolution/matrix-multiply FLOPs computed in int8 (fp8). The estimate is of
the network as defined, before TensorRT's own fusions; it says whether the engine can be faster than its baseline,
not how fast it is.
"""
from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from tasks.graph.flops import conv_flops, deconv_flops, matmul_flops, pool_flops

from tasks.schema import PRECISIONS
MATMUL_KINDS = ("CONVOLUTION", "DECONVOLUTION", "MATRIX_MULTIPLY")
NO_FLOPS = ("CONSTANT", "SHUFFLE", "SLICE", "CONCATENATION", "GATHER", "CAST", "IDENTITY", "QUANTIZE", "DEQUANTIZE",
            "SHAPE", "ASSERTION", "PADDING", "SCATTER", "FILL", "CONDITION", "CONDITIONAL_INPUT", "CONDITIONAL_OUTPUT",
            "ITERATOR", "RECURRENCE", "TRIP_LIMIT", "LOOP_OUTPUT", "NON_ZERO", "SQUEEZE", "UNSQUEEZE",
            "REVERSE_SEQUENCE", "ONE_HOT")


def precision_profile_from_onnx(onnx_paths: list[Path], profiles: list[dict], backend) -> dict[str, Any]:
    """The precision profile of the engine(s) built from ``onnx_paths`` (one per TensorRT segment, each with its own
    optimization profiles; the first profile's opt shape is used). Returns ``metrics`` and per-layer ``layers``; where
    a layer computes in int8/fp8, also the precision ``boundaries`` (tasks/trt/boundaries.py) with their count and
    bytes as ``network_reformat_*`` metrics."""
    from tasks.trt.boundaries import boundary_metrics

    rows: list[dict] = []
    boundaries: list[dict] = []
    unresolved = 0
    for i, (path, profs) in enumerate(zip(onnx_paths, profiles)):
        layer_rows, n_unres, found = _layers(Path(path), profs[0] if profs else {}, backend)
        rows += [{"segment": i, **r} for r in layer_rows]
        boundaries += [{"segment": i, **b} for b in found]
        unresolved += n_unres
    metrics = summarize(rows)
    out = {"metrics": metrics, "layers": rows, "unresolved_dims": unresolved}
    if any(r["precision"] in ("int8", "fp8") for r in rows):
        metrics.update(boundary_metrics(boundaries))
        out["boundaries"] = boundaries
    return out


def summarize(rows: list[dict]) -> dict[str, Any]:
    """flops_share (four keys, sum 1; absent when no FLOPs could be estimated), layer counts per precision, total GFLOPs and the matmul-type int8/fp8 share."""
    flops = collections.Counter({p: 0.0 for p in PRECISIONS})
    layers = collections.Counter({p: 0 for p in (*PRECISIONS, "other")})
    heavy = collections.Counter({p: 0.0 for p in PRECISIONS})
    for r in rows:
        p = r["precision"] if r["precision"] in PRECISIONS and r["flops"] > 0 else "other"
        layers[p] += 1
        if p != "other":
            flops[p] += r["flops"]
            if r["type"] in MATMUL_KINDS:
                heavy[p] += r["flops"]
    total = sum(flops.values())
    out: dict[str, Any] = {"precision_layers": dict(layers)}
    if total:  # no FLOPs estimated (no layer with known shapes): no share, rather than a made-up one
        out["flops_share"] = {p: flops[p] / total for p in PRECISIONS}
        out["gflops"] = total / 1e9
    heavy_total = sum(heavy.values())
    if heavy_total:
        out["conv_int8_share"] = heavy["int8"] / heavy_total
        out["conv_fp8_share"] = heavy["fp8"] / heavy_total
    return out


def _layers(path: Path, profile: dict, backend) -> tuple[list[dict], int, list[dict]]:
    from tasks.trt.boundaries import Layer, Tensor, boundaries_from_layers

    network, keep = _network(path, profile, backend)
    trt = backend.trt
    producer = {}
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    for L in layers:
        for j in range(L.num_outputs):
            producer[L.get_output(j).name] = L
    rows, unresolved, plain, tensors = [], 0, [], {}
    for L in layers:
        kind = str(L.type).rsplit(".", 1)[-1]
        flops, unres = _flops(trt, L, kind)
        unresolved += unres
        precision = _precision(trt, L, kind, producer)
        rows.append({"name": L.name, "type": kind, "precision": precision, "flops": flops})
        ins = [t for t in (L.get_input(j) for j in range(L.num_inputs)) if t is not None]
        outs = [L.get_output(j) for j in range(L.num_outputs)]
        for t in (*ins, *outs):
            if t.name not in tensors:
                n, u = _numel(t.shape)
                tensors[t.name] = Tensor(_type_name(trt, t.dtype), n, u)
        plain.append(Layer(L.name, kind, precision, tuple(t.name for t in ins), tuple(t.name for t in outs)))
    found = boundaries_from_layers(plain, tensors, [network.get_output(i).name for i in range(network.num_outputs)])
    del keep
    return rows, unresolved, found


def _network(path: Path, profile: dict, backend):
    """Parse the ONNX file with its dynamic inputs fixed at the profile's opt shape (same parser and flags as build)."""
    import onnx

    from tasks.common.errors import StageError, cause

    trt = backend.trt
    model = onnx.load(str(path), load_external_data=False)
    for inp in model.graph.input:
        if inp.name in profile:
            dims = inp.type.tensor_type.shape.dim
            for d, v in zip(dims, profile[inp.name]["opt"]):
                d.Clear()
                d.dim_value = int(v)
    from tasks.trt.messages import unique

    # the backend's logger: nothing printed (TensorRT's own Logger writes its "cudaError 35" lines on a host without a
    # driver, and each parse error once per level it passes, to stderr), the causes kept once each
    logger = backend.logger()
    builder, network, parser = backend.parser(logger)
    from tasks.common.native import deferred_signals

    with deferred_signals():
        parsed = parser.parse(model.SerializeToString(), str(path))
    if not parsed:
        errs = "; ".join(unique(cause(parser.get_error(i).desc()) for i in range(parser.num_errors))
                         or logger.errors())
        raise StageError(f"the precision profile could not parse the graph at the opt shape: {errs}",
                         stage="build", file=str(path), fix="check the optimization profile's opt shapes")
    return network, (builder, parser, logger)


def _numel(shape) -> tuple[int, int]:
    """(element count with unknown dims taken as 1, number of unknown dims)."""
    n, unknown = 1, 0
    for d in shape:
        if d < 0:
            unknown += 1
        else:
            n *= d
    return n, unknown


def _flops(trt, L, kind: str) -> tuple[float, int]:
    if kind in NO_FLOPS or L.num_outputs == 0:
        return 0.0, 0
    out = L.get_output(0).shape
    n_out, unres = _numel(out)
    inp = L.get_input(0) if L.num_inputs else None
    if kind == "CONVOLUTION":
        L.__class__ = trt.IConvolutionLayer
        cin = inp.shape[1] if inp is not None and len(inp.shape) > 1 and inp.shape[1] > 0 else 1
        k, _ = _numel(L.kernel_size_nd)
        return conv_flops(n_out, cin / max(L.num_groups, 1), k), unres
    if kind == "DECONVOLUTION":
        L.__class__ = trt.IDeconvolutionLayer
        n_in, u = _numel(inp.shape)
        k, _ = _numel(L.kernel_size_nd)
        return deconv_flops(n_in, L.num_output_maps / max(L.num_groups, 1), k), unres + u
    if kind == "MATRIX_MULTIPLY":
        L.__class__ = trt.IMatrixMultiplyLayer
        s = inp.shape
        if len(s) == 0 or L.op0 == trt.MatrixOperation.VECTOR:
            kdim = s[-1] if len(s) else 1
        else:
            kdim = s[-2] if L.op0 == trt.MatrixOperation.TRANSPOSE and len(s) > 1 else s[-1]
        return matmul_flops(n_out, kdim), unres
    if kind == "POOLING":
        L.__class__ = trt.IPoolingLayer
        w, _ = _numel(L.window_size_nd)
        return pool_flops(n_out, w), unres
    if kind == "REDUCE" and inp is not None:
        n_in, u = _numel(inp.shape)
        return float(n_in), u
    return float(n_out), unres


def _dtype(trt, dt) -> str | None:
    return {trt.DataType.FLOAT: "fp32", trt.DataType.HALF: "fp16", trt.DataType.INT8: "int8",
            getattr(trt.DataType, "BF16", None): "fp16", getattr(trt.DataType, "FP8", None): "fp8"}.get(dt)


def _type_name(trt, dt) -> str | None:
    """A tensor type by name (bf16 kept apart from fp16: its size is the same, its name is not)."""
    names = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "INT8": "int8", "FP8": "fp8", "INT32": "int32",
             "INT64": "int64", "BOOL": "bool", "UINT8": "uint8"}
    return next((v for k, v in names.items() if getattr(trt.DataType, k, None) == dt), None)


def _reshapes(trt) -> tuple:
    return tuple(getattr(trt.LayerType, n) for n in ("SHUFFLE", "UNSQUEEZE", "SQUEEZE") if hasattr(trt.LayerType, n))


def _precision(trt, L, kind: str, producer: dict) -> str | None:
    if kind in MATMUL_KINDS:
        q = set()
        for j in range(min(L.num_inputs, 2)):
            t = L.get_input(j)
            src = producer.get(t.name) if t is not None else None
            # the parser's reshapes between a DQ and its layer (a 2-D MatMul weight for a batched input; the
            # Unsqueeze/Squeeze that make a 1-D Conv 2-D): TensorRT moves DQ past them
            while src is not None and src.type in _reshapes(trt):
                t = src.get_input(0)
                src = producer.get(t.name) if t is not None else None
            if src is None or src.type != trt.LayerType.DEQUANTIZE:
                q = set()
                break
            q.add(_dtype(trt, src.get_input(0).dtype))
        if len(q) == 1 and q <= {"int8", "fp8"} and L.num_inputs >= 2:
            return q.pop()
    for t in [L.get_output(j) for j in range(L.num_outputs)] + [L.get_input(j) for j in range(L.num_inputs)]:
        p = _dtype(trt, t.dtype) if t is not None else None
        if p in ("fp32", "fp16"):
            return p
    return None


def plot(rows: list[dict], metrics: dict, title: str, path: Path) -> Path:
    """A bar chart of GFLOPs per precision and layer type (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        if r["precision"] in PRECISIONS and r["flops"] > 0:
            by[r["type"]][r["precision"]] += r["flops"] / 1e9
    kinds = sorted(by, key=lambda k: -sum(by[k].values()))[:12]
    colors = {"fp32": "#c62828", "fp16": "#1565c0", "int8": "#2e7d32", "fp8": "#6a1b9a"}
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(kinds) + 1.8))
    left = [0.0] * len(kinds)
    for p in PRECISIONS:
        vals = [by[k][p] for k in kinds]
        share = metrics["flops_share"][p]
        ax.barh(range(len(kinds)), vals, left=left, color=colors[p], label=f"{p} ({share:.1%} of FLOPs)")
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels([k.lower() for k in kinds], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("estimated GFLOPs at the profile's opt shape, by layer type of the TensorRT network")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def label_disagreement(label: str, share: dict[str, float] | None) -> str | None:
    """What an engine named ``label`` computes instead, from its ``flops_share``, or None when the name is true (or no
    FLOPs were estimated). fp32: nothing below fp32; fp16: fp16 computes some of the float FLOPs (a model that arrives
    quantized keeps its int8 layers: the float part is what fp16 names); int8/fp8: that precision computes some FLOPs
    and the other 8-bit one none."""
    if not share:
        return None

    def some(p: str) -> bool:
        return share.get(p, 0.0) > 0.0

    def shares() -> str:
        return ", ".join(f"{p} {share[p]:.1%}" for p in PRECISIONS if share.get(p)) + " of its FLOPs"
    if label == "fp32" and any(some(p) for p in ("fp16", "int8", "fp8")):
        return shares()
    if label == "fp16" and (not some("fp16") and some("fp32") or some("fp8")):
        return shares()
    if label in ("int8", "fp8") and (not some(label) or some({"int8": "fp8", "fp8": "int8"}[label])):
        return shares()
    return None


def describe(metrics: dict) -> str:
    """One line: the FLOP shares and layer counts."""
    n = metrics["precision_layers"]
    if "flops_share" not in metrics:
        return "no FLOPs estimated (no layer shape known at the opt shape); layers: " + \
            ", ".join(f"{p} {c}" for p, c in n.items() if c)
    s = metrics["flops_share"]
    parts = ", ".join(f"{p} {s[p]:.1%} ({n[p]} layers)" for p in PRECISIONS if s[p] or n[p])
    conv = f"; conv/matmul FLOPs in int8 {metrics['conv_int8_share']:.1%}" if metrics.get("conv_int8_share") else ""
    conv += f", in fp8 {metrics['conv_fp8_share']:.1%}" if metrics.get("conv_fp8_share") else ""
    return f"{metrics['gflops']:.2f} GFLOPs: {parts}{conv}"


def precision_profile(onnx_paths: list[Path], profiles: list[list[dict]], backend, out_dir: Path, title: str):
    """The profile of one build's engine(s) as a StageResult: ``flops_share`` and friends as metrics,
    ``precision_profile.json`` (every layer) and ``precision_profile.png``."""
    from tasks.common.util import StageResult, write_json

    p = precision_profile_from_onnx(onnx_paths, profiles, backend)
    m = p["metrics"]
    note = ("estimated FLOPs of the TensorRT network parsed from the precision graph at the first optimization "
            "profile's opt shape; precision from the network's tensor types (strongly typed)")
    files = {"precision_profile": write_json(out_dir / "precision_profile.json",
                                             {"note": note, **m, "unresolved_dims": p["unresolved_dims"],
                                              "layers": p["layers"],
                                              **({"boundaries": p["boundaries"]} if "boundaries" in p else {})}),
             }
    if "flops_share" in m:
        files["precision_profile_plot"] = plot(p["layers"], m, f"{title}: {describe(m)}", out_dir / "precision_profile.png")
    return StageResult(files=files, metrics=dict(m), details={"precision_profile": describe(m), "note": note})
