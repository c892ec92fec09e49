"""Dynamic quantization (ONNX Runtime's quantize_dynamic: DynamicQuantizeLinear -> MatMulInteger/ConvInteger, and
DynamicQuantizeLSTM) dequantized into the float layers it approximates, for model.dequantize_dynamic=true."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from tasks.graph.edit import links, replace_node, unique_name


def float_from_dynamic(g, inits, left: dict | None = None) -> int:
    """MatMulInteger/ConvInteger(DynamicQuantizeLinear(x), W_q) -> Cast -> Mul(scale_x * scale_w) becomes a float
    MatMul/Conv of x with W = (W_q - zp) * scale_w (ONNX Runtime's quantize_dynamic pattern), a ConvInteger of any rank
    (1-D Conv: [N, C, T] activations, [C_out, C_in/group, k] weights). A weight that is not a constant (a weight-normed
    Conv1d computes its weight in the graph) is quantized at run time by a DynamicQuantizeLinear of its own: the float
    layer reads that float weight. A bias quantized at run time to the output's int32 scale and added before the Cast
    (Add(ConvInteger, Reshape(Cast(Floor(Div(b, scale_x * scale_w)))))), as older ONNX Runtime quantizers wrote it,
    becomes the float layer's bias b (the product in the Div the output's scale, or a Mul of the same two scales).
    Returns the count; ``left`` gets {node name: why it stays native} for the rest."""
    producers, consumers = links(g)
    count = 0
    names = {n.name for n in g.node}
    for node in [n for n in g.node if n.op_type in ("MatMulInteger", "ConvInteger")]:
        found = _dynamic_pattern(g, node, producers, consumers, inits)
        if isinstance(found, str):
            if left is not None:
                left[node.name or node.output[0]] = found
            continue
        x, w_name, mul, bias = found
        op = "MatMul" if node.op_type == "MatMulInteger" else "Conv"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        name = (node.name or op) + "_float"
        if name in names:  # unnamed nodes: ONNX Runtime refuses a graph with two nodes of one name
            name = f"{name}_{mul.output[0]}"
        names.add(name)
        at = list(g.node).index(mul)
        if bias is not None and op == "Conv":  # [C_out]: the Conv's own bias
            g.node.insert(at, onnx.helper.make_node(op, [x, w_name, bias], [mul.output[0]], name=name, **attrs))
        elif bias is not None:  # MatMul: its bias added over the last axis
            g.node.insert(at, onnx.helper.make_node(op, [x, w_name], [mul.output[0] + "_nobias"], name=name, **attrs))
            g.node.insert(at + 1, onnx.helper.make_node("Add", [mul.output[0] + "_nobias", bias], [mul.output[0]],
                                                        name=name + "_bias"))
        else:
            g.node.insert(at, onnx.helper.make_node(op, [x, w_name], [mul.output[0]], name=name, **attrs))
        g.node.remove(mul)
        count += 1
    for node in [n for n in g.node if n.op_type == "DynamicQuantizeLSTM"]:
        done = _float_lstm(g, node, inits)
        count += done
        if not done and left is not None:
            left[node.name or node.output[0]] = "its weights, scales or zero points are not constants"
    return count


def _dynamic_pattern(g, node, producers, consumers, inits):
    """(float input, float weight, the output Mul it replaces, the float bias or None) for one
    MatMulInteger/ConvInteger of the quantize_dynamic pattern, the dequantized weight added to the initializers; else
    why it is not that pattern."""
    dql = producers.get(node.input[0])
    if dql is None or dql.op_type != "DynamicQuantizeLinear":
        return "its input is not quantized by a DynamicQuantizeLinear"
    if len(node.input) > 2 and node.input[2] and node.input[2] != dql.output[2]:
        return "its input zero point is not its DynamicQuantizeLinear's"
    after = consumers.get(node.output[0]) or []
    add = after[0] if len(after) == 1 and after[0].op_type == "Add" else None  # an int32 bias added before the Cast
    cast = (consumers.get(add.output[0]) or [None])[0] if add is not None else (after or [None])[0]
    mul = (consumers.get(cast.output[0]) or [None])[0] if cast is not None and cast.op_type == "Cast" else None
    if mul is None or mul.op_type != "Mul":
        return "its output is not Cast then scaled by a Mul"
    scales = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
    smul = producers.get(scales)
    if smul is None or smul.op_type != "Mul" or dql.output[1] not in smul.input:
        return "its output scale is not its input's scale times its weight's"
    bias = None
    if add is not None:
        bias = _int32_bias(add, node.output[0], scales, producers, inits)
        if bias is None:
            return "the Add after it is not a bias quantized to its output's scale"
        if node.op_type == "ConvInteger" and inits[bias].dims and list(inits[bias].dims) != \
                [_out_channels(node, inits, producers)]:
            return "its bias is not one value per output channel"
    w_scale = next((i for i in smul.input if i != dql.output[1]), None)
    wdql = producers.get(node.input[1])
    if node.input[1] not in inits and wdql is not None and wdql.op_type == "DynamicQuantizeLinear":
        # the weight quantized at run time: its scale and zero point are that DynamicQuantizeLinear's own
        if w_scale != wdql.output[1] or (len(node.input) > 3 and node.input[3] and node.input[3] != wdql.output[2]):
            return "its weight's scale or zero point is not its weight's DynamicQuantizeLinear's"
        return dql.input[0], wdql.input[0], mul, bias
    w = inits.get(node.input[1])
    if w is None:
        return "its weight is neither a constant nor quantized by a DynamicQuantizeLinear"
    if w_scale not in inits:
        return "its weight scale is not a constant"
    if len(node.input) > 3 and node.input[3] and node.input[3] not in inits:
        return "its weight zero point is not a constant"
    wq = numpy_helper.to_array(w).astype(np.float64)
    wzp = numpy_helper.to_array(inits[node.input[3]]).astype(np.float64) if len(node.input) > 3 and node.input[3] in inits else 0.0
    ws = numpy_helper.to_array(inits[w_scale]).astype(np.float64)
    if node.op_type == "ConvInteger" and np.ndim(ws) == 1:  # per output channel: [C_out] over [C_out, C_in/g, ...]
        ws = ws.reshape(-1, *([1] * (wq.ndim - 1)))
        wzp = np.reshape(wzp, (-1, *([1] * (wq.ndim - 1)))) if np.ndim(wzp) == 1 else wzp
    elif node.op_type == "ConvInteger" and np.ndim(wzp) == 1:  # per-channel zero point, per-tensor scale
        wzp = np.reshape(wzp, (-1, *([1] * (wq.ndim - 1))))
    name = unique_name(node.input[1] + "_float", inits)
    inits[name] = numpy_helper.from_array(((wq - wzp) * ws).astype(np.float32), name)
    g.initializer.append(inits[name])
    return dql.input[0], name, mul, bias


def _int32_bias(add, product: str, scales: str, producers, inits) -> str | None:
    """The float bias b of Add(product, [Reshape](Cast(Floor|Round(Div(b, scales))))): a constant bias rounded to the
    integer product's scale at run time; None for any other Add."""
    other = add.input[1] if add.input[0] == product else add.input[0]
    n = producers.get(other)
    if n is not None and n.op_type == "Reshape":
        n = producers.get(n.input[0])
    if n is None or n.op_type != "Cast":
        return None
    n = producers.get(n.input[0])
    if n is not None and n.op_type in ("Floor", "Round"):
        n = producers.get(n.input[0])
    if n is None or n.op_type != "Div" or not _one_product(n.input[1], scales, producers) or n.input[0] not in inits:
        return None
    return n.input[0]


