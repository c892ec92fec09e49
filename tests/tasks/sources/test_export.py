import onnx
import pytest

from tasks.common.errors import ConfigError
from tasks.sources.export import onnx_from_model, sanitize
from tasks.graph.models import graph_io


def test_cls_shared_dim_names_become_distinct(cls_path):
    model, notes = sanitize(onnx.load(str(cls_path)))
    dims = [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims[2] and dims[3] and dims[2] != dims[3]
    assert any("renamed" in n for n in notes)


def test_constant_nodes_are_folded(det_path, tmp_path):
    r = onnx_from_model({"format": "onnx", "source": str(det_path)}, [], tmp_path / "m.onnx")
    m = onnx.load(str(r.files["onnx"]))
    assert not any(n.op_type == "Constant" for n in m.graph.node)
    assert len(m.graph.initializer) > 100
    onnx.checker.check_model(m)


def torch_available():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not torch_available(), reason="PyTorch is not installed (pip install 'trtforge[torch]')")
def test_torch_factory_exports_with_dynamic_axes_from_the_profile(tmp_path):
    cfg = {"format": "torch", "factory": "tests.tasks.torch_models:small_cnn", "opset": 17,
           "inputs": {"image": {"shape": [1, 3, 32, 32], "dtype": "float32"}}}
    profiles = [{"image": {"min": [1, 3, 32, 32], "opt": [2, 3, 64, 64], "max": [4, 3, 128, 128]}}]
    r = onnx_from_model(cfg, profiles, tmp_path / "m.onnx")
    ins, outs = graph_io(onnx.load(str(r.files["onnx"])))
    assert ins[0].name == "image"
    assert all(isinstance(d, str) for i, d in enumerate(ins[0].shape) if i != 1), ins[0].shape
    assert ins[0].shape[1] == 3
    assert "torch.onnx.export" in r.details["how"]


@pytest.mark.skipif(not torch_available(), reason="PyTorch is not installed")
def test_torch_factory_that_cannot_be_imported_is_a_config_error(tmp_path):
    cfg = {"format": "torch", "factory": "no.such.module:make", "opset": 17, "inputs": {"x": {"shape": [1], "dtype": "float32"}}}
    with pytest.raises(ConfigError) as e:
        onnx_from_model(cfg, [], tmp_path / "m.onnx")
    assert "no.such.module:make" in str(e.value)


