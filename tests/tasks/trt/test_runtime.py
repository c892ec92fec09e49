"""The engine runner: host-side decisions tested on CPU over plain tensor descriptions, the three shapes of model
built as real TensorRT-RTX engines here, and run end to end only on a GPU of a supported compute capability."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tasks.trt.backend import gpu_for, host_gpus, no_gpu_reason
from tasks.common.errors import StageError
from tasks.onnxrt.ort import ort_run, ort_session
from tasks.trt.cuda import cuda_versions
from tasks.trt.runtime import runtime_cache_file
from tasks.trt.tensors import TensorSpec, binding_unchanged, check_feed, choose_profile, graph_binding, output_plan

RTX_CC = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")

# two profiles on x: small batches/images, then large ones (what validate feeds: samples from every profile)
X = TensorSpec("x", True, "FLOAT", (-1, 3, -1, -1), profiles=(
    ((1, 3, 8, 8), (2, 3, 16, 16), (2, 3, 16, 16)),
    ((3, 3, 17, 17), (4, 3, 24, 24), (4, 3, 32, 32))))
Y = TensorSpec("y", False, "FLOAT", (-1, 4, -1, -1))
# a shape tensor: values live in host memory and are part of each profile
SHAPE = TensorSpec("shape", True, "INT64", (2,), host=True, profiles=(((2,), (2,), (2,)),) * 2,
                   values=(((1, 24), (2, 24), (4, 24)), ((2, 12), (4, 12), (16, 12))))
DATA = TensorSpec("data", True, "FLOAT", (-1, 24), profiles=(((1, 24), (2, 24), (4, 24)), ((1, 24), (2, 24), (8, 24))))
NZ = TensorSpec("nz", False, "INT64", (2, -1))


@pytest.fixture(scope="module")
def rtx():
    from tasks.trt.backend import Backend

    return Backend("tensorrt_rtx")


def feed(**arrays):
    return {k: np.asarray(v) for k, v in arrays.items()}


def test_the_profile_that_contains_the_feed_is_chosen():
    assert choose_profile([X, Y], feed(x=np.zeros((2, 3, 8, 16), np.float32))) == 0
    assert choose_profile([X, Y], feed(x=np.zeros((4, 3, 32, 20), np.float32))) == 1
    with pytest.raises(StageError) as e:
        choose_profile([X, Y], feed(x=np.zeros((3, 3, 8, 8), np.float32)))  # batch of profile 1, size of profile 0
    msg = e.value.render()
    assert "fit none of the engine's 2 optimization profiles" in msg and "profile 1: x [3, 3, 17, 17]..[4, 3, 32, 32]" in msg
    assert "fix:" in msg


def test_a_shape_tensor_is_matched_on_its_values():
    f = feed(data=np.zeros((3, 24), np.float32), shape=np.array([6, 12], np.int64))
    assert choose_profile([DATA, SHAPE], f) == 1  # values (6, 12) are only inside profile 1
    f["shape"] = np.array([3, 24], np.int64)
    assert choose_profile([DATA, SHAPE], f) == 0
    f["shape"] = np.array([9, 8], np.int64)
    with pytest.raises(StageError, match="fit none"):
        choose_profile([DATA, SHAPE], f)


def test_the_feed_is_checked_against_the_engine_tensors():
    ok = check_feed([X, Y], {"x": np.zeros((2, 3, 8, 8), np.float32)[:, :, ::1]})
    assert ok["x"].flags["C_CONTIGUOUS"]
    with pytest.raises(StageError, match=r"input 'x' is float64, the engine's tensor is FLOAT \(float32\)") as e:
        check_feed([X, Y], {"x": np.zeros((2, 3, 8, 8))})
    assert "fix: feed float32" in e.value.render()
    with pytest.raises(StageError, match=r"has shape \[2, 4, 8, 8\], the engine's tensor is \[-1, 3, -1, -1\]"):
        check_feed([X, Y], {"x": np.zeros((2, 4, 8, 8), np.float32)})
    with pytest.raises(StageError, match="has shape"):
        check_feed([X, Y], {"x": np.zeros((2, 3, 8), np.float32)})
    with pytest.raises(StageError, match=r"lacks the engine's inputs \['shape'\]"):
        check_feed([DATA, SHAPE], {"data": np.zeros((1, 24), np.float32)})
    assert list(check_feed([X], {"x": np.zeros((1, 3, 8, 8), np.float32), "unused": np.zeros(1)})) == ["x"]
    fp8 = TensorSpec("q", True, "FP8", (4,), profiles=(((4,), (4,), (4,)),))
    with pytest.raises(StageError, match="type FP8, which numpy cannot hold"):
        check_feed([fp8], {"q": np.zeros(4, np.uint8)})


def test_outputs_with_data_dependent_shapes_get_the_output_allocator():
    plan = output_plan([X, Y, NZ], {"y": (2, 4, 8, 8), "nz": (2, -1)})
    assert plan == {"y": 2 * 4 * 8 * 8 * 4, "nz": None}
    assert output_plan([NZ], {"nz": (2, 0)}) == {"nz": 0}


def test_runtime_cache_is_kept_per_target_and_backend(tmp_path):
    a = runtime_cache_file(tmp_path, "sm_86", "tensorrt_rtx-1.7.1.116")
    b = runtime_cache_file(tmp_path, "sm_89", "tensorrt_rtx-1.7.1.116")
    assert a.parent != b.parent and a.is_relative_to(tmp_path) and a.name == "tensorrt_rtx-1.7.1.116.bin"


def test_cuda_versions_are_read_from_the_libraries():
    v = cuda_versions()
    assert re.fullmatch(r"\d+\.\d+", v["cuda_runtime"])
    if not host_gpus():
        assert v["cuda_driver"] == "not present"


@pytest.mark.skipif(bool(host_gpus()), reason="checks how a host without a GPU refuses to run an engine")
def test_without_a_gpu_the_runner_refuses_with_the_cuda_error(rtx):
    from tasks.trt.runtime import EngineRunner

    with pytest.raises(StageError, match="CUDA cuda(SetDevice|Free) failed: cudaError"):
        EngineRunner(b"not an engine", rtx)


def test_a_captured_cuda_graph_is_replayed_only_for_the_binding_it_was_captured_with():
    """A CUDA graph replays fixed shapes and addresses: a new shape, a reallocated buffer, another profile or a moved
    host shape tensor means capture again, never a stale replay."""
    base = graph_binding(0, {"x": (1, 3, 8, 8)}, {"x": 0x1000, "y": 0x2000}, {})
    assert binding_unchanged(base, graph_binding(0, {"x": (1, 3, 8, 8)}, {"y": 0x2000, "x": 0x1000}, {}))
    assert not binding_unchanged(None, base)  # nothing captured
    for other in (graph_binding(0, {"x": (2, 3, 8, 8)}, {"x": 0x1000, "y": 0x2000}, {}),   # shape
                  graph_binding(0, {"x": (1, 3, 8, 8)}, {"x": 0x3000, "y": 0x2000}, {}),   # buffer grown elsewhere
                  graph_binding(1, {"x": (1, 3, 8, 8)}, {"x": 0x1000, "y": 0x2000}, {}),   # profile
                  graph_binding(0, {"x": (1, 3, 8, 8)}, {"x": 0x1000, "y": 0x2000}, {"shape": 0x10})):
        assert not binding_unchanged(base, other)


def test_the_gpu_a_target_runs_on_is_found_by_its_pci_bus_id():
    """nvidia-smi numbers GPUs by bus, CUDA fastest first: the runner selects the chosen GPU by PCI bus id."""
    from tasks.trt.backend import gpus_from_nvidia_smi

    gpus = gpus_from_nvidia_smi("NVIDIA H100 80GB HBM3, 9.0, 580.95.05, 00000000:1B:00.0\n"
                                "NVIDIA GeForce RTX 4090, D, 8.9, 580.95.05, 00000000:3D:00.0\n")
    assert [(g.name, g.compute_capability, g.pci_bus_id) for g in gpus] == [
        ("NVIDIA H100 80GB HBM3", "9.0", "00000000:1B:00.0"), ("NVIDIA GeForce RTX 4090, D", "8.9", "00000000:3D:00.0")]
    assert gpus_from_nvidia_smi("") == ()


# --- the three shapes of model, real engines --------------------------------------------------------------------

def _save(path: Path, nodes, inputs, outputs, inits=()) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(helper.make_graph(nodes, path.stem, inputs, outputs, initializer=list(inits)),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def shape_tensor_model(path: Path) -> Path:
    """y = Reshape(data, shape) + 1: `shape` (int64[2]) is a shape tensor, read by TensorRT from host memory."""
    from onnx import TensorProto, helper, numpy_helper

    one = numpy_helper.from_array(np.ones(1, np.float32), "one")
    return _save(path, [helper.make_node("Reshape", ["data", "shape"], ["r"]), helper.make_node("Add", ["r", "one"], ["y"])],
                 [helper.make_tensor_value_info("data", TensorProto.FLOAT, ["n", 24]),
                  helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])], [one])


def nonzero_model(path: Path) -> Path:
    """nz = NonZero(x > 0): its second dimension depends on the data."""
    from onnx import TensorProto, helper, numpy_helper

    zero = numpy_helper.from_array(np.zeros(1, np.float32), "zero")
    return _save(path, [helper.make_node("Greater", ["x", "zero"], ["g"]), helper.make_node("NonZero", ["g"], ["nz"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                 [helper.make_tensor_value_info("nz", TensorProto.INT64, [2, "k"])], [zero])


MULTI_PROFILES = [{"x": {"min": list(r[0]), "opt": list(r[1]), "max": list(r[2])}} for r in X.profiles]
SHAPE_PROFILES = [{"data": {"min": list(r[0]), "opt": list(r[1]), "max": list(r[2])},
                   "shape": {"min": [2], "opt": [2], "max": [2], "values": dict(zip(("min", "opt", "max"), map(list, v)))}}
                  for r, v in zip(DATA.profiles, SHAPE.values)]  # each of min/opt/max reshapes n*24 values
NZ_PROFILES = [{"x": {"min": [1, 16], "opt": [2, 16], "max": [4, 16]}}]


def parse(backend, onnx_path: Path):
    logger = backend.logger()  # the backend's one logger, as the stages use it
    builder, network, parser = backend.parser(logger)
    assert parser.parse_from_file(str(onnx_path)), [parser.get_error(i).desc() for i in range(parser.num_errors)]
    io = [network.get_input(i) for i in range(network.num_inputs)] + [network.get_output(i) for i in range(network.num_outputs)]
    return logger, builder, network, parser, {t.name: (t.is_shape_tensor, tuple(t.shape)) for t in io}


def build(backend, onnx_path: Path, profiles: list[dict], cc: str) -> bytes | str:
    """A real engine with every profile (shape tensors get value ranges too), or the builder's error."""
    logger, builder, network, _parser, _ = parse(backend, onnx_path)
    config = builder.create_builder_config()
    cc_enum = backend.compute_capability_enum(cc)
    if cc_enum is not None:
        config.num_compute_capabilities = 1
        config.set_compute_capability(cc_enum, 0)
    for prof in profiles:
        p = builder.create_optimization_profile()
        for name, r in prof.items():
            p.set_shape(name, r["min"], r["opt"], r["max"])
            if "values" in r:
                p.set_shape_input(name, r["values"]["min"], r["values"]["opt"], r["values"]["max"])
        config.add_optimization_profile(p)
    blob = builder.build_serialized_network(network, config)
    return bytes(blob) if blob is not None and blob.nbytes else " | ".join(logger.errors()) or "no engine"


