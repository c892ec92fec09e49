"""What fp16 would break on the user's data, judged on the fp32 model in ONNX Runtime: values beyond fp16's range,
subtractions that cancel in fp16 (their operands are then computed in fp32) and values below fp16's normal range.
The converter (tasks/fp16/convert.py) keeps the nodes these name in fp32."""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

# A node reading or making values above this on the user's data stays fp32: 2x headroom under fp16's largest finite
# value (65504) for data the sample did not show. ModelOpt AutoCast's default is 512 (build.fp16_data_max=512 does
# the same), which on PP-OCRv4 det keeps convs reading ~3000-valued feature maps in fp32 (52% of its FLOPs measured)
# although fp16 holds them with its usual relative precision; 8192 still kept a conv whose outputs reach ~22000 (22%).
DATA_MAX = 32768.0
RANGE_FEEDS = 4  # feeds the range check runs on
EXPOSED_MIB = 1024  # the values one run exposes at most; a model whose values take more on a feed is run in parts


# fp16's unit roundoff: an fp16 value is off by up to this fraction of itself
FP16_EPS = 2.0 ** -11
# fp16's smallest normal value (6.1e-5): below it values are subnormal (precision lost) or flushed to zero
FP16_TINY = 2.0 ** -14
# a value that fp16's subnormal range would leave more than this wrong (relative L2, from its elements below FP16_TINY
# alone) is kept fp32 with its nodes: as MAX_REL_ERROR (tasks/fp16/convert.py) does for initializers (values ~1e-7: ~17%; ~1e-5: ~0.2%)
UNDERFLOW_MAX = 1e-2
# A Sub/Add whose fp16 operands would make its result this wrong is a harmful cancellation: relative L2 error over the
# result, or, where it feeds a divisor, square root or log, the error of a tenth of its elements (the
# CANCEL_PERCENTILE-th percentile), each relative to itself
CANCEL_MAX_ERROR = 1e-2
CANCEL_PERCENTILE = 90
# ops that blow a small value's relative error up into the result (the input index that does, None: any)
AMPLIFIERS = {"Sqrt": 0, "Reciprocal": 0, "Log": 0, "Div": 1, "Pow": 0}
# ops a value passes through on its way to one (a LayerNorm's Max(var, 0), + eps, reshapes, casts, 1/n scaling)
PASS_THROUGH = ("Max", "Min", "Add", "Mul", "Reshape", "Expand", "Squeeze", "Unsqueeze", "Cast", "Identity",
                "Transpose", "Abs", "Relu", "Clip")
AMPLIFIER_DEPTH = 6
# A masked fill (Where(mask, x, -inf), scores + (1 - mask) * -1e9) writes -inf or a large negative number where a
# position is padded, for the Softmax (or Exp) it reaches to zero out: fp16 zeroes it alike (its -inf, or -65504 after
# the fill constant's own fp32 node), so those elements are no reason to keep a node fp32. A value that reaches one
# within FILL_DEPTH ops through FILL_PATH ops is judged on its other elements when its out-of-range ones are all
# negative (one-sided: a fill, not an overflow) and none is NaN.
FILL_SINKS = ("Softmax", "LogSoftmax", "Exp")
FILL_PATH = ("Add", "Sub", "Where", "Mul", "Div", "Reshape", "Expand", "Squeeze", "Unsqueeze", "Cast", "Identity",
             "Transpose", "Slice", "Concat", "Max", "Min")
FILL_DEPTH = 6
CANCEL_DEPTH = 12  # how far up the two operands' producers are followed to the value they share
CANCEL_CONE_MAX = 24  # a cone larger than this keeps only the subtraction and its operands' producers fp32


