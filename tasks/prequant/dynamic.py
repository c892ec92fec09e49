"""Dynamic quantization (ONNX Runtime's quantize_dynamic: DynamicQuantizeLinear -> MatMulInteger/ConvInteger, and
DynamicQuantizeLSTM) dequantized into the float layers it approximates, for model.dequantize_dynamic=true."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from tasks.graph.edit import links, replace_node, unique_name


def float_from_dynamic(g, inits) -> int:
    """MatMulInteger/ConvInteger(DynamicQuantizeLinear(x), W_q) -> Cast -> Mul(scale_x * scale_w) becomes a float
    MatMul/Conv of x with W = (W_q - zp) * scale_w (ONNX Runtime's quantize_dynamic pattern). Returns the count."""
    producers, consumers = links(g)
    count = 0
    for node in [n for n in g.node if n.op_type in ("MatMulInteger", "ConvInteger")]:
        dql = producers.get(node.input[0])
        w = inits.get(node.input[1])
        cast = (consumers.get(node.output[0]) or [None])[0]
        if dql is None or dql.op_type != "DynamicQuantizeLinear" or w is None or cast is None or cast.op_type != "Cast":
            continue
        mul = (consumers.get(cast.output[0]) or [None])[0]
        if mul is None or mul.op_type != "Mul":
            continue
        scales = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
        smul = producers.get(scales)
        if smul is None or smul.op_type != "Mul" or dql.output[1] not in smul.input:
            continue
        w_scale = next((i for i in smul.input if i != dql.output[1]), None)
        if w_scale not in inits:
            continue
        wq = numpy_helper.to_array(w).astype(np.float64)
        wzp = numpy_helper.to_array(inits[node.input[3]]).astype(np.float64) if len(node.input) > 3 and node.input[3] in inits else 0.0
        ws = numpy_helper.to_array(inits[w_scale]).astype(np.float64)
        if node.op_type == "ConvInteger" and np.ndim(ws) == 1:
            ws = ws.reshape(-1, *([1] * (wq.ndim - 1)))
            wzp = np.reshape(wzp, (-1, *([1] * (wq.ndim - 1)))) if np.ndim(wzp) == 1 else wzp
        name = unique_name(node.input[1] + "_float", inits)
        inits[name] = numpy_helper.from_array(((wq - wzp) * ws).astype(np.float32), name)
        g.initializer.append(inits[name])
        op = "MatMul" if node.op_type == "MatMulInteger" else "Conv"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        new = onnx.helper.make_node(op, [dql.input[0], name], [mul.output[0]], name=(node.name or op) + "_float", **attrs)
        g.node.insert(list(g.node).index(mul), new)
        g.node.remove(mul)
        count += 1
    return count + sum(_float_lstm(g, n, inits) for n in [n for n in g.node if n.op_type == "DynamicQuantizeLSTM"])


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