@pytest.fixture(scope="module")
def three_models(tmp_path_factory, tiny_onnx):
    d = tmp_path_factory.mktemp("runtime")
    return {"multi": (tiny_onnx, MULTI_PROFILES), "shape": (shape_tensor_model(d / "shape.onnx"), SHAPE_PROFILES),
            "nonzero": (nonzero_model(d / "nonzero.onnx"), NZ_PROFILES)}


def test_the_three_shapes_of_model_have_the_io_the_runner_plans_for(rtx, three_models):
    """What the GPU tests below rely on, checked where no GPU is needed: the multi-profile and shape-tensor engines
    build for sm_86 with every profile, `shape` is a shape tensor (host memory), NonZero's output has a
    data-dependent dimension. TensorRT-RTX 1.7 has no NonZero/NMS kernels ("has no runners that implement it"),
    so that engine needs Enterprise TensorRT (the GPU test uses whichever backend builds it; TensorRT-RTX's parser
    already refuses the node here)."""
    for name in ("multi", "shape"):
        path, profiles = three_models[name]
        engine = build(rtx, path, profiles, "8.6")
        assert isinstance(engine, bytes) and len(engine) > 1000, engine
    assert parse(rtx, three_models["shape"][0])[-1]["shape"] == (True, (2,))
    assert parse(rtx, three_models["shape"][0])[-1]["data"][0] is False
    sess = ort_session(three_models["nonzero"][0])  # the reference: k varies with the data, not with the shapes
    x = np.array([[1.0] * 16, [-1.0] * 8 + [1.0] * 8], np.float32)
    assert ort_run(sess, {"x": x})["nz"].shape == (2, 24) and ort_run(sess, {"x": -x})["nz"].shape == (2, 8)


