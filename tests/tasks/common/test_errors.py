"""Errors lead with their cause and the fix; paths come after; library noise is not part of a cause; nothing is cut."""
from tasks.common.errors import StageError, cause


def test_the_cause_and_the_fix_come_before_the_path():
    e = StageError("ONNX Runtime cannot load the model: " + "x" * 900, stage="validate",
                   file="/very/long/cache/path/" + "k" * 64 + "/model.onnx", fix="re-export at opset 17")
    lines = e.render().splitlines()
    assert lines[0].startswith("[validate] ONNX Runtime cannot load the model: ") and lines[0].endswith("x" * 900)
    assert lines[1] == "  fix: re-export at opset 17" and lines[2].startswith("  in: /very/long/cache/path/")


def test_cuda_without_a_gpu_is_no_part_of_a_cause():
    msg = ("[checkMacros.cpp::catchCudaError::212] Error Code 1: Cuda Runtime (cudaError 35: CUDA driver version is "
           "insufficient for CUDA runtime version)\n"
           "ModelImporter.cpp:949: While parsing node number 3 [Conv -> \"y\"]: Output shape can not be computed\n"
           "[checkMacros.cpp::catchCudaError::212] Error Code 1: Cuda Runtime (cudaError 35: CUDA driver version)")
    assert cause(msg) == "ModelImporter.cpp:949: While parsing node number 3 [Conv -> \"y\"]: Output shape can not be computed"


def test_onnx_runtime_prefix_is_dropped_and_long_causes_are_kept_whole():
    long = "initializer w has element type float16 but usage expects float " * 10
    assert cause(RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model from m.onnx failed: " + long)) == long.strip()


def test_onnx_runtimes_refusal_leads_with_its_reason_and_names_the_file_once(tmp_path):
    """The validate error of an fp16 graph ONNX Runtime refused began with the graph's cache path twice (ONNX Runtime
    repeats it: "Load model from <path> failed:") and the reason came last. Real ONNX Runtime, the refusal of item 3:
    an initializer in fp16 that the graph, listing it as an input too, declares float."""
    import numpy as np
    import onnx
    import pytest
    from onnx import TensorProto, helper, numpy_helper

    from tasks.onnxrt.ort import ort_session

    g = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                          initializer=[numpy_helper.from_array(np.ones(2, np.float16), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path / ("k" * 64) / "model.sm_86.fp16.onnx"
    path.parent.mkdir()
    onnx.save(m, str(path))
    with pytest.raises(StageError) as e:
        ort_session(path)
    text = e.value.render()
    first = text.splitlines()[0]
    assert first.startswith("[validate] ONNX Runtime cannot load the model: Type Error: Data in initializer 'b' has "
                            "element type tensor(float16)"), first
    assert text.count(str(path)) == 1 and text.splitlines()[-1] == f"  in: {path}", text


def test_onnx_runtimes_cpp_location_and_signature_are_no_part_of_the_cause():
    msg = ("[ONNXRuntimeError] : 1 : FAIL : /onnxruntime_src/onnxruntime/core/graph/model_load_utils.h:46 void "
           "onnxruntime::model_load_utils::ValidateOpsetForDomain(const std::unordered_map<std::__cxx11::basic_string"
           "<char>, int>&, const onnxruntime::logging::Logger&, bool, const std::string&, int) ONNX Runtime only "
           "*guarantees* support for models stamped with official released onnx opset versions.")
    assert cause(msg).startswith("ONNX Runtime only *guarantees* support"), cause(msg)


def test_a_failed_parse_says_the_parsers_words_without_cuda_lines(tmp_path):
    """On a host without a GPU, TensorRT-RTX's parser error for a node carried "[checkMacros.cpp::catchCudaError] ...
    cudaError 35: CUDA driver version is insufficient" after its real message. Real TensorRT-RTX: a Conv whose weights
    are a runtime input of unknown output channels, which the parser refuses."""
    import onnx
    import pytest
    from onnx import TensorProto, helper

    from tasks.trt.backend import Backend, host_gpus

    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv_dyn_w")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, ["k", 3, 3, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path / "dyn_w.onnx"
    onnx.save(m, str(path))
    b = Backend("tensorrt_rtx")
    builder, network, parser = b.parser(b.trt.Logger(b.trt.Logger.ERROR))  # noqa: F841 - alive while parsing
    assert not parser.parse(m.SerializeToString(), str(path))
    raw = "\n".join(parser.get_error(i).desc() for i in range(parser.num_errors))
    if not host_gpus():
        assert "cudaError" in raw  # what the parser says on this host: the test is about dropping it
    prof = [{"x": {"min": [1, 3, 8, 8], "opt": [1, 3, 8, 8], "max": [2, 3, 8, 8]},
             "w": {"min": [1, 3, 3, 3], "opt": [4, 3, 3, 3], "max": [4, 3, 3, 3]}}]
    with pytest.raises(StageError) as e:
        b.build_engine(str(path), prof, "8.6")
    text = e.value.render()
    assert "the TensorRT ONNX parser rejected the model: node conv_dyn_w (Conv)" in text.splitlines()[0], text
    assert "output channels" in text.splitlines()[0]  # the parser's own words stay
    assert "cuda" not in text.lower(), text
    reasons = [r["reason"] for r in b.parse_errors(m.SerializeToString(), str(path))]
    assert reasons and all("cuda" not in r.lower() for r in reasons), reasons
