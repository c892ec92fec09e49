"""'Up to date' only when it is: a file the build read that the config does not name (external weights, a checkpoint,
a factory's own module, an image of the calibration folder) or a library it used changed behind the same config
rebuilds, with a different engine; nothing else rebuilds. Real builds, real MLflow, real Prefect."""
from __future__ import annotations

import json
import os
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from flows.config import compose_config
from tests.conftest import make_conv_model

PROFILE = "profiles:\n  - x: {min: [1, 3, 8, 8], opt: [2, 3, 16, 16], max: [4, 3, 32, 32]}\n"


def build(conf: Path, tmp: Path, *overrides: str, experiment: str = "staleness"):
    from flows.build import run_build

    ov = [*overrides, "stages.benchmark=false", f"experiment={experiment}", f"out_dir={tmp / 'out'}",
          f"cache_dir={tmp / 'cache'}"]
    s = run_build(compose_config(ov, str(conf)), str(conf), show_progress=False, overrides=ov)
    assert s["status"] == "ok", s.get("error")
    return s


def stages(s: dict) -> dict:
    return {k: v["status"] for k, v in s["stages"].items()}


def external_data_model(path: Path, scale: float) -> Path:
    """The tiny conv model with its weights in a side file `<name>.data` (how models over 2 GB ship)."""
    import onnx
    from onnx import numpy_helper

    make_conv_model(path)
    m = onnx.load(str(path))
    for i, t in enumerate(m.graph.initializer):
        m.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * scale, t.name))
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data",
              size_threshold=0)
    return path


def test_new_external_weights_behind_the_same_config_rebuild(prefect_harness, tmp_path):
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (tmp_path / "m").mkdir()
    onnx_path = external_data_model(tmp_path / "m" / "net.onnx", 1.0)
    (conf / "model" / "ext.yaml").write_text(f"name: ext\nformat: onnx\nsource: {onnx_path}\n{PROFILE}")
    first = build(conf, tmp_path, "model=ext", "precision=fp16")
    again = build(conf, tmp_path, "model=ext", "precision=fp16")
    assert again.get("up_to_date") and again["engine"]["sha256"] == first["engine"]["sha256"]
    data = Path(str(onnx_path) + ".data")
    assert any(e["path"] == str(data.resolve()) for e in first["inputs"]["files"])  # observed, not configured

    before = onnx_path.read_bytes()
    (np.fromfile(data, np.float32) * 0.5).tofile(data)  # retrained: new weights in the side file, the .onnx unchanged
    assert onnx_path.read_bytes() == before
    new = build(conf, tmp_path, "model=ext", "precision=fp16")
    assert not new.get("up_to_date") and new["engine"]["sha256"] != first["engine"]["sha256"]
    assert stages(new)["export"] == "ok" and "changed since the cached result" in new["stages"]["export"]["reason"]
    assert new["mlflow"]["run_id"] != first["mlflow"]["run_id"]
    assert build(conf, tmp_path, "model=ext", "precision=fp16").get("up_to_date")  # and then it is the no-op again


