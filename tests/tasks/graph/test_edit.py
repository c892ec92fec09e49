"""Graph edits: computing an fp16 model in fp32 behind its fp16 interface."""
import numpy as np
import onnx
import onnxruntime as ort


def test_fp32_from_fp16_computes_in_fp32_behind_the_models_fp16_interface():
    """An fp16 model whose names already hold the border names ('x_fp32', 'y_to_fp16'): the fp32 version keeps its
    fp16 inputs and outputs, defines every name once, and computes what the model computes, in fp32."""
    from onnx import TensorProto, helper, numpy_helper

    from tasks.graph.edit import fp32_from_fp16

    H = TensorProto.FLOAT16
    w = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float16)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["x_fp32"], name="y_to_fp16"),
         helper.make_node("Relu", ["x_fp32"], ["y"], name="x_fp32_cast")],
        "g", [helper.make_tensor_value_info("x", H, [2, 4])], [helper.make_tensor_value_info("y", H, [2, 4])],
        [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    assert fp32_from_fp16(m) == 3  # the weight, the input border, the output border
    onnx.checker.check_model(m, full_check=True)
    outs = [o for n in m.graph.node for o in n.output]
    assert len(outs) == len(set(outs)) and len({n.name for n in m.graph.node}) == len(m.graph.node)
    assert m.graph.initializer[0].data_type == TensorProto.FLOAT
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float16)
    got = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, np.maximum(x.astype(np.float32) @ w.astype(np.float32), 0).astype(np.float16))
