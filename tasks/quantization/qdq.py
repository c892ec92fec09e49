"""Q/DQ graphs: the fp32 model with QuantizeLinear/DequantizeLinear on the inputs of chosen layers, as strongly typed
TensorRT(-RTX) builds them.

Placement (the one measured to build on TensorRT-RTX 1.7.1.116): Q/DQ only on the inputs of Conv/ConvTranspose/
MatMul/Gemm and on the skip input of residual Adds (what TensorRT fuses), per-channel symmetric weights, symmetric
activations, bias left in float; every other op at the high precision (fp16 through tasks/fp16/convert.py's converter,
which keeps fp32 only where fp16 cannot hold the values, or fp32). fp8 (E4M3FN) follows the TensorRT/ModelOpt recipe:
per-tensor activation scale = amax / 448, per-output-channel weight scale = max|w| / 448, zero points 0; the graph is
quantized as int8 (same placement and axes) and its Q/DQ parameters rewritten (ORT's own fp8 path clips: scale =
std(x) / std(fp8 values)).

ORT's quantizer runs once, on every layer; the graph of a subset of layers is derived from it (``Quantizer.qdq``).
"""
from __future__ import annotations

import contextlib
import copy
import math
import tempfile
from pathlib import Path

import numpy as np

from tasks.common.errors import StageError
from tasks.graph.edit import prune_unused
from tasks.onnxrt.emulate import precision_runner
from tasks.fp16.convert import fp16_from_onnx

STAGE = "calibrate"
QUANT_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
PRECISIONS = {"int8": "QInt8", "fp8": "QFLOAT8E4M3FN"}
FP8_MAX = 448.0  # largest finite float8 E4M3FN value
# DedicatedQDQPair: other consumers of a quantized tensor (Add, Resize, ...) keep reading the float tensor
RESIDUAL_OPS = ("Add",)  # a residual Add's skip input gets Q/DQ so TensorRT fuses the Add into the Conv before it
EXTRA_OPTIONS = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False, "DedicatedQDQPair": True,
                 "OpTypesToExcludeOutputQuantization": list(QUANT_OPS + RESIDUAL_OPS)}  # Q/DQ on the op inputs only


@contextlib.contextmanager
def private_model_path(model_path: Path):
    """``model_path`` as seen from a folder of this process's own (mode 0700, removed after): ONNX Runtime's calibrator
    and quantizer write their shape-inferred copy beside the model they are given (``<name>-inferred.onnx``) and delete
    it once loaded, so two processes calibrating one model removed each other's copy mid-read ("No graph was found in
    the protobuf"), and a model in a folder shared with other users got a file written beside it. The calibrate stage's
    own graphs are stored whole (no external data), so a link reads the same model."""
    with tempfile.TemporaryDirectory(prefix="trtforge-ort-") as d:
        link = Path(d) / "model.onnx"
        link.symlink_to(Path(model_path).resolve())
        yield link