@pytest.fixture()
def torch_conf(tmp_path):
    """A user's torch model: a factory in their config dir that builds the net from a local module and loads a
    checkpoint file (the usual torch workflow); neither file is named in the config."""
    torch = pytest.importorskip("torch")
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    mod = f"user_net_{uuid.uuid4().hex[:8]}"
    (conf / f"{mod}_layers.py").write_text(textwrap.dedent("""
        from torch import nn
        def body(): return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    """))
    (conf / f"{mod}.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        import torch
        from {mod}_layers import body
        def make():
            net = body()
            net.load_state_dict(torch.load(Path(__file__).with_name("weights.pt"), weights_only=True))
            return net
    """))
    torch.manual_seed(0)
    from importlib import util
    spec = util.spec_from_file_location(f"{mod}_layers", conf / f"{mod}_layers.py")
    layers = util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    torch.save(layers.body().state_dict(), conf / "weights.pt")
    (conf / "model" / "tnet.yaml").write_text(
        f"name: tnet\nformat: torch\nfactory: \"{mod}:make\"\ninputs:\n  x: {{shape: [2, 3, 16, 16], dtype: float32}}\n{PROFILE}")
    return conf, mod, layers


@pytest.mark.slow
def test_a_retrained_checkpoint_or_an_edited_module_rebuilds_and_the_rebuild_flow_moves_the_alias(
        prefect_harness, tmp_path, torch_conf):
    import torch
    from mlflow import MlflowClient

    from flows.rebuild import rebuild_pass

    conf, mod, layers = torch_conf
    experiment = f"stale-{uuid.uuid4().hex[:8]}"
    first = build(conf, tmp_path, "model=tnet", "precision=fp32", experiment=experiment)
    read = {Path(e["path"]).name for e in first["inputs"]["files"]}
    assert {"weights.pt", f"{mod}.py", f"{mod}_layers.py"} <= read, read
    assert build(conf, tmp_path, "model=tnet", "precision=fp32", experiment=experiment).get("up_to_date")

    torch.manual_seed(1)  # retrained: the same architecture, new weights, the same config
    torch.save(layers.body().state_dict(), conf / "weights.pt")
    report = rebuild_pass(experiment=experiment, log=lambda *_: None)
    assert [r["model"] for r in report["rebuilt"]] == ["tnet"] and not report["failed"], report
    c = MlflowClient()
    mv = c.get_model_version_by_alias("tnet", "sm_86-fp32")
    assert mv.run_id == report["rebuilt"][0]["run_id"] != first["mlflow"]["run_id"]
    assert mv.tags["sha256"] != first["engine"]["sha256"]
    assert rebuild_pass(experiment=experiment, log=lambda *_: None)["fresh"]  # and now it is fresh

    # the factory's own module edited (one more channel): rebuilt, another engine
    lf = conf / f"{mod}_layers.py"
    lf.write_text(lf.read_text().replace("nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()", "nn.Conv2d(3, 4, 3, padding=1), nn.Tanh()"))
    edited = build(conf, tmp_path, "model=tnet", "precision=fp32", experiment=experiment)
    assert not edited.get("up_to_date") and edited["engine"]["sha256"] != mv.tags["sha256"]


def test_new_paddle_params_behind_the_same_config_rebuild(prefect_harness, tmp_path):
    """A Paddle model retrained: the .pdiparams beside the program changes, the program and the config do not."""
    import subprocess
    import sys

    from tests.tasks.sources.test_paddle import SAVE_TINY

    pytest.importorskip("paddle")
    (tmp_path / "save.py").write_text(SAVE_TINY.replace("paddle.seed(0)", "paddle.seed(int(sys.argv[2]))"))
    for seed, d in ((0, "m"), (1, "retrained")):
        subprocess.run([sys.executable, str(tmp_path / "save.py"), str(tmp_path / d / "tiny"), str(seed)], check=True,
                       capture_output=True)
    program = tmp_path / "m" / "tiny.json"
    assert program.read_bytes() == (tmp_path / "retrained" / "tiny.json").read_bytes()  # weights differ, program does not
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "pd.yaml").write_text(f"name: pd\nformat: paddle\nsource: {program}\n"
                                            "profiles:\n  - image: {min: [1, 3, 16, 16], opt: [2, 3, 16, 16], max: [4, 3, 16, 16]}\n")
    first = build(conf, tmp_path, "model=pd", "precision=fp32")
    assert build(conf, tmp_path, "model=pd", "precision=fp32").get("up_to_date")
    params = tmp_path / "m" / "tiny.pdiparams"
    assert any(Path(e["path"]).name == params.name for e in first["inputs"]["files"])  # recorded, not configured
    params.write_bytes((tmp_path / "retrained" / "tiny.pdiparams").read_bytes())
    new = build(conf, tmp_path, "model=pd", "precision=fp32")
    assert not new.get("up_to_date") and new["engine"]["sha256"] != first["engine"]["sha256"]
    assert build(conf, tmp_path, "model=pd", "precision=fp32").get("up_to_date")


def test_a_replaced_calibration_image_or_a_library_upgrade_rebuilds(prefect_harness, tmp_path):
    from PIL import Image

    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)).save(images / f"{i}.png")  # dark images
    make_conv_model(tmp_path / "net.onnx")
    (conf / "model" / "img.yaml").write_text(
        f"name: img\nformat: onnx\nsource: {tmp_path / 'net.onnx'}\n{PROFILE}"
        f"images: {{source: {images}, input: x, height: 16, width: 16, channel_order: RGB}}\n")
    args = ("model=img", "precision=int8", "calibration.method=minmax", "calibration.samples=4", "accuracy.min_cosine=0.9")
    first = build(conf, tmp_path, *args)
    assert build(conf, tmp_path, *args).get("up_to_date")
    cal_files = {f["file"] for f in first["data"]["calibration"]["files"]}
    Image.fromarray(np.full((16, 16, 3), 250, np.uint8)).save(images / sorted(cal_files)[0])  # one calibration image
    new = build(conf, tmp_path, *args)
    assert not new.get("up_to_date") and stages(new)["calibrate"] == "ok"
    assert new["engine"]["sha256"] != first["engine"]["sha256"]  # other ranges: another int8 engine
    assert stages(new)["export"] == stages(new)["partition"] == "cached"  # what the image does not feed is not redone

    # a library that shapes an output at another version than the one the result was made with: rebuilt
    published = Path(new["out_dir"]) / "summary.json"
    s = json.loads(published.read_text())
    s["inputs"]["libraries"] = {**s["inputs"]["libraries"], "numpy": "1.0.0"}
    published.write_text(json.dumps(s))
    assert not build(conf, tmp_path, *args).get("up_to_date")


def test_stage_keys_hold_the_versions_of_the_libraries_that_shape_them(tmp_path):
    from flows.context import BuildContext
    from tasks.common.deps import STAGE_LIBRARIES, changed, library_versions

    assert {"onnxconverter-common", "ml_dtypes"} <= set(STAGE_LIBRARIES["build"])
    assert {"onnxruntime"} <= set(STAGE_LIBRARIES["calibrate"]) and "Pillow" in STAGE_LIBRARIES["data"]
    assert {"torch", "onnxscript", "paddle2onnx", "paddlepaddle"} <= set(STAGE_LIBRARIES["export"])
    now = library_versions(["numpy"])["numpy"]
    assert changed({"libraries": {"numpy": now}}) is None
    assert changed({"libraries": {"numpy": "0.0.1"}}) == f"library numpy is {now}, was 0.0.1"
    assert "cached" in BuildContext.cached.__doc__


def test_the_recorder_sees_reads_not_writes_nor_the_python_installation(tmp_path):
    import onnx

    from tasks.common.deps import changed, recording

    src = tmp_path / "in.txt"
    src.write_text("x")
    with recording(exclude=[tmp_path / "work"]) as rec:
        src.read_text()
        (tmp_path / "out.txt").write_text("y")
        (tmp_path / "work").mkdir()
        (tmp_path / "work" / "mine.txt").write_text("z")
        (tmp_path / "work" / "mine.txt").read_text()
        np.save(tmp_path / "a.npy", np.zeros(3))
        np.load(tmp_path / "a.npy")
        os.close(os.open(str(src), os.O_RDONLY))
        onnx.helper  # noqa: B018 - a module of the installation: its version, not its files
    got = {Path(p).name for p in rec.paths}
    assert got == {"in.txt", "a.npy"}, got
    m = rec.record()
    assert changed(m) is None
    src.write_text("changed")
    assert changed(m) == f"{src.resolve()} changed"