def _supported_gpu():
    return next((cc for cc in RTX_CC if gpu_for(cc)), None)


def _runner(backend, three_models, name, tmp_path, **kw):
    from tasks.trt.runtime import EngineRunner

    path, profiles = three_models[name]
    engine = build(backend, path, profiles, _supported_gpu())
    if isinstance(engine, str):
        pytest.skip(f"{backend.version} cannot build the {name} model here: {engine[:200]}")
    return EngineRunner(engine, backend, runtime_cache=tmp_path / "rc" / "cache.bin", **kw), path


@pytest.mark.gpu
@pytest.mark.skipif(_supported_gpu() is None, reason=no_gpu_reason("7.5/8.0/8.6/8.9/12.x (a TensorRT-RTX target)"))
def test_gpu_multi_profile_engine_runs_feeds_of_every_profile(rtx, three_models, tmp_path):
    """Each feed selects the profile that contains it (set_optimization_profile_async), outputs match ONNX Runtime,
    the runtime cache is written on close, and CUDA-event timing separates compute from copies."""
    runner, path = _runner(rtx, three_models, "multi", tmp_path)
    sess = ort_session(path)
    rng = np.random.default_rng(0)
    with runner:
        for shape, profile in (((2, 3, 16, 16), 0), ((4, 3, 24, 24), 1), ((1, 3, 8, 8), 0)):
            f = {"x": rng.standard_normal(shape).astype(np.float32)}
            got, want = runner.infer(f)["y"], ort_run(sess, f)["y"]
            assert runner.profile == profile and got.shape == want.shape
            assert np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want) > 0.9999
        t = runner.measure({"x": rng.standard_normal((4, 3, 32, 32)).astype(np.float32)}, 2, 5, 2)
        assert t["runs"] == 10 and 0 < t["p50_ms"] and t["h2d_ms"] > 0 and t["d2h_ms"] > 0 and t["profile"] == 1
        assert t["cuda_graph"] == "off" and t["throughput_per_s"] < 4e3 / t["mean_ms"]  # copies count in throughput
        with pytest.raises(StageError, match="float64"):
            runner.infer({"x": np.zeros((1, 3, 8, 8))})
    assert (tmp_path / "rc" / "cache.bin").stat().st_size > 0  # compiled kernels kept for the next run


