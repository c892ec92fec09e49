"""Binding inputs to constants (model.constants) and folding the If nodes they decide."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tasks.common.errors import ConfigError
from tasks.sources.export import onnx_from_model
from tasks.graph.specialise import array_from_constant
from tests.conftest import IF_PROFILE


def fold(if_onnx, tmp_path, mode: int):
    cfg = {"format": "onnx", "source": str(if_onnx), "constants": {"mode": mode}}
    return onnx_from_model(cfg, [IF_PROFILE], tmp_path / f"m{mode}.onnx")


@pytest.mark.parametrize("mode", [16000, 8000])
def test_bound_input_folds_every_if_and_matches_the_model_fed_that_value(if_onnx, tmp_path, mode):
    r = fold(if_onnx, tmp_path, mode)
    m = onnx.load(str(r.files["onnx"]))
    onnx.checker.check_model(m, full_check=True)
    assert [i.name for i in m.graph.input] == ["x"]
    assert not any(n.op_type == "If" for n in m.graph.node), [n.op_type for n in m.graph.node]
    assert any("inlined" in n for n in r.details["constants"])
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    want = ort.InferenceSession(str(if_onnx)).run(None, {"x": x, "mode": np.array(mode, np.int64)})[0]
    got = ort.InferenceSession(str(r.files["onnx"])).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_folded_model_builds_a_real_engine(if_onnx, tmp_path):
    from tasks.trt.backend import Backend
    from tasks.engines.build import engine_from_onnx

    r = fold(if_onnx, tmp_path, 16000)
    eng = engine_from_onnx(r.files["onnx"], tmp_path / "if.engine", [IF_PROFILE], "8.6",
                           {"optimization_level": 0, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
    assert eng.metrics["engine_bytes"] > 0


def test_a_model_without_constants_is_exported_as_before(if_onnx, tmp_path):
    cfg = {"format": "onnx", "source": str(if_onnx)}
    a = onnx_from_model(cfg, [IF_PROFILE], tmp_path / "a.onnx")
    b = onnx_from_model({**cfg, "constants": {}}, [IF_PROFILE], tmp_path / "b.onnx")
    assert a.files["onnx"].read_bytes() == b.files["onnx"].read_bytes()
    assert "constants" not in b.details and sum(n.op_type == "If" for n in onnx.load(str(b.files["onnx"])).graph.node) == 2


@pytest.mark.parametrize("value, dtype, shape, words", [
    ([16000], "int64", [], "has shape [1] but input 'sr' is rank 0"),
    (16000.5, "int64", [], "not integral"),
    ("fast", "int64", [], "not a number"),
    ([[1.0, 2.0]], "float32", [1, 3], "has shape [1, 2]"),
])
def test_a_constant_that_does_not_fit_its_input_is_refused(value, dtype, shape, words):
    with pytest.raises(ConfigError) as e:
        array_from_constant("sr", value, dtype, shape)
    assert words in str(e.value) and "model.constants.sr" in str(e.value) and "fix:" in str(e.value)
    assert array_from_constant("sr", 16000, "int64", []).dtype == np.int64
