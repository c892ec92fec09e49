"""The engine registry and the scheduled rebuild, with real builds, a real SQLite MLflow store and real Prefect."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from flows.config import compose_config
from tests.conftest import make_conv_model
from tasks.common.util import sha256_file

PROFILE = "profiles:\n  - x: {min: [1, 3, 8, 8], opt: [2, 3, 16, 16], max: [4, 3, 32, 32]}\n"


def underflow_model(path: Path, exponent: int = 19) -> Path:
    """The tiny conv model with its output scaled by 2^-exponent and back: the same function in fp32, but in fp16 the
    scaled values fall below fp16's normal range (6.1e-5) and keep fewer bits, so its fp16 engine validates worse
    (cosine ~0.99996 at 2^-19 with fp16 values rounded as TensorRT stores them, against the plain model's 0.9999999).
    The underflow guard keeps nodes fp32 only where fp16 leaves such a value over 1% off (2^-22: ~7%, kept fp32 and
    exact again); at 2^-19 it is ~0.9%, so what this stands for is a model change that costs accuracy no conversion
    check catches."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    make_conv_model(path)
    m = onnx.load(str(path))
    g = m.graph
    g.node[-1].output[0] = "y_full"
    g.initializer.extend([numpy_helper.from_array(np.float32(2.0 ** -exponent), "down"),
                          numpy_helper.from_array(np.float32(2.0 ** exponent), "up")])
    g.node.extend([helper.make_node("Mul", ["y_full", "down"], ["y_small"], name="scale_down"),
                   helper.make_node("Mul", ["y_small", "up"], ["y"], name="scale_up")])
    onnx.save(m, str(path))
    return path


@pytest.fixture()
def farm(tmp_path):
    """Two user models in a --config-dir, their own MLflow experiment, out and cache folders."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    names = {"a": f"rb_a_{uuid.uuid4().hex[:6]}", "b": f"rb_b_{uuid.uuid4().hex[:6]}"}
    for k, name in names.items():
        make_conv_model(tmp_path / f"{k}.onnx", channels=8 if k == "a" else 6)
        (conf / "model" / f"{name}.yaml").write_text(f"name: {name}\nformat: onnx\nsource: {tmp_path / (k + '.onnx')}\n{PROFILE}")
    return {"tmp": tmp_path, "conf": conf, "names": names, "experiment": f"rebuild-{uuid.uuid4().hex[:8]}"}


def build(farm, model: str, precision: str):
    from flows.build import run_build

    ov = [f"model={model}", f"precision={precision}", f"experiment={farm['experiment']}", "stages.benchmark=false",
          f"out_dir={farm['tmp'] / 'out'}", f"cache_dir={farm['tmp'] / 'cache'}"]
    cfg = compose_config(ov, str(farm["conf"]))
    return run_build(cfg, str(farm["conf"]), show_progress=False, overrides=ov)


def client():
    from mlflow import MlflowClient

    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def test_ok_builds_are_registry_versions_with_an_alias_and_rebuild_does_exactly_what_changed(prefect_harness, farm, tmp_path):
    from flows.rebuild import rebuild_pass

    a, b = farm["names"]["a"], farm["names"]["b"]
    sa = build(farm, a, "fp16")
    sb = build(farm, b, "fp32")
    assert sa["status"] == sb["status"] == "ok", (sa.get("error"), sb.get("error"))

    # the registry: one model per trtforge model, the engines a version linked to the run, the alias on it
    c = client()
    mv = c.get_model_version_by_alias(a, "sm_86-fp16")
    assert mv.run_id == sa["mlflow"]["run_id"] and mv.source == f"{sa['mlflow']['artifact_uri']}/engine"
    assert {k: mv.tags[k] for k in ("target", "precision", "sha256", "cache_key")} == \
        {"target": "sm_86", "precision": "fp16", "sha256": sa["engine"]["sha256"], "cache_key": sa["cache_key"]}
    assert mv.tags["backend"].startswith("tensorrt_rtx-")
    import mlflow.artifacts
    got = Path(mlflow.artifacts.download_artifacts(f"models:/{a}@sm_86-fp16", dst_path=str(tmp_path / "dl")))
    assert sha256_file(got / sa["engine"]["file"]) == sa["engine"]["sha256"]

    # nothing changed: every build is fresh, nothing is rebuilt
    r = rebuild_pass(str(tmp_path / "r0.json"), experiment=farm["experiment"], log=lambda *_: None)
    assert (r["checked"], r["rebuilt"], r["failed"], len(r["fresh"])) == (2, [], [], 2)
    assert json.loads((tmp_path / "r0.json").read_text()) == r

    # model a's file changes (same fp16 behaviour): exactly its engine is rebuilt and its alias moves
    make_conv_model(tmp_path / "a.onnx", channels=7)
    r = rebuild_pass(None, experiment=farm["experiment"], log=lambda *_: None)
    assert [x["model"] for x in r["rebuilt"]] == [a] and [x["model"] for x in r["fresh"]] == [b] and not r["failed"]
    moved = c.get_model_version_by_alias(a, "sm_86-fp16")
    assert int(moved.version) == int(mv.version) + 1 and moved.run_id == r["rebuilt"][0]["run_id"]
    assert c.get_model_version_by_alias(b, "sm_86-fp32").run_id == sb["mlflow"]["run_id"]
    out_a = json.loads((farm["tmp"] / "out" / a / "sm_86" / "fp16" / "summary.json").read_text())
    assert out_a["mlflow"]["run_id"] == moved.run_id

    # a change that makes the fp16 engine validate worse: built and registered, but the alias stays
    underflow_model(tmp_path / "a.onnx")
    r = rebuild_pass(None, tolerance=1e-5, experiment=farm["experiment"], log=lambda *_: None)
    assert not r["rebuilt"] and [x["model"] for x in r["failed"]] == [a], r
    assert "validates worse" in r["failed"][0]["reason"]
    assert c.get_model_version_by_alias(a, "sm_86-fp16").version == moved.version
    worse = c.get_model_version(a, r["failed"][0]["version"])
    assert float(worse.tags["cosine_min"]) < float(moved.tags["cosine_min"]) - 1e-5


def test_a_retried_tracking_call_continues_its_own_run(tmp_path):
    from flows.tracking import log_build

    (tmp_path / "summary.json").write_text("{}")
    summary = {"model": "m", "target": "sm_86", "precision": "fp32", "status": "failed", "stages": {}, "metrics": {},
               "engines": [], "cache_key": "k"}
    kw = dict(experiment=f"retry-{uuid.uuid4().hex[:8]}", summary=summary, params={"a": "1"}, resolved_yaml="a: 1\n",
              out_dir=tmp_path, engine_files=[], versions={"backend": "x"}, build_id=uuid.uuid4().hex, provenance={})
    first, again = log_build(**kw), log_build(**kw)
    assert first["run_id"] == again["run_id"]
    assert len(client().search_runs([first["experiment_id"]])) == 1
