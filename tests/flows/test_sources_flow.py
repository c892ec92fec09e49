"""Whole builds from the other sources: a Paddle 3 model (paddle.jit.save), and models that arrive quantized by ONNX
Runtime (static Q/DQ with uint8 activations and int32 bias; dynamic), built at int8 with no calibration data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.flows.test_build_flow import build
from tests.tasks.sources.test_paddle import tiny_paddle_json  # noqa: F401  (session fixture)
from tests.tasks.prequant.test_rewrite import quantized_models  # noqa: F401  (session fixture)

PROFILE = "profiles:\n  - {name}: {{min: [1, 3, {h}, {h}], opt: [2, 3, {h}, {h}], max: [8, 3, {h}, {h}]}}\n"


@pytest.fixture(scope="module")
def sources_dir(tmp_path_factory, tiny_paddle_json, quantized_models):  # noqa: F811
    """A user's config dir: the Paddle 3 model, and the tiny conv model quantized three ways by ONNX Runtime."""
    d = tmp_path_factory.mktemp("sources")
    (d / "model").mkdir()
    (d / "model" / "paddle_tiny.yaml").write_text(
        f"name: paddle_tiny\nformat: paddle\nsource: {tiny_paddle_json}\n" + PROFILE.format(name="image", h=16))
    for name in ("static_u8", "static_u8sym", "dynamic"):
        (d / "model" / f"{name}.yaml").write_text(f"name: {name}\nformat: onnx\nsource: {quantized_models[name]}\n"
                                                  + PROFILE.format(name="x", h=16))
    return d


def stages(s) -> dict:
    return {k: v["status"] for k, v in s["stages"].items()}


def test_paddle3_model_builds_with_a_dynamic_batch(prefect_harness, sources_dir, tmp_path):
    s = build(["model=paddle_tiny", "precision=fp32", "stages.benchmark=false"], sources_dir, tmp_path)
    assert s["status"] == "ok", s.get("error")
    cfg = (Path(s["out_dir"]) / "config.yaml").read_text()
    assert "format: paddle" in cfg
    assert s["engine"]["bytes"] > 10_000 and "identical graph, not measured" in s["verdict"]  # fp32: nothing to compare


def test_static_uint8_model_builds_as_is_without_calibration(prefect_harness, sources_dir, tmp_path):
    s = build(["model=static_u8", "precision=int8", "stages.benchmark=false"], sources_dir, tmp_path)
    assert s["status"] == "ok", s.get("error")
    assert stages(s)["calibrate"] == "skipped"
    assert s["stages"]["calibrate"]["reason"] == ("the model is already quantized (6 Q/DQ pairs; 3 asymmetric pairs "
                                                  "kept exactly as shifted int8 (2 of them feeding int8 layers))")
    assert s["metrics"]["quantized_layers"] == 2 and s["metrics"]["fallback_layers"] == 0
    assert s["stages"]["validate"]["reference"] == "the model as shipped"
    assert s["engine"]["file"].endswith(".int8.engine")
    # validated against the model as shipped (ONNX Runtime): every asymmetric pair is an int8 pair shifted by its zero
    # point (the model's own rounding), the shift folded into the convs' biases
    pairs = json.loads((Path(s["out_dir"]) / "prequant.json").read_text())["pairs"]  # what became of each tensor's pair
    assert sorted(p["kind"] for p in pairs.values()) == ["shifted", "shifted", "shifted"]
    v = json.loads((Path(s["out_dir"]) / "validation.json").read_text())
    assert s["metrics"]["cosine_min"] > 0.99999, v
    assert "the same figure on any x86-64 host" in s["metrics"]["cosine_source"]  # no CPU-specific integer kernels