def fp16_hazards_from_data(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]],
                           data_max: float = DATA_MAX, underflow: bool = False) -> tuple[dict[str, float], ...]:
    """What fp16 would break on ``feeds`` (the user's data), judged on the fp32 model in ONNX Runtime with every float
    value exposed (in parts of at most EXPOSED_MIB for a feed whose values take more, _exposed_runs), one feed at a
    time (at most RANGE_FEEDS):

    * range: {value: max |value|} for every node output (or graph input) above ``data_max`` in magnitude or not
      finite; the nodes making or reading it stay fp32 (as ModelOpt AutoCast classifies nodes by magnitude);
    * cancellation: {value: estimated relative error} for the values a subtraction of nearly equal numbers is computed
      from. A Sub (or an Add of opposite signs) of operands rounded to fp16 is off by about FP16_EPS x (|a| + |b|),
      which is a large share of a - b when the two nearly cancel: x - mean(x) of values far from zero, and a
      variance taken as E[x^2] - E[x]^2 (Flax's LayerNorm, jax2tf exports), whose small elements 1/sqrt(var + eps)
      then blows up. Where the result would be more than CANCEL_MAX_ERROR wrong on the data (relative L2; for a
      result that divides or goes under a square root or log, a tenth of its elements each), its operands are
      computed in fp32 from the value the two share (e.g. the LayerNorm's input, which stays fp16): the producers
      between it and the subtraction, and the subtraction itself;
    * underflow (with ``underflow``, a third dict): {value: the relative L2 error fp16 gives its elements below fp16's
      normal range (FP16_TINY, ~6.1e-5, where fp16 is subnormal: steps of 6e-8)} for every value where it exceeds
      UNDERFLOW_MAX (a scaled-down intermediate); the nodes making or reading it stay fp32, as the range check does
      for values above ``data_max``.

    Values, not node names: names are given to unnamed nodes later."""
    if not feeds:
        return ({}, {}, {}) if underflow else ({}, {})
    g = model.graph
    floats = _float_values(g)
    consts = {t.name: t for t in g.initializer}
    subtractions = [n for n in g.node if n.op_type in ("Sub", "Add") and len(n.input) == 2 and all(n.input)]
    amplified = {id(n) for n in _amplified(g, subtractions)}
    peak: dict[str, float] = {}
    tiny: dict[str, float] = {}  # value -> fp16's error from its elements below the normal range (the worst feed)
    whole: dict[int, list[float]] = {}  # subtraction -> [sum |a|^2 + |b|^2 (broadcast), sum |result|^2] over the feeds
    spread: dict[int, list[np.ndarray]] = {}  # amplified subtraction -> its elements' fp16 relative errors
    fills = _before_softmax(g)
    for names, run_feeds in _exposed_runs(model, floats, subtractions, feeds[:RANGE_FEEDS]):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        sess = _session_exposing(m, names)
        del m
        for feed in run_feeds:
            held = _values_on(sess, names, feed)
            bad = _record_extremes(held, peak, tiny, underflow, fills, data_max)
            _record_cancellations(held, consts, subtractions, amplified, bad, whole, spread)
        del sess
    over = {n: v for n, v in peak.items() if not v <= data_max}
    cancel = _cancelled_values(g, subtractions, whole, spread, set(floats))
    if underflow:
        return over, cancel, {n: v for n, v in tiny.items() if n not in over}
    return over, cancel


def _float_values(g: onnx.GraphProto) -> list[str]:
    """The node outputs of ``g`` that are (or may be: no type recorded) float, in graph order."""
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.value_info, *g.output, *g.input)}
    return [o for n in g.node for o in n.output
            if o and types.get(o, TensorProto.FLOAT) in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)]