class Quantizer:
    """Q/DQ graphs of one shape-inferred in-memory copy of the model with fixed ranges (no re-calibration).

    ORT's quantizer runs once, on every layer (~0.4 s for PP-OCRv4 det); the graph for a subset of layers is
    derived from it by pointing the other layers back to their float inputs and dropping the Q/DQ nodes left
    unused -- the same graph as quantizing only that subset (per-tensor activation ranges, dedicated Q/DQ
    pairs per consumer), without re-running the quantizer for every candidate of the budget search.
    """

    def __init__(self, model_path: Path, ranges, precision: str, high_precision: str = "fp16",
                 keep_fp32: dict[str, float] | None = None, cancel_fp32: dict[str, float] | None = None,
                 tiny_fp32: dict[str, float] | None = None, keep_nodes: dict[str, float] | None = None):
        from onnx import numpy_helper
        from onnxruntime.quantization.quant_utils import QuantType, load_model_with_shape_infer, update_opset_version

        qt = getattr(QuantType, PRECISIONS[precision])
        self.qtype = QuantType.QInt8  # fp8: quantized as int8, then rewritten by _to_fp8
        self.ranges = ranges
        self.precision = precision
        self.high_precision = high_precision
        self.keep_fp32 = dict(keep_fp32 or {})  # values beyond fp16's range on the calibration data: their nodes stay fp32
        self.cancel_fp32 = dict(cancel_fp32 or {})  # values cancelling subtractions are computed from: fp32 too
        self.tiny_fp32 = dict(tiny_fp32 or {})  # values below fp16's normal range on the calibration data: fp32 too
        # nodes the fp16 accuracy search keeps fp32 in the remainder (tasks.fp16.search, by name): int8's remainder is
        # fp16, with fp16's hazards
        self.keep_nodes = dict(keep_nodes or {})
        with private_model_path(model_path) as private:
            self.base = update_opset_version(load_model_with_shape_infer(private), qt, qt)  # fp8: opset 19
        self._weights = {t.name: t for t in self.base.graph.initializer}
        self._fp8_weights: dict[tuple[str, int | None], tuple[np.ndarray, np.ndarray]] = {}
        self._amax = {k: amax_of(v) for k, v in ranges.data.items()} if precision == "fp8" else {}
        self._np = numpy_helper
        self.residual = residual_adds(self.base.graph)  # Add name -> index of its skip input
        nodes = [n for n in self.base.graph.node if n.op_type in QUANT_OPS or n.name in self.residual]
        self.layers = [n.name for n in nodes]
        self.ops = {n.name: n.op_type for n in nodes}
        self._float_inputs = {n.name: list(n.input) for n in nodes}
        self._full = None
        self._rescale_from: Quantizer | None = None  # int8 with other ranges: its graph, rescaled (with_ranges)
        self.run_error: str | None = None

    def with_ranges(self, ranges) -> "Quantizer":
        """The quantizer of the same model with other ranges: shares the loaded, shape-inferred model and the weight
        caches (neither depends on ranges); only the all-layers Q/DQ graph is made again, when first needed."""
        q = copy.copy(self)
        q.ranges, q._full, q.run_error = ranges, None, None
        q._amax = {k: amax_of(v) for k, v in ranges.data.items()} if self.precision == "fp8" else {}
        q._rescale_from = self if self.precision == "int8" else None
        return q

    def _rescaled(self, full):
        """``full`` (another quantizer's all-layers int8 graph of the same model) with this quantizer's activation
        scales: the same nodes, only the scale and zero point initializers of the calibrated tensors differ, computed
        by ORT's quantizer itself (``calc_graph_quant_params``, its range adjustments included) without re-running it
        over the graph (0.46 s of PP-OCRv4 det per range set; tests/tasks/quantization/test_qdq.py checks the two graphs equal)."""
        import onnx

        params = self._ort_quantizer(self.layers).calc_graph_quant_params()
        out = onnx.ModelProto()
        out.CopyFrom(full)
        for t in out.graph.initializer:
            for suffix, key in (("_scale", "scale"), ("_zero_point", "zero_point")):
                if t.name.endswith(suffix) and t.name[: -len(suffix)] in params:
                    v = np.asarray(params[t.name[: -len(suffix)]].original[key])
                    t.CopyFrom(self._np.from_array(v.astype(self._np.to_array(t).dtype).reshape(t.dims), t.name))
        return out

    def activations(self, name: str) -> list[str]:
        """The calibrated tensors that get Q/DQ when layer ``name`` is quantized (a residual Add: its skip input)."""
        ins = self._float_inputs[name]
        ins = [ins[self.residual[name]]] if name in self.residual else ins
        return [i for i in ins if i in self.ranges.data]

    def model(self, names: list[str]):
        """The graph that ships: the Q/DQ graph of ``names`` with every other op at ``high_precision``."""
        m = self.qdq(names)
        if self.high_precision == "fp16":
            m, _ = self.fp16(m)  # it sorts the graph first (ORT's quantizer appends its Q/DQ nodes)
        return m

    def fp16(self, m):
        """``m`` (a Q/DQ graph of this model) with its float remainder in fp16, kept fp32 where the fp16 checks keep
        it (the data's hazards, the fp16 search's nodes): (the model, the conversion's stats)."""
        return fp16_from_onnx(m, self.keep_fp32, self.cancel_fp32, self.tiny_fp32, self.keep_nodes)

    def qdq(self, names: list[str]):
        """The Q/DQ graph with exactly the layers ``names`` quantized (derived from the all-layers graph), in fp32."""
        import onnx

        m = onnx.ModelProto()
        if not names:
            m.CopyFrom(self.base)
            return m
        if self._full is None:
            parent = self._rescale_from
            self._full = self._rescaled(parent.qdq(parent.layers)) if parent is not None else self.quantize(self.layers)
        m.CopyFrom(self._full)
        keep = set(names)
        restore = {n: self._float_inputs[n] for n in self.layers if n not in keep}
        if restore:
            g = m.graph
            for node in g.node:
                if node.name in restore:
                    del node.input[:]
                    node.input.extend(restore[node.name])
            have = {t.name for t in g.initializer}
            needed = {i for ins in restore.values() for i in ins}
            g.initializer.extend(t for name, t in self._weights.items() if name in needed and name not in have)
            prune_unused(g, ops=QDQ_OPS, keep_initializer=lambda t: t.name in self._weights)
        return m

    def quantize(self, names: list[str]):
        """ORT's QDQQuantizer on ``names`` (int8; rewritten as fp8 for precision fp8)."""
        m = self._ort_quantizer(names).quantize_model()
        if self.precision == "fp8":
            self._to_fp8(m)
        return float_for_other_consumers(m, self.residual)

    def _ort_quantizer(self, names: list[str]):
        """ORT's QDQQuantizer over a copy of the model with these ranges, quantizing ``names``."""
        import onnx
        from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

        m = onnx.ModelProto()
        m.CopyFrom(self.base)
        return QDQQuantizer(m, True, False, self.qtype, self.qtype, self.ranges, list(names), [],
                            list(QUANT_OPS + RESIDUAL_OPS), dict(EXTRA_OPTIONS))

    def _fp8_weight(self, name: str, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(float8 weight, float32 scale): per-channel along ``axis`` (per-tensor if None), max|w| / 448."""
        key = (name, axis)
        if key not in self._fp8_weights:
            from ml_dtypes import float8_e4m3fn

            w = self._np.to_array(self._weights[name]).astype(np.float32)
            if axis is None:
                scale = np.array(fp8_scale(float(np.abs(w).max(initial=0.0))), dtype=np.float32)
                q = (w / scale).astype(float8_e4m3fn)
            else:
                ax = axis % w.ndim
                amax = np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != ax), initial=0.0)
                scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
                shape = [1] * w.ndim
                shape[ax] = -1
                q = (w / scale.reshape(shape)).astype(float8_e4m3fn)
            self._fp8_weights[key] = (q, scale)
        return self._fp8_weights[key]

    def _to_fp8(self, model) -> None:
        """Rewrite an int8 Q/DQ graph (in place) as float8 E4M3FN with amax / 448 scales and zero points 0."""
        from ml_dtypes import float8_e4m3fn
        from onnx import TensorProto

        np_ = self._np
        g = model.graph
        inits = {t.name: i for i, t in enumerate(g.initializer)}
        new: dict[str, np.ndarray] = {}
        for n in g.node:
            if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
                continue
            src, scale_name = n.input[0], n.input[1]
            zp_name = n.input[2] if len(n.input) > 2 else ""
            axis = next((a.i for a in n.attribute if a.name == "axis"), None)
            if n.op_type == "DequantizeLinear" and src in inits:  # weight_quantized -> DQ
                w_name = src[: -len("_quantized")] if src.endswith("_quantized") else None
                if w_name not in self._weights:
                    raise StageError(f"fp8: cannot find the float weight behind quantized initializer {src!r}",
                                     stage=STAGE)
                per_channel = np_.to_array(g.initializer[inits[scale_name]]).ndim > 0
                q, scale = self._fp8_weight(w_name, axis if per_channel else None)
                if per_channel and axis is None:
                    raise StageError(f"fp8: per-channel DequantizeLinear {n.name!r} has no axis", stage=STAGE)
                new[src], new[scale_name] = q, scale
            else:  # activation Q (or its DQ, which shares the scale/zero point initializers)
                if n.op_type == "DequantizeLinear":
                    continue
                if src not in self._amax:
                    raise StageError(f"fp8: no calibrated range for activation {src!r}", stage=STAGE)
                new[scale_name] = np.array(fp8_scale(self._amax[src]), dtype=np.float32)
            if zp_name:
                new[zp_name] = np.zeros(np.shape(new[scale_name]), dtype=float8_e4m3fn)
        for name, arr in new.items():
            g.initializer[inits[name]].CopyFrom(np_.from_array(arr, name))
        for vi in list(g.value_info) + list(g.output):  # shape inference may have typed Q outputs as int8
            t = vi.type.tensor_type
            if t.elem_type == TensorProto.INT8:
                t.elem_type = TensorProto.FLOAT8E4M3FN
        left = [n.name for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[1] not in new]
        if left:
            raise StageError(f"fp8: Q/DQ nodes {left[:3]} were not rewritten", stage=STAGE)

    def outputs(self, names: list[str], feeds) -> list[dict[str, np.ndarray]] | None:
        """The written graph of ``names`` run by ONNX Runtime on ``feeds``; None when ONNX Runtime cannot run it
        (float8 Q/DQ on a CPU build: ``run_error`` says why; int8 always runs, else a StageError)."""
        if self.run_error is not None:
            return None
        try:
            run = precision_runner(self.model(names), "basic" if self.precision == "fp8" else "all", stage=STAGE)[0]
            return [run(f) for f in feeds]
        except StageError as e:
            if self.precision == "int8":
                raise StageError(f"ONNX Runtime cannot run the int8 Q/DQ graph: {e.message}", stage=STAGE) from e
            self.run_error = e.message
            return None

    def write(self, names: list[str], path: Path) -> None:
        import onnx

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        onnx.save(self.model(names), str(tmp))
        tmp.replace(path)


def amax_of(tensor_data) -> float:
    lo, hi = tensor_data.range_value
    return float(np.abs(np.concatenate([np.ravel(lo), np.ravel(hi)]).astype(np.float64)).max(initial=0.0))


def fp8_scale(amax: float) -> float:
    """amax / 448; 1 for all-zero (or non-finite) ranges -- any positive scale represents zeros exactly."""
    return amax / FP8_MAX if math.isfinite(amax) and amax > 0 else 1.0


def residual_adds(g) -> dict[str, int]:
    """Adds of a Conv/ConvTranspose output and another activation (a residual connection): Add name -> index of the
    skip input. TensorRT fuses such an Add into the convolution when the skip input is quantized (ModelOpt puts Q/DQ
    there, not on the convolution's own output). Adds whose both or neither inputs come from a convolution, or with a
    constant input, are left alone."""
    producer = {o: n for n in g.node for o in n.output}
    consts = {t.name for t in g.initializer}
    out = {}
    for n in g.node:
        if n.op_type not in RESIDUAL_OPS or len(n.input) != 2 or any(i in consts or i not in producer for i in n.input):
            continue
        conv = [producer[i].op_type in ("Conv", "ConvTranspose") for i in n.input]
        if sum(conv) == 1:
            out[n.name] = conv.index(False)
    return out


def float_for_other_consumers(model, residual: dict[str, int] | None = None):
    """ORT's quantizer can route a shared activation's other consumers (e.g. Resize) through the DQ even with
    DedicatedQDQPair: point them back to the float tensor so Q/DQ feeds only Conv/MatMul/Gemm inputs and the skip
    input of the residual Adds in ``residual`` (Add name -> skip input index)."""
    residual = residual or {}
    g = model.graph
    q_src = {n.output[0]: n.input[0] for n in g.node if n.op_type == "QuantizeLinear"}
    dq_src = {n.output[0]: q_src[n.input[0]] for n in g.node
              if n.op_type == "DequantizeLinear" and n.input[0] in q_src}
    for n in g.node:
        if n.op_type in QUANT_OPS or n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for i, name in enumerate(n.input):
            if name in dq_src and residual.get(n.name) != i:
                n.input[i] = dq_src[name]
    _positive_scales(g)
    prune_unused(g, ops=QDQ_OPS)
    return model


def _positive_scales(g) -> None:
    """All-zero weight channels (or all-zero activations) get scale 0 from ORT's fp8 path; TensorRT's parser
    rejects non-positive scales. Any positive scale represents zeros exactly, so use 1."""
    from onnx import numpy_helper

    scales = {n.input[1] for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
    for i, t in enumerate(g.initializer):
        if t.name in scales:
            a = numpy_helper.to_array(t)
            if a.dtype.kind == "f" and (a <= 0).any():
                g.initializer[i].CopyFrom(numpy_helper.from_array(np.where(a > 0, a, 1).astype(a.dtype), t.name))


def quantized_activations(model_path: Path) -> set[str]:
    """Activations that can get Q/DQ: the float inputs of Conv/ConvTranspose/MatMul/Gemm and residual skip inputs."""
    import onnx

    g = onnx.load(str(model_path), load_external_data=False).graph
    inits = {t.name for t in g.initializer}
    names = {i for n in g.node if n.op_type in QUANT_OPS for i in n.input[:2] if i not in inits}
    by_name = {n.name: n for n in g.node}
    return names | {by_name[a].input[k] for a, k in residual_adds(g).items()}