def _one_product(a: str, b: str, producers) -> bool:
    """Whether values ``a`` and ``b`` are one product: the same value, or two Muls of the same two values (ddddocr's
    quantizer computed the bias's scale_x * scale_w with a Mul of its own)."""
    pa, pb = producers.get(a), producers.get(b)
    return a == b or (pa is not None and pb is not None and pa.op_type == pb.op_type == "Mul"
                      and sorted(pa.input) == sorted(pb.input))


def _out_channels(node, inits, producers) -> int | None:
    """A ConvInteger's output channels: its weight's first dimension (a constant, or a DynamicQuantizeLinear's input
    constant)."""
    w = inits.get(node.input[1])
    if w is None and producers.get(node.input[1]) is not None:
        w = inits.get(producers[node.input[1]].input[0])
    return int(w.dims[0]) if w is not None and w.dims else None


def _float_lstm(g, node, inits) -> int:
    """com.microsoft DynamicQuantizeLSTM (ONNX Runtime's quantize_dynamic of an LSTM: int8 W [D, I, 4H] and R [D, H, 4H],
    transposed, with per-direction [D] or per-channel [D, 4H] scales and zero points) becomes the float ONNX LSTM it
    came from. Returns 1, or 0 when its weights are not constants."""
    names = list(node.input) + [""] * (12 - len(node.input))
    weights = []
    for w, s, z in ((names[1], names[8], names[9]), (names[2], names[10], names[11])):
        if w not in inits or s not in inits or (z and z not in inits):
            return 0
        wq = numpy_helper.to_array(inits[w]).astype(np.float64)
        scale = numpy_helper.to_array(inits[s]).astype(np.float64)
        zp = numpy_helper.to_array(inits[z]).astype(np.float64) if z else np.zeros_like(scale)
        per = (-1, 1, wq.shape[2]) if scale.ndim == 2 else (-1, 1, 1)  # [D, 4H] per channel, else [D]
        f = ((wq - zp.reshape(per)) * scale.reshape(per)).transpose(0, 2, 1)  # ONNX LSTM: [D, 4H, I]
        name = unique_name(w + "_float", inits)
        inits[name] = numpy_helper.from_array(f.astype(np.float32), name)
        g.initializer.append(inits[name])
        weights.append(name)
    ins = [names[0], *weights, *names[3:8]]
    while ins and not ins[-1]:
        ins.pop()
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    replace_node(g, node, [onnx.helper.make_node("LSTM", ins, list(node.output), name=(node.name or "LSTM") + "_float",
                                                 **attrs)])
    return 1
