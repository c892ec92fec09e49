"""Graph edits: an fp16 model computed in fp32 behind its fp16 interface; reads redirected into control-flow bodies."""
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


def _if_reading(value: str, shadow: bool = False):
    """An If whose branches read ``value`` from the outer scope (the else branch makes its own ``value`` when
    ``shadow``)."""
    from onnx import TensorProto, helper

    t = helper.make_tensor_value_info
    then = helper.make_graph([helper.make_node("Identity", [value], ["t"])], "then", [],
                             [t("t", TensorProto.FLOAT, [2])])
    body = [helper.make_node("Constant", [], [value], value=helper.make_tensor("c", TensorProto.FLOAT, [2], [1, 2]))] \
        if shadow else []
    other = helper.make_graph([*body, helper.make_node("Neg", [value], ["e"])], "else", [],
                              [t("e", TensorProto.FLOAT, [2])])
    return helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)


def test_redirected_reads_reach_what_control_flow_bodies_read_from_outside():
    """A rewrite that makes a value under another name redirects the If's bodies too (they read outer values without
    naming them as inputs), except a body that makes its own value of that name."""
    from tasks.graph.edit import redirect_reads

    plain, shadowed = _if_reading("v"), _if_reading("v", shadow=True)
    relu = onnx.helper.make_node("Relu", ["v"], ["r"])
    redirect_reads([plain, shadowed, relu], {"v": "w"})
    assert list(relu.input) == ["w"]
    reads = {b.name: [list(n.input) for n in b.g.node] for b in plain.attribute}
    assert reads == {"then_branch": [["w"]], "else_branch": [["w"]]}
    reads = {b.name: [list(n.input) for n in b.g.node] for b in shadowed.attribute}
    assert reads == {"then_branch": [["w"]], "else_branch": [[], ["v"]]}  # its own v: not the outer one


def test_an_fp16_input_a_body_reads_is_emulated_in_fp32_there_too():
    """fp16_rounded computes an fp16 graph in fp32 behind its fp16 inputs: an If body reading such an input from the
    outer scope reads the fp32 copy (its own ops now compute in fp32), so ONNX Runtime loads the graph and it computes
    the model's values."""
    from onnx import TensorProto, helper

    from tasks.onnxrt.emulate import fp16_rounded

    H, t = TensorProto.FLOAT16, helper.make_tensor_value_info
    then = helper.make_graph([helper.make_node("Sin", ["x"], ["a"])], "then", [], [t("a", H, [2])])
    other = helper.make_graph([helper.make_node("Cos", ["x"], ["b"])], "else", [], [t("b", H, [2])])
    g = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)], "g",
                          [t("x", H, [2]), t("cond", TensorProto.BOOL, [])], [t("y", H, [2])])
    m = fp16_rounded(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9))
    copy = next(n.output[0] for n in m.graph.node if n.op_type == "Cast" and list(n.input) == ["x"])
    branch = next(n for n in m.graph.node if n.op_type == "If").attribute
    # the bodies read the fp32 copy, as the graph's own nodes do
    assert [list(n.input) for a in branch for n in a.g.node if n.op_type in ("Sin", "Cos")] == [[copy], [copy]]
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([-1.5, 2.25], np.float16)
    for cond, want in ((True, np.sin(x.astype(np.float32)).astype(np.float16)),
                       (False, np.cos(x.astype(np.float32)).astype(np.float16))):
        got = s.run(None, {"x": x, "cond": np.array(cond)})[0]
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want)