def test_symmetric_uint8_model_builds_an_int8_engine(prefect_harness, sources_dir, tmp_path):
    s = build(["model=static_u8sym", "precision=int8", "stages.benchmark=false"], sources_dir, tmp_path)
    assert s["status"] == "ok", s.get("error")
    assert "already quantized (7 Q/DQ pairs)" in s["stages"]["calibrate"]["reason"]
    assert s["metrics"]["quantized_layers"] == 2 and s["metrics"]["fallback_layers"] == 0
    assert s["metrics"]["cosine_min"] > 0.99999  # identical values to the shipped model in ONNX Runtime


def test_dynamic_quantization_runs_natively_or_in_float_on_request(prefect_harness, sources_dir, tmp_path):
    """Dynamic quantization runs in ONNX Runtime: the engines compute float, so the build is named for the float part
    (fp16 here); int8 would name a precision no engine computes and is refused with the fix; dequantized on request it
    is a float model like any other (one engine)."""
    from tasks.common.errors import ConfigError

    native = build(["model=dynamic", "precision=fp16", "stages.benchmark=false"], sources_dir, tmp_path / "native")
    assert native["status"] == "ok", native.get("error")
    assert native["metrics"]["fallback_nodes"] >= 4  # DynamicQuantizeLinear and ConvInteger run in ONNX Runtime
    assert ".sm_86.fp16." in native["engine"]["file"] and native["metrics"]["flops_share"]["fp16"] > 0.5
    with pytest.raises(ConfigError) as e:
        build(["model=dynamic", "precision=int8", "stages.benchmark=false"], sources_dir, tmp_path / "int8")
    assert "quantization is dynamic" in e.value.message and "model.dequantize_dynamic=true" in e.value.fix
    fl = build(["model=dynamic", "precision=fp32", "stages.benchmark=false", "model.dequantize_dynamic=true"], sources_dir, tmp_path / "float")
    assert fl["status"] == "ok", fl.get("error")
    assert fl["metrics"]["fallback_nodes"] == 0 and fl["metrics"]["trt_subgraphs"] == 1
    assert fl["metrics"]["flops_share"]["fp32"] == 1.0
    assert fl["metrics"]["cosine_min"] > 0.999  # float weights vs the shipped dynamic quantization


def test_a_quantized_model_is_named_for_what_its_engine_computes(prefect_harness, sources_dir, tmp_path):
    """precision=fp16 on a model that arrives int8: its int8 layers stay int8, its float part runs in fp16 (the name
    says fp16, flops_share agrees); precision=fp32 would name an engine that computes int8: refused, exit 2, no run."""
    from tasks.common.errors import ConfigError

    s = build(["model=static_u8", "precision=fp16", "stages.benchmark=false"], sources_dir, tmp_path / "fp16")
    assert s["status"] == "ok", s.get("error")
    share = s["metrics"]["flops_share"]
    assert s["engine"]["file"].endswith(".fp16.engine") and share["int8"] > 0.5 and share["fp16"] > 0, share
    assert share["fp32"] == 0.0, share
    assert s["metrics"]["cosine_min"] > 0.999  # against the model as shipped
    with pytest.raises(ConfigError) as e:
        build(["model=static_u8", "precision=fp32", "stages.benchmark=false"], sources_dir, tmp_path / "fp32")
    assert "arrives quantized to int8" in e.value.message and "precision=int8" in e.value.fix
    assert not (tmp_path / "fp32" / "out").exists() or not list((tmp_path / "fp32" / "out").rglob("summary.json"))


def test_cli_paddle_model_without_its_params_exits_2_with_no_run(tmp_path):
    from tests.flows.test_build_flow import cli

    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "inference.pdmodel").write_bytes(b"\x08\x01")
    (tmp_path / "conf" / "model" / "pd.yaml").write_text(
        f"name: pd\nformat: paddle\nsource: {tmp_path / 'inference.pdmodel'}\n")
    r = cli(["--config-dir", str(tmp_path / "conf"), "model=pd", "precision=fp32"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "inference.pdiparams is missing" in r.stderr and "fix:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "cli-mlflow.db").exists()  # no run
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file() and not p.name.endswith(".lock")]  # nothing published