def test_legacy_ir3_initializers_stop_being_inputs():
    import numpy as np
    import onnxruntime as ort

    from tests.conftest import make_legacy_ir3_model

    legacy = make_legacy_ir3_model()
    model, notes = sanitize(make_legacy_ir3_model())
    assert model.ir_version == 4 and [i.name for i in model.graph.input] == ["x"]
    assert any("IR 3 -> 4" in n for n in notes)
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(0).standard_normal((1, 3, 6, 6)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_allclose(run(model), run(legacy), rtol=1e-6, atol=1e-6)


def test_nodes_out_of_topological_order_are_sorted_not_refused(tmp_path):
    import numpy as np
    import onnxruntime as ort

    from tests.conftest import make_fp16_weights_unsorted_model

    raw = make_fp16_weights_unsorted_model()
    onnx.save(raw, str(tmp_path / "half.onnx"))
    with pytest.raises(Exception, match="topologically sorted"):
        onnx.checker.check_model(raw)
    r = onnx_from_model({"format": "onnx", "source": str(tmp_path / "half.onnx")}, [], tmp_path / "m.onnx")
    m = onnx.load(str(r.files["onnx"]))
    onnx.checker.check_model(m)
    assert [n.name for n in m.graph.node][-1] == "mm2"
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    run = lambda mm: ort.InferenceSession(mm.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_allclose(run(m), run(raw), rtol=1e-6)


def test_a_model_written_with_todays_onnx_defaults_is_lowered_to_the_ir_onnx_runtime_loads(tmp_path):
    """onnx 1.23's make_model writes IR 14; ONNX Runtime 1.31 loads IR <= 13: the same graph at the newest IR it loads."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from tasks.graph.load import runtime_max_ir
    from tasks.onnxrt.ort import ort_run, ort_session

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "new",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 8, 8])], initializer=[w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert m.ir_version == onnx.IR_VERSION > runtime_max_ir()  # what a user gets today
    onnx.save(m, str(tmp_path / "new.onnx"))
    r = onnx_from_model({"format": "onnx", "source": str(tmp_path / "new.onnx")}, [], tmp_path / "out" / "m.onnx")
    out = onnx.load(str(r.files["onnx"]))
    assert out.ir_version == runtime_max_ir()
    assert any(n.startswith(f"IR {onnx.IR_VERSION} -> {runtime_max_ir()}") for n in r.details["sanitize"])
    x = np.ones((2, 3, 8, 8), np.float32)
    assert ort_run(ort_session(r.files["onnx"]), {"x": x})["y"].shape == (2, 4, 8, 8)


def make_tf_style_conv1d(path):
    """A TF converter's 1-D convolution: x [N, T, C] (every dim symbolic) -> Unsqueeze -> Transpose -> Conv whose filter
    is a flat constant reshaped to [O, C, 1, 3] with C read from x's shape at run time -> Transpose -> Reshape."""
    import numpy as np
    from onnx import TensorProto as T, helper, numpy_helper as nh

    c, o = 16, 8
    inits = [nh.from_array(np.random.default_rng(0).standard_normal((o * c * 3,)).astype(np.float32), "wf"),
             nh.from_array(np.array([2], np.int64), "i2"), nh.from_array(np.array([o], np.int64), "o"),
             nh.from_array(np.array([1], np.int64), "one"), nh.from_array(np.array([3], np.int64), "three"),
             nh.from_array(np.array([0, 0, -1], np.int64), "back")]
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i2"], ["c"], axis=0),
             helper.make_node("Concat", ["o", "c", "one", "three"], ["wshape"], axis=0),
             helper.make_node("Reshape", ["wf", "wshape"], ["w"]),
             helper.make_node("Unsqueeze", ["x", "one"], ["x4"]),
             helper.make_node("Transpose", ["x4"], ["xc"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["xc", "w"], ["y4"], pads=[0, 1, 0, 1], name="conv1d"),
             helper.make_node("Transpose", ["y4"], ["yt"], perm=[0, 2, 3, 1]),
             helper.make_node("Reshape", ["yt", "back"], ["y"])]
    g = helper.make_graph(nodes, "tf1d", [helper.make_tensor_value_info("x", T.FLOAT, ["N", "T", "C"])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["N", "T", o])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 7
    onnx.save(m, str(path))
    return path


def test_a_conv_whose_filter_shape_only_the_profile_reveals_is_folded_and_builds(tmp_path):
    """TensorRT's parser refuses the Conv ("the channel dimension of a dynamic filter must have static length"); with the
    dims every profile fixes made static, constants and shapes fold, the filter is a weight, and the engine builds
    with the same outputs in ONNX Runtime. A graph whose convolutions are known is not touched."""
    import numpy as np

    from tasks.trt.backend import Backend
    from tasks.engines.build import engine_from_onnx
    from tasks.common.errors import StageError
    from tasks.graph.fold import unknown_conv_shapes
    from tasks.onnxrt.ort import ort_runner

    src = make_tf_style_conv1d(tmp_path / "tf1d.onnx")
    profile = {"x": {"min": [1, 8, 16], "opt": [2, 64, 16], "max": [4, 128, 16]}}
    build = lambda p, name: engine_from_onnx(p, tmp_path / name, [profile], "8.6",  # noqa: E731
                                             {"optimization_level": 0, "workspace_mib": None}, Backend("tensorrt_rtx"),
                                             show_progress=False)
    with pytest.raises(StageError, match="dynamic filter"):
        build(src, "raw.engine")

    r = onnx_from_model({"format": "onnx", "source": str(src)}, [profile], tmp_path / "out" / "m.onnx")
    folded = onnx.load(str(r.files["onnx"]))
    assert not unknown_conv_shapes(folded) and "w" in {t.name for t in folded.graph.initializer}
    assert any("convolutions are known now" in n for n in r.details["sanitize"]), r.details["sanitize"]
    assert build(r.files["onnx"], "folded.engine").metrics["engine_bytes"] > 0
    x = {"x": np.random.default_rng(1).standard_normal((3, 20, 16)).astype(np.float32)}
    np.testing.assert_allclose(ort_runner(r.files["onnx"])(x)["y"], ort_runner(src)(x)["y"], rtol=1e-5, atol=1e-5)

    plain = onnx_from_model({"format": "onnx", "source": str(src)}, [], tmp_path / "plain" / "m.onnx")
    assert "folded" not in plain.details  # no profile fixes C: nothing is known, nothing kept