@pytest.mark.gpu
@pytest.mark.skipif(_supported_gpu() is None, reason=no_gpu_reason("7.5/8.0/8.6/8.9/12.x (a TensorRT-RTX target)"))
def test_gpu_shape_tensor_input_is_read_from_host_memory(rtx, three_models, tmp_path):
    runner, _ = _runner(rtx, three_models, "shape", tmp_path)
    data = np.arange(6 * 24, dtype=np.float32).reshape(6, 24)
    with runner:
        assert [s.name for s in runner.specs if s.host] == ["shape"]
        y = runner.infer({"data": data, "shape": np.array([12, 12], np.int64)})["y"]
        assert runner.profile == 1 and np.array_equal(y, data.reshape(12, 12) + 1)
        y = runner.infer({"data": data[:2], "shape": np.array([2, 24], np.int64)})["y"]
        assert runner.profile == 0 and np.array_equal(y, data[:2] + 1)


@pytest.mark.gpu
@pytest.mark.skipif(_supported_gpu() is None, reason=no_gpu_reason("7.5/8.0/8.6/8.9/12.x (a TensorRT-RTX target)"))
def test_gpu_data_dependent_output_comes_through_the_output_allocator(rtx, three_models, tmp_path):
    from tasks.trt.backend import Backend
    from tasks.common.errors import UnavailableError

    try:  # Enterprise TensorRT has NonZero kernels; TensorRT-RTX 1.7 has none
        backend = Backend("tensorrt")
    except UnavailableError:
        backend = rtx
    runner, _ = _runner(backend, three_models, "nonzero", tmp_path)
    rng = np.random.default_rng(1)
    with runner:
        for n in (1, 3):
            x = rng.standard_normal((n, 16)).astype(np.float32)
            nz = runner.infer({"x": x})["nz"]
            assert np.array_equal(nz, np.stack(np.nonzero(x > 0)).astype(np.int64))  # k differs per feed
        assert runner.measure({"x": x}, 1, 3)["runs"] == 3
