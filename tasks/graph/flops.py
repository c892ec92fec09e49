"""The FLOP model: one set of formulas (multiply-add = 2), applied to TensorRT layers (tasks/trt/network.py) and to
ONNX nodes alike; ``onnx_flops`` estimates an ONNX graph's per-node FLOPs at given input shapes."""
from __future__ import annotations


def conv_flops(out_elements: float, cin_per_group: float, kernel_elements: float) -> float:
    return 2.0 * out_elements * cin_per_group * kernel_elements


def deconv_flops(in_elements: float, cout_per_group: float, kernel_elements: float) -> float:
    return 2.0 * in_elements * cout_per_group * kernel_elements


def matmul_flops(out_elements: float, k: float) -> float:
    return 2.0 * out_elements * max(k, 1)


def pool_flops(out_elements: float, window_elements: float) -> float:
    return float(out_elements * window_elements)


# ONNX ops that only move, reshape, cast or (de)quantize data: 0 FLOPs (as NO_FLOPS for TensorRT layers)
ONNX_NO_FLOPS = {"Constant", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Concat", "Split",
                 "Gather", "GatherElements", "GatherND", "Cast", "CastLike", "Identity", "QuantizeLinear",
                 "DequantizeLinear", "Shape", "Size", "Pad", "Expand", "Tile", "ScatterND", "ScatterElements",
                 "ConstantOfShape", "Range", "NonZero", "OneHot", "If", "Loop", "Scan", "DepthToSpace", "SpaceToDepth"}


def inferred_at(model, shapes: dict):
    """A copy of ``model`` with the inputs in ``shapes`` fixed to them, shape-inferred (ONNX, with data propagation);
    None when inference fails."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for inp in m.graph.input:
        if inp.name in shapes:
            for d, v in zip(inp.type.tensor_type.shape.dim, shapes[inp.name]):
                d.Clear()
                d.dim_value = int(v)
    del m.graph.value_info[:]
    try:
        return onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception:  # noqa: BLE001
        return None


def onnx_flops(model, shapes: dict[str, list[int]], names: list[str] | None = None) -> dict[str, float]:
    """Estimated FLOPs per node (of ``names``, default all) with the inputs at ``shapes`` (ONNX shape inference),
    with the formulas above: Conv/ConvTranspose/MatMul/Gemm from their weights, pooling by window, reductions by input
    elements, data movement 0, anything else its output elements. {} when shapes cannot be inferred; a node whose
    output shape stays unknown is left out."""
    import math

    import onnx

    m = inferred_at(model, shapes)
    if m is None:  # no estimate rather than a made-up one
        return {}
    g = m.graph
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim]
            for v in (*g.input, *g.value_info, *g.output)}
    weights = {t.name: list(t.dims) for t in g.initializer}
    want = set(names) if names is not None else None
    out: dict[str, float] = {}
    for n in g.node:
        if want is not None and n.name not in want:
            continue
        if n.op_type in ONNX_NO_FLOPS:
            out[n.name] = 0.0
            continue
        o_dims = dims.get(n.output[0]) if n.output else None
        if not o_dims and o_dims != []:
            continue
        o, i = math.prod(o_dims), dims.get(n.input[0], []) if n.input else []
        w = weights.get(n.input[1]) or dims.get(n.input[1]) if len(n.input) > 1 else None
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "Conv" and w:
            out[n.name] = conv_flops(o, w[1], math.prod(w[2:]))
        elif n.op_type == "ConvTranspose" and w and i:
            out[n.name] = deconv_flops(math.prod(i), w[1], math.prod(w[2:]))
        elif n.op_type in ("MatMul", "Gemm") and i:
            out[n.name] = matmul_flops(o, i[0] if attrs.get("transA") else i[-1])
        elif n.op_type in ("MaxPool", "AveragePool", "LpPool") and "kernel_shape" in attrs:
            out[n.name] = pool_flops(o, math.prod(attrs["kernel_shape"]))
        elif n.op_type.startswith("Reduce") or n.op_type.startswith("Global"):
            out[n.name] = float(math.prod(i)) if i else float(o)
        else:
            out[n.name] = float(o)
    return out
