"""Precision boundaries of an int8/fp8 engine: the tensors that change precision outside a fused Q/DQ pattern, each a
reformat on the GPU (the reason an int8 engine that keeps many small layers in fp16 can be slower than the fp16 one).

Estimated on the TensorRT network the FLOPs shares are estimated on (tasks/trt/network.py: the precision graph parsed
at the first optimization profile's opt shape, each layer's precision from the network's tensor types), as a plain
graph of layers and tensors, so the rule is checked without TensorRT:

* TensorRT fuses ``DQ -> convolution/deconvolution/matrix multiply -> pointwise epilogue -> Q`` into one kernel that
  reads and writes int8 (fp8): inside that pattern no tensor changes precision. The epilogue and the data movement
  around it pass a tensor on (``CARRIERS``: elementwise, activation, unary, scale, shuffle, slice, concatenation, ...).
* into int8/fp8: a Quantize layer whose input is not the output of an int8/fp8 layer (traced back through carriers) is
  a conversion of its own: the float tensor it reads crosses a boundary (fp16 -> int8).
* out of int8/fp8: an int8/fp8 layer whose output reaches (through carriers) a layer other than Quantize, or a network
  output: that output leaves the quantized type in the float type of its tensor (int8 -> fp16).
* between floats: a Cast layer from one float type to another (fp32 <-> fp16), e.g. at a graph input or output or
  around a layer kept in fp32.

Conversions in a row are one (fp32 -> Cast -> fp16 -> Quantize is one fp32 -> int8 reformat). A boundary's bytes are
the size at the opt shape of the larger of the tensors it reads and writes, in the types they have in the network (an
unknown dimension counted as 1, and said). The engine's own layer list
(``reformats_from_engine``, IEngineInspector) is the measurement where a GPU of the target can deserialize the engine:
TensorRT may fuse more (a Quantize into the pointwise layer before it) or less than this estimate assumes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# layers that pass a tensor on inside a fused Q/DQ pattern: a quantized layer's pointwise epilogue and data movement
CARRIERS = frozenset({"ELEMENTWISE", "ACTIVATION", "UNARY", "SCALE", "SHUFFLE", "SQUEEZE", "UNSQUEEZE", "SLICE",
                      "CONCATENATION", "IDENTITY", "PADDING"})
QUANTIZED = ("int8", "fp8")
FLOATS = ("fp32", "fp16", "bf16")
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1, "int32": 4, "int64": 8, "bool": 1, "uint8": 1}
NETWORK_SOURCE = ("estimate on the TensorRT network at the opt shape (tensors changing precision outside a fused "
                  "DQ -> op -> Q pattern; tasks/trt/boundaries.py)")


@dataclass(frozen=True)
class Tensor:
    dtype: str | None  # fp32, fp16, bf16, int8, fp8, int32, ... (None: a type this module does not size)
    elements: int  # at the opt shape, unknown dims counted as 1
    unknown_dims: int = 0

    @property
    def bytes(self) -> int:
        return self.elements * ELEMENT_BYTES.get(self.dtype or "", 0)


@dataclass(frozen=True)
class Layer:
    name: str
    kind: str  # TensorRT's LayerType name (CONVOLUTION, QUANTIZE, CAST, ...)
    precision: str | None  # as tasks/trt/network.py assigns it
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def boundaries_from_layers(layers: list[Layer], tensors: dict[str, Tensor], network_outputs: list[str]) -> list[dict]:
    """Every precision boundary of the network: ``{"tensor", "from", "to", "bytes", "layer"}`` (``layer``: the one
    that converts it: the Quantize, the Cast, or the quantized layer whose output leaves its type)."""
    producer = {t: L for L in layers for t in L.outputs}
    consumers: dict[str, list[Layer]] = {}
    for L in layers:
        for t in L.inputs:
            consumers.setdefault(t, []).append(L)
    outputs = set(network_outputs)

    def from_quantized(t: str, seen: set[str]) -> bool:
        """Whether tensor ``t`` is computed by an int8/fp8 layer, through carriers."""
        if t in seen:
            return False
        seen.add(t)
        p = producer.get(t)
        if p is None:
            return False
        if p.precision in QUANTIZED and p.kind not in CARRIERS:
            return True
        if p.kind in CARRIERS:
            return any(from_quantized(i, seen) for i in p.inputs)
        return False

    def leaves(t: str, seen: set[str]) -> bool:
        """Whether tensor ``t`` reaches, through carriers, a layer other than Quantize or a network output."""
        if t in seen:
            return False
        seen.add(t)
        if t in outputs:
            return True
        for c in consumers.get(t, []):
            if c.kind == "QUANTIZE":
                continue
            if c.kind not in CARRIERS:
                return True
            if any(leaves(o, seen) for o in c.outputs):
                return True
        return False

    found: list[dict] = []

    def add(t: str, out: str, src: str | None, dst: str | None, layer: str) -> None:
        if src and dst and src != dst:
            a, b = tensors.get(t) or Tensor(None, 0), tensors.get(out) or Tensor(None, 0)
            found.append({"tensor": t, "out": out, "from": src, "to": dst, "bytes": max(a.bytes, b.bytes),
                          "layer": layer, "unknown_dims": max(a.unknown_dims, b.unknown_dims)})

    def dtype(t: str) -> str | None:
        return (tensors.get(t) or Tensor(None, 0)).dtype

    for L in layers:
        if L.kind == "QUANTIZE" and L.inputs and L.outputs:
            if not from_quantized(L.inputs[0], set()):
                add(L.inputs[0], L.outputs[0], dtype(L.inputs[0]), dtype(L.outputs[0]) or "int8", L.name)
        elif L.kind == "CAST" and L.inputs and L.outputs:
            if dtype(L.inputs[0]) in FLOATS and dtype(L.outputs[0]) in FLOATS:
                add(L.inputs[0], L.outputs[0], dtype(L.inputs[0]), dtype(L.outputs[0]), L.name)
        elif L.precision in QUANTIZED and L.kind not in CARRIERS:
            for t in L.outputs:
                if dtype(t) in FLOATS and leaves(t, set()):
                    add(t, t, L.precision, dtype(t), L.name)
    return _chained(found, consumers, outputs)


def _chained(found: list[dict], consumers: dict[str, list[Layer]], outputs: set[str]) -> list[dict]:
    """Conversions in a row are one reformat (fp32 -> Cast -> fp16 -> Quantize -> int8 is one fp32 -> int8 kernel; an
    int8 layer whose output only a Cast reads writes the Cast's type): a boundary whose converted tensor is read by
    the next boundary's layer alone (and is no network output) merges into it, from the first type to the last, its
    bytes the larger of the two."""
    by_input = {(b["tensor"], b["layer"]): b for b in found}
    merged, gone = [], set()  # found is in the network's (topological) order: a chain is met at its first link
    for b in found:
        if id(b) in gone:
            continue
        cur = dict(b)
        while True:
            readers = consumers.get(cur["out"], [])
            nxt = by_input.get((cur["out"], readers[0].name)) if len(readers) == 1 else None
            if nxt is None or cur["out"] in outputs or id(nxt) in gone or nxt is b:
                break
            gone.add(id(nxt))
            cur = {**cur, "out": nxt["out"], "to": nxt["to"], "bytes": max(cur["bytes"], nxt["bytes"]),
                   "layer": f"{cur['layer']} + {nxt['layer']}", "unknown_dims": max(cur["unknown_dims"],
                                                                                   nxt["unknown_dims"])}
        merged.append(cur)
    return merged


def boundary_metrics(boundaries: list[dict]) -> dict:
    """``network_reformat_layers`` / ``network_reformat_bytes``: the count and bytes of the estimated boundaries."""
    return {"network_reformat_layers": len(boundaries),
            "network_reformat_bytes": int(sum(b["bytes"] for b in boundaries))}


def reported(metrics: dict, engine: dict | None = None, engine_reason: str | None = None) -> dict:
    """The precision boundaries as a build reports them: ``reformat_layers`` / ``reformat_bytes`` from the engine's own
    layer list where it was read (``engine``: ``reformats_from_engine``), else the network estimate, with
    ``reformat_source`` saying which; the estimate stays under ``network_reformat_*`` and the engine's under
    ``engine_reformat_*``. {} without an estimate (a network with no int8/fp8 layer)."""
    if "network_reformat_layers" not in metrics:
        return {}
    out = {"network_reformat_layers": metrics["network_reformat_layers"],
           "network_reformat_bytes": metrics["network_reformat_bytes"]}
    if engine is not None:
        out["engine_reformat_layers"] = engine["reformat_layers"]
        if engine.get("reformat_bytes") is not None:
            out["engine_reformat_bytes"] = engine["reformat_bytes"]
        out["reformat_layers"] = engine["reformat_layers"]
        if engine.get("reformat_bytes") is not None:
            out["reformat_bytes"] = engine["reformat_bytes"]
        out["reformat_source"] = f"the engine's layer list (IEngineInspector) on {engine['device']}"
        return out
    out["reformat_layers"], out["reformat_bytes"] = out["network_reformat_layers"], out["network_reformat_bytes"]
    out["reformat_source"] = NETWORK_SOURCE + (f"; not read from the engine: {engine_reason}" if engine_reason else "")
    return out


def describe_boundaries(metrics: dict) -> str | None:
    """One line: the boundaries beside the FLOPs shares, or None without them."""
    if "reformat_layers" not in metrics:
        return None
    mb = metrics.get("reformat_bytes")
    size = f", {mb / 2**20:.2f} MiB at the opt shape" if mb is not None else ""
    where = ("read from the engine" if metrics.get("reformat_source", "").startswith("the engine")
             else "estimated on the TensorRT network")
    return f"{metrics['reformat_layers']} precision boundaries{size} ({where})"


def reformats_from_engine_info(info: str) -> dict:
    """The reformat layers of an engine's layer list as TensorRT's IEngineInspector gives it in JSON
    (``get_engine_information(LayerInformationFormat.JSON)``): ``{"Layers": [...]}`` where a layer is its name
    (``ProfilingVerbosity.LAYER_NAMES_ONLY``, the default) or an object with ``Name``, ``LayerType`` and ``Inputs`` /
    ``Outputs`` (``DETAILED``). A reformat is a layer of type ``Reformat`` or named ``Reformatting CopyNode ...``;
    its bytes (the size of what it writes, from ``Dimensions`` and ``Format/Datatype``) only with the detailed list,
    else None."""
    layers = json.loads(info).get("Layers", [])
    count, total, sized = 0, 0, True
    for L in layers:
        name = L if isinstance(L, str) else str(L.get("Name", ""))
        kind = "" if isinstance(L, str) else str(L.get("LayerType", ""))
        if kind != "Reformat" and not name.startswith("Reformatting CopyNode"):
            continue
        count += 1
        outs = [] if isinstance(L, str) else L.get("Outputs", [])
        if not outs:
            sized = False
        for o in outs:
            n = 1
            for d in o.get("Dimensions", []):
                n *= max(int(d), 1)
            fmt = str(o.get("Format/Datatype", "")).lower()
            size = next((b for k, b in (("int8", 1), ("fp8", 1), ("half", 2), ("fp16", 2), ("float", 4), ("fp32", 4),
                                         ("int32", 4)) if k in fmt), None)
            if size is None:
                sized = False
            else:
                total += n * size
    return {"reformat_layers": count, "reformat_bytes": total if sized else None}


def reformats_from_engine(engine_bytes: bytes, backend, device: str) -> dict:
    """The reformat layers of a serialized engine, read from its own layer list (IEngineInspector): needs a GPU of
    the engine's compute capability (a CPU-only host cannot deserialize it). ``device``: the GPU, in words."""
    from tasks.common.errors import StageError

    trt = backend.trt
    logger = backend.logger()
    engine = backend.runtime(logger).deserialize_cuda_engine(engine_bytes)
    if engine is None:
        raise StageError(f"TensorRT could not deserialize the engine to read its layer list: "
                         f"{'; '.join(logger.errors()) or 'no reason given'}", stage="build")
    inspector = engine.create_engine_inspector()
    out = reformats_from_engine_info(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    return {**out, "device": device}