def _exposed_runs(model: onnx.ModelProto, floats: list[str], subtractions: list[onnx.NodeProto],
                  feeds: list[dict[str, np.ndarray]]) -> list[tuple[list[str], list[dict[str, np.ndarray]]]]:
    """The runs that judge ``feeds``: (values exposed, the feeds run so). The feeds whose values all fit in EXPOSED_MIB
    run once each with every value exposed; the others in parts sized on the largest of them, a subtraction's operands
    and result in one part (its cancellation is judged from the three at once). Every exposed value stays alive until
    its run ends: a TTS model's float values at 32 tokens took 7.6 GB at once. PP-OCRv4 det's pages of 32x32 to
    1280x1280 ran in 3 parts each, 12 runs; now 6, only the 1280x1280 page in parts."""
    sizes = _sizes_by_feed(model, floats, feeds)
    if sizes is None:
        return [(floats, feeds)]
    whole = [f for f, size in zip(feeds, sizes) if sum(size.values()) <= EXPOSED_MIB << 20]
    apart = [(f, size) for f, size in zip(feeds, sizes) if sum(size.values()) > EXPOSED_MIB << 20]
    runs = [(floats, whole)] if whole else []
    if apart:
        largest = {n: max(size[n] for _, size in apart) for n in floats}
        runs += [(part, [f for f, _ in apart]) for part in _parts(floats, subtractions, largest)]
    return runs


def _sizes_by_feed(model: onnx.ModelProto, floats: list[str],
                   feeds: list[dict[str, np.ndarray]]) -> list[dict[str, int]] | None:
    """Per feed, {value: bytes} of ``floats`` on its first sample (a model that takes no other batch: the whole feed):
    from ONNX shape inference, without a run, where it knows every value's shape; else from ONNX Runtime's profile of
    a plain run; None when neither can size them. Each distinct input shape is sized once."""
    known: dict[tuple, dict[str, int] | None] = {}
    out = []
    for f in feeds:
        sample = {k: (v[:1] if getattr(v, "ndim", 0) else v) for k, v in f.items()} if _batched(f) else f
        shape = tuple(sorted((k, tuple(np.shape(v))) for k, v in sample.items()))
        if shape not in known:
            size = _static_sizes(model, floats, [sample])
            known[shape] = size if size is not None else _profiled_sizes(model, floats, [sample], [f])
        if known[shape] is None:
            return None
        out.append(known[shape])
    return out


def _parts(floats: list[str], subtractions: list[onnx.NodeProto], size: dict[str, int]) -> list[list[str]]:
    """``floats`` in parts of at most EXPOSED_MIB by ``size`` (one when they all fit), a subtraction's operands and
    result in one part."""
    if sum(size.values()) <= EXPOSED_MIB << 20:
        return [floats]
    wanted = set(floats)
    group = {n: i for i, n in enumerate(floats)}  # each value its own group; a subtraction's three values one group
    members: dict[int, list[str]] = {i: [n] for i, n in enumerate(floats)}
    for n in subtractions:
        ids = sorted({group[x] for x in (*n.input, n.output[0]) if x in wanted})
        for other in ids[1:]:
            for x in members.pop(other, []):
                group[x] = ids[0]
                members[ids[0]].append(x)
    parts, part, used = [], [], 0
    for i in sorted(members):
        need = sum(size[x] for x in members[i])
        if part and used + need > EXPOSED_MIB << 20:
            parts.append(part)
            part, used = [], 0
        part += members[i]
        used += need
    return parts + ([part] if part else [])


