"""Errors lead with their cause and the fix; paths come after; library noise is not part of a cause; nothing is cut."""
from tasks.errors import StageError, cause


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
    long = "Load model from m.onnx failed: " + "initializer w has element type float16 but usage expects float " * 10
    assert cause(RuntimeError("[ONNXRuntimeError] : 1 : FAIL : " + long)) == long.strip()
