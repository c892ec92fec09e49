"""Real TensorRT-RTX builds (CPU-only AOT) and, where a supported GPU exists, real engine execution."""
import numpy as np
import pytest

from tasks.trt.backend import Backend, backend_for_target, gpu_for, host_gpus, no_gpu_reason
from tasks.engines.build import engine_from_onnx
from tasks.common.errors import StageError, UnavailableError
from tests.conftest import TINY_PROFILE

BUILD = {"optimization_level": 3, "workspace_mib": None}
RTX_CC = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")


@pytest.fixture(scope="module")
def rtx():
    return Backend("tensorrt_rtx")


@pytest.fixture(scope="module")
def tiny_engine(tiny_onnx, tmp_path_factory, rtx):
    return engine_from_onnx(tiny_onnx, tmp_path_factory.mktemp("eng") / "tiny.engine", [TINY_PROFILE], "8.6", BUILD, rtx,
                            show_progress=False)


def test_builds_a_real_engine_for_sm86_on_this_host(tiny_engine, rtx):
    data = tiny_engine.files["engine"].read_bytes()
    assert len(data) == tiny_engine.metrics["engine_bytes"] > 1000
    assert tiny_engine.details["backend"].startswith("tensorrt_rtx-1.7")
    assert not any("cudaError" in line for line in tiny_engine.details["native_log"])
    if not gpu_for("8.6"):
        assert rtx.engine_validity(data) == "INVALID"  # what TensorRT-RTX answers without a GPU


@pytest.mark.skipif(bool(host_gpus()), reason="the driver lines are dropped on a host without a GPU only")
def test_the_backend_logger_drops_the_gpu_less_driver_lines_that_tensorrts_own_logger_prints(tiny_engine, rtx, capfd):
    """Loading an engine makes TensorRT-RTX log 'cudaError 35: CUDA driver version is insufficient' on this host:
    its own Logger prints that; the backend's logger (every builder, parser and runtime here) prints nothing
    and keeps no such line, while keeping the real error once."""
    data = tiny_engine.files["engine"].read_bytes()
    trt = rtx.trt
    assert trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(data) is None
    own = capfd.readouterr()
    assert "cudaError 35" in own.out + own.err  # what the noise is, printed by TensorRT's own logger
    logger = rtx.logger()
    assert rtx.runtime(logger).deserialize_cuda_engine(data) is None
    assert rtx.runtime(logger).deserialize_cuda_engine(data) is None  # the same messages again: kept once
    seen = capfd.readouterr()
    assert seen.out + seen.err == ""
    assert logger.dropped >= 2 and not any("cudaError" in m for _, m in logger.messages)
    assert len(logger.messages) == len(set(logger.messages))


@pytest.mark.parametrize("cc", ["7.5", "8.9", "12.0"])
def test_other_rtx_targets_build(tiny_onnx, tmp_path, rtx, cc):
    r = engine_from_onnx(tiny_onnx, tmp_path / "e.engine", [TINY_PROFILE], cc, BUILD, rtx, show_progress=False)
    assert r.metrics["engine_bytes"] > 1000


def test_non_rtx_compute_capability_is_refused_plainly():
    with pytest.raises(UnavailableError) as e:
        backend_for_target("sm_90", "tensorrt_rtx", "9.0")
    assert "SM86" in str(e.value)


def test_builder_failure_is_wrapped_with_stage_and_file(tiny_onnx, tmp_path, rtx):
    bad = {"x": {"min": [1, 3, 8, 8], "opt": [2, 3, 16, 16], "max": [4, 5, 32, 32]}}  # channel dim 5 contradicts weights
    with pytest.raises(StageError) as e:
        engine_from_onnx(tiny_onnx, tmp_path / "e.engine", [bad], "8.6", BUILD, rtx, show_progress=False)
    assert "[build]" in str(e.value) and "tiny.onnx" in str(e.value)
    assert "cudaError" not in str(e.value) and "/_src/" not in str(e.value)