def _distinct_shapes(feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """One feed per distinct set of input shapes (sizes depend on shapes only)."""
    seen: dict[tuple, dict[str, np.ndarray]] = {}
    for f in feeds:
        seen.setdefault(tuple(sorted((k, tuple(np.shape(v))) for k, v in f.items())), f)
    return list(seen.values())


def _static_sizes(model: onnx.ModelProto, floats: list[str], samples: list[dict[str, np.ndarray]]) -> dict[str, int] | None:
    """{value: bytes} of ``floats`` at each sample's input shapes (the largest over samples) from ONNX shape inference,
    without running the model; None when inference leaves a value's shape or type unknown."""
    from tasks.graph.flops import inferred_at

    size = dict.fromkeys(floats, 0)
    for sample in _distinct_shapes(samples):
        m = inferred_at(model, {k: np.shape(v) for k, v in sample.items()})
        if m is None:
            return None
        known = {}
        for vi in (*m.graph.value_info, *m.graph.output):
            t = vi.type.tensor_type
            if t.elem_type and t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
                known[vi.name] = int(np.prod([d.dim_value for d in t.shape.dim], dtype=np.int64)) * \
                    onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
        del m
        if any(n not in known for n in floats):
            return None
        for n in floats:
            size[n] = max(size[n], known[n])
    return size


def _profiled_sizes(model: onnx.ModelProto, floats: list[str], samples: list[dict[str, np.ndarray]],
                    feeds: list[dict[str, np.ndarray]]) -> dict[str, int] | None:
    """{value: bytes} of ``floats`` from ONNX Runtime's profile of plain runs (tasks.partition.segments.tensor_shapes)
    of one sample per distinct input shape; None when the model cannot run here."""
    from tasks.partition.segments import tensor_shapes

    try:
        runs = tensor_shapes(model, floats, _distinct_shapes(samples))
    except Exception:  # noqa: BLE001 - a model that takes no other batch (or cannot run here): sized on the whole feeds
        try:
            runs = tensor_shapes(model, floats, _distinct_shapes(feeds))
        except Exception:  # noqa: BLE001 - the range check itself reports why the model cannot run
            return None
    return {n: max((int(np.prod(r[n][0], dtype=np.int64)) * np.dtype(r[n][1]).itemsize for r in runs if n in r),
                   default=0) for n in floats}


def _session_exposing(m: onnx.ModelProto, floats: list[str]):
    """An ONNX Runtime CPU session of ``m`` with ``floats`` added to its graph outputs (``m`` is edited so), its graph
    run as written."""
    import onnxruntime as ort

    g = m.graph
    have = {o.name for o in g.output}
    g.output.extend(onnx.ValueInfoProto(name=o) for o in floats if o not in have)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the values of the graph as written
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _values_on(sess, names: list[str], feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{value: array} of every output ``names`` and graph input on the feed's first sample (the whole feed when the
    model takes no other batch)."""
    one = {k: (v[:1] if getattr(v, "ndim", 0) else v) for k, v in feed.items()} if _batched(feed) else feed
    try:
        values = sess.run(names, one)  # a sample of each feed (values do not grow with the batch)
    except Exception:  # noqa: BLE001 - a model that takes no other batch: the whole feed
        values, one = sess.run(names, feed), feed
    return {**dict(zip(names, values)), **one}


def _record_extremes(held: dict[str, np.ndarray], peak: dict[str, float], tiny: dict[str, float],
                     underflow: bool, fills: set[str] = frozenset(), data_max: float = DATA_MAX) -> set[str]:
    """Raise ``peak`` (value -> max |value|, inf when not finite) and, with ``underflow``, ``tiny`` (value -> fp16's
    error below its normal range, where above UNDERFLOW_MAX) to this feed's ``held`` values; returns the values not
    finite in this feed. A value in ``fills`` (it reaches a Softmax: FILL_SINKS) whose elements beyond ``data_max``
    are all negative fills is measured on its other elements."""
    bad = set()  # values not finite in this feed
    for name, value in held.items():  # graph inputs too: their readers
        a = np.asarray(value)
        if a.dtype.kind != "f" or a.size == 0:
            continue
        top = max(float(a.max()), -float(a.min()))  # |x|'s max without a copy; NaN and inf propagate
        if not np.isfinite(top):
            bad.add(name)
        if name in fills and not top <= data_max and float(a.max()) <= data_max:  # a masked fill, no NaN, no +big
            rest = a[a > -data_max]
            top = max(float(rest.max()), -float(rest.min())) if rest.size else 0.0
        top = top if np.isfinite(top) else float("inf")
        peak[name] = max(peak.get(name, 0.0), top)
        if top < float("inf") and underflow and top > 0:
            lost = _underflow_error(a)
            if lost > UNDERFLOW_MAX:
                tiny[name] = max(tiny.get(name, 0.0), lost)
    return bad


def _record_cancellations(held: dict[str, np.ndarray], consts: dict[str, onnx.TensorProto],
                          subtractions: list[onnx.NodeProto], amplified: set[int], bad: set[str],
                          whole: dict[int, list[float]], spread: dict[int, list[np.ndarray]]) -> None:
    """Add this feed's ``held`` values to each subtraction's sums in ``whole`` (its operands' and its result's squared
    norms) and, for an ``amplified`` one, its elements' fp16 relative errors to ``spread``; subtractions reading or
    making a value in ``bad`` (not finite) are skipped."""
    norms: dict[str, float] = {}

    def square_norm(name: str, x: np.ndarray) -> float:  # of a value of this feed (one pass, no copy)
        if name not in norms:
            flat = np.ascontiguousarray(x, np.float32).ravel()
            with np.errstate(over="ignore", invalid="ignore"):
                norms[name] = float(np.dot(flat, flat))
        return norms[name]

    for i, n in enumerate(subtractions):
        out = held.get(n.output[0])  # computed by ONNX Runtime already
        ops = [held.get(x) if x in held else (numpy_helper.to_array(consts[x]) if x in consts else None)
               for x in n.input]
        if out is None or any(o is None or np.asarray(o).dtype.kind != "f" for o in ops) or \
                bad & {n.output[0], *n.input}:
            continue
        a, b = (np.asarray(o) for o in ops)
        out = np.asarray(out)
        if out.size == 0 or out.size % a.size or out.size % b.size:
            continue
        # the operands' fp16 rounding errors are independent: the result's error has the squared norm
        # FP16_EPS^2 (|a|^2 + |b|^2), a broadcast operand counted once per copy (its error is repeated)
        s2 = sum(square_norm(x, o) * (out.size // o.size) for x, o in zip(n.input, (a, b)))
        o2 = square_norm(n.output[0], out)
        if not (np.isfinite(s2) and np.isfinite(o2)):
            continue  # beyond fp16's range anyway: the range check keeps these nodes
        acc = whole.setdefault(i, [0.0, 0.0])
        acc[0] += s2
        acc[1] += o2
        if id(n) in amplified:
            try:
                size = np.broadcast_to(np.abs(a) + np.abs(b), out.shape)
            except ValueError:
                continue
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = FP16_EPS * size / np.abs(out)  # each element's: fp16 operands' rounding, relative to it
            spread.setdefault(i, []).append(np.nan_to_num(rel.ravel(), nan=0.0, posinf=np.inf))


def _cancelled_values(g: onnx.GraphProto, subtractions: list[onnx.NodeProto], whole: dict[int, list[float]],
                      spread: dict[int, list[np.ndarray]], float_values: set[str]) -> dict[str, float]:
    """{value: estimated relative error} for the float values of each subtraction's cancellation cone
    (``_cancellation_cone``) whose fp16 result would be more than CANCEL_MAX_ERROR wrong on the data."""
    cancel: dict[str, float] = {}
    producer = {o: n for n in g.node for o in n.output if o}
    for i, (size2, out2) in whole.items():
        err = FP16_EPS * (size2 / out2) ** 0.5 if out2 > 0 else 0.0  # the result's relative L2 error
        if i in spread:
            err = max(err, float(np.percentile(np.concatenate(spread[i]), CANCEL_PERCENTILE)))
        if err > CANCEL_MAX_ERROR:
            for v in _cancellation_cone(producer, subtractions[i]):
                if v in float_values:
                    cancel[v] = max(cancel.get(v, 0.0), err)
    return cancel


def _underflow_error(a: np.ndarray, chunk: int = 1 << 22) -> float:
    """The relative L2 error (against all of ``a``) that fp16 gives ``a``'s elements below its normal range
    (FP16_TINY): subnormal fp16 keeps steps of 2^-24 there, so ~1e-7 values lose most of their digits. One float32 dot
    product first: the error is at most sqrt(n) 2^-25 / |a|, which rules out nearly every tensor at once."""
    flat = np.ascontiguousarray(a, np.float32).ravel()
    with np.errstate(over="ignore", invalid="ignore"):
        energy = float(np.dot(flat, flat))
    if not np.isfinite(energy) or flat.size * 2.0 ** -50 <= UNDERFLOW_MAX ** 2 * energy:
        return 0.0
    err = 0.0
    for i in range(0, flat.size, chunk):
        x = flat[i:i + chunk]
        tiny = x[np.abs(x) < FP16_TINY].astype(np.float64)
        d = tiny.astype(np.float16).astype(np.float64) - tiny
        err += float(np.dot(d, d))
    return (err / energy) ** 0.5 if energy > 0 else 0.0


def _amplified(g: onnx.GraphProto, subtractions: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The ``subtractions`` (Sub/Add nodes) whose result reaches a divisor, square root or log (AMPLIFIERS) within AMPLIFIER_DEPTH nodes
    through PASS_THROUGH ops: where a cancelled, mostly-rounding-error small value is blown up (a variance under
    1/sqrt(var + eps)). Elsewhere an fp16 cancellation's error stays small next to the tensor's other values."""
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = collections.defaultdict(list)
    for n in g.node:
        for k, x in enumerate(n.input):
            if x:
                readers[x].append((n, k))

    seen: dict[tuple[str, int], bool] = {}

    def amplified(value: str, depth: int) -> bool:
        if (value, depth) not in seen:
            seen[(value, depth)] = any(
                (r.op_type in AMPLIFIERS and AMPLIFIERS[r.op_type] in (None, k)) or
                (depth > 1 and r.op_type in PASS_THROUGH and any(amplified(o, depth - 1) for o in r.output if o))
                for r, k in readers.get(value, []))
        return seen[(value, depth)]

    return [n for n in subtractions if any(amplified(o, AMPLIFIER_DEPTH) for o in n.output if o)]


def _before_softmax(g: onnx.GraphProto) -> set[str]:
    """The values that reach a FILL_SINKS op within FILL_DEPTH ops through FILL_PATH ops (where a masked fill goes)."""
    readers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for n in g.node:
        for x in n.input:
            if x:
                readers[x].append(n)
    seen: dict[tuple[str, int], bool] = {}

    def reaches(value: str, depth: int) -> bool:
        if (value, depth) not in seen:
            seen[(value, depth)] = False
            seen[(value, depth)] = any(
                r.op_type in FILL_SINKS or
                (depth > 1 and r.op_type in FILL_PATH and any(reaches(o, depth - 1) for o in r.output if o))
                for r in readers.get(value, []))
        return seen[(value, depth)]

    values = [o for n in g.node for o in n.output if o] + [i.name for i in g.input]
    return {v for v in values if reaches(v, FILL_DEPTH)}


def _cancellation_cone(producer: dict[str, onnx.NodeProto], node: onnx.NodeProto) -> list[str]:
    """The values to compute in fp32 for ``node``'s subtraction to be exact up to fp32: its output, and every value
    on the paths from the nearest value its two operands share (not included) to its operands (included).
    ``producer``: value -> the node making it."""

    def upward(v: str) -> set[str]:
        seen, frontier = {v}, [v]
        for _ in range(CANCEL_DEPTH):
            frontier = [x for f in frontier if f in producer for x in producer[f].input if x and x not in seen]
            seen.update(frontier)
        return seen

    a, b = (upward(x) for x in node.input)
    shared = a & b
    upstream = set().union(*(upward(x) - {x} for x in shared)) if shared else set()
    cone = [v for v in (a | b) - shared - upstream if v in producer]
    if not shared or len(cone) > CANCEL_CONE_MAX:
        cone = [x for x in node.input if x in producer]
    return [o for o in node.output if o] + sorted(cone)


def _batched(feed: dict) -> bool:
    """Whether every input of a feed shares its leading (batch) axis, so that its first sample is a feed too."""
    lengths = {v.shape[0] for v in feed.values() if getattr(v, "ndim", 0)}
    return len(lengths) == 1 and lengths.pop() > 1