def test_builder_failure_names_the_node_its_op_and_the_keys_that_route_around_it(tmp_path, rtx):
    # Two inputs whose batch dims the profile sets to 3 and 2: the parser takes the Add, the builder refuses it.
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper as oh

    nodes = [oh.make_node("Relu", ["x"], ["r"], name="relu_in"), oh.make_node("Add", ["r", "z"], ["a"], name="bad_add"),
             oh.make_node("Relu", ["a"], ["y"], name="relu_out")]
    graph = oh.make_graph(nodes, "bad", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 6]),
                                          oh.make_tensor_value_info("z", TP.FLOAT, ["M", 6])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, None)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "bad.onnx"))
    profile = {"x": {"min": [3, 6], "opt": [3, 6], "max": [3, 6]}, "z": {"min": [2, 6], "opt": [2, 6], "max": [2, 6]}}
    with pytest.raises(StageError) as e:
        engine_from_onnx(tmp_path / "bad.onnx", tmp_path / "e.engine", [profile], "8.6", BUILD, rtx, show_progress=False)
    assert "node 'bad_add' (Add)" in e.value.message
    assert "partition.exclude_ops=[Add]" in e.value.fix and "partition.min_subgraph_size" in e.value.fix
    assert "cudaError" not in str(e.value) and "/_src/" not in str(e.value)


def test_cls_with_a_non_square_profile_builds_after_sanitize(cls_path, tmp_path, rtx):
    """PP-OCR cls names H and W both '?': without distinct names TensorRT refuses this profile."""
    from tasks.sources.export import onnx_from_model

    onnx_r = onnx_from_model({"format": "onnx", "source": str(cls_path)}, [], tmp_path / "cls.onnx")
    prof = {"x": {"min": [1, 3, 48, 96], "opt": [4, 3, 48, 192], "max": [8, 3, 48, 384]}}
    r = engine_from_onnx(onnx_r.files["onnx"], tmp_path / "cls.engine", [prof], "8.6", BUILD, rtx, show_progress=False)
    assert r.metrics["engine_bytes"] > 100_000


def _supported_gpu():
    return next((cc for cc in RTX_CC if gpu_for(cc)), None)


@pytest.mark.gpu
@pytest.mark.skipif(_supported_gpu() is None, reason=no_gpu_reason("7.5/8.0/8.6/8.9/12.x (a TensorRT-RTX target)"))
def test_engine_runs_on_the_gpu_and_matches_onnxruntime(tiny_onnx, tmp_path, rtx):
    from tasks.onnxrt.ort import ort_run, ort_session
    from tasks.trt.runtime import EngineRunner

    cc = _supported_gpu()
    r = engine_from_onnx(tiny_onnx, tmp_path / "e.engine", [TINY_PROFILE], cc, BUILD, rtx, show_progress=False)
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    with EngineRunner(r.files["engine"].read_bytes(), rtx) as runner:
        got = runner.infer(feed)["y"]
        want = ort_run(ort_session(tiny_onnx), feed)["y"]
        cos = float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want))
        assert cos > 0.9999
        assert runner.measure(feed, 2, 5)["p50_ms"] > 0


def test_a_model_that_works_in_fp16_is_computed_in_fp32_at_fp32(tmp_path):
    """An fp16 model at precision=fp32 is upcast (weights, casts), so the engine named fp32 computes fp32; an fp32 model
    passes through unchanged."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from tasks.engines.build import onnx_at_precision

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float16), "w")
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16),
                           helper.make_node("Conv", ["xh", "w"], ["yh"], pads=[1, 1, 1, 1]),
                           helper.make_node("Cast", ["yh"], ["y"], to=TensorProto.FLOAT)], "half",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "half.onnx")
    r = onnx_at_precision(tmp_path / "half.onnx", "fp32", tmp_path / "out.onnx")
    out = onnx.load(str(r.files["onnx"]))
    assert r.details["fp32_from_fp16"] == 2  # the weight and the Cast to fp16
    assert out.graph.initializer[0].data_type == TensorProto.FLOAT
    assert all(a.i == TensorProto.FLOAT for n in out.graph.node if n.op_type == "Cast" for a in n.attribute)
    x = {"x": np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    from tasks.onnxrt.ort import ort_run, ort_session
    a, b = (ort_run(ort_session(p), x)["y"] for p in (tmp_path / "half.onnx", r.files["onnx"]))
    assert np.abs(a - b).max() < 0.05  # the same function, in fp32 types
