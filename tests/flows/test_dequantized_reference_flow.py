"""A dynamically quantized model built dequantized: when it departs from the model as shipped, the
refusal says why (the engine computes the float model the quantized one approximates, how far the two are apart on
these inputs, that the inputs are random) and the user can pick the reference, recorded (real builds)."""
from __future__ import annotations

import pytest

from tests.flows.test_build_flow import build
from tests.tasks.prequant.test_rewrite import quantized_models  # noqa: F401  (session fixture)

PROFILE = "profiles:\n  - x: {min: [1, 3, 16, 16], opt: [2, 3, 16, 16], max: [8, 3, 16, 16]}\n"


@pytest.fixture(scope="module")
def dyn_dir(tmp_path_factory, quantized_models):  # noqa: F811
    d = tmp_path_factory.mktemp("dyn")
    (d / "model").mkdir()
    (d / "model" / "dyn.yaml").write_text(f"name: dyn\nformat: onnx\nsource: {quantized_models['dynamic']}\n" + PROFILE)
    return d


def test_the_refusal_says_what_dequantizing_did_and_how_to_choose(prefect_harness, dyn_dir, tmp_path):
    # a budget tighter than the float form's own distance to the shipped model: no engine of it can meet it
    s = build(["model=dyn", "precision=fp32", "model.dequantize_dynamic=true", "accuracy.min_cosine=0.9999999",
               "stages.benchmark=false"], dyn_dir, tmp_path / "a")
    assert s["status"] == "failed"
    apart = s["metrics"]["dequantized_vs_shipped_cosine_min"]
    assert 0 < apart < 0.9999999
    err = s["error"]
    assert "the engine computes the float model that the dynamically quantized one approximates" in err
    assert f"cosine {apart:.6f} to the model as shipped" in err and "random values inside the profiles" in err
    assert "model.reference=dequantized" in err and "validation.data=" in err
    assert "itself gives cosine" not in err  # not the shipped model's agreement with itself: beside the point here


def test_the_float_forms_distance_is_judged_by_the_users_metric(prefect_harness, dyn_dir, tmp_path):
    """With accuracy.metric other than cosine, how far the float form is from the model as shipped is said, and judged,
    by that metric: here elementwise tolerances no float form of a dynamically quantized model meets."""
    s = build(["model=dyn", "precision=fp32", "model.dequantize_dynamic=true", "accuracy.metric=allclose",
               "accuracy.atol=1e-9", "accuracy.rtol=1e-9", "stages.benchmark=false"], dyn_dir, tmp_path / "m")
    assert s["status"] == "failed"
    score = s["metrics"]["dequantized_vs_shipped_score"]
    assert 0 <= score < 1.0
    err = s["error"]
    assert f"scores {score:.6g} by accuracy.metric=allclose (fails share of elements within" in err, err
    assert "no engine of it can agree more closely with the model as shipped" in err


def test_the_user_can_pick_the_dequantized_float_form_as_the_reference(prefect_harness, dyn_dir, tmp_path):
    s = build(["model=dyn", "precision=fp16", "model.dequantize_dynamic=true", "model.reference=dequantized",
               "stages.benchmark=false"], dyn_dir, tmp_path / "b")
    assert s["status"] == "ok", s.get("error")
    assert s["stages"]["validate"]["reference"] == "its dequantized float form (model.reference=dequantized)"
    assert s["metrics"]["cosine_min"] >= 0.99 and "dequantized_vs_shipped_cosine_min" not in s["metrics"]
    from tests.flows.test_build_flow import mlflow_run
    assert mlflow_run(s["mlflow"]["run_id"]).data.params["model.reference"] == "dequantized"  # the choice, recorded


def test_the_dequantized_reference_needs_the_dequantized_build(dyn_dir, tmp_path):
    from flows.config import compose_config, preflight
    from tasks.common.errors import ConfigError

    cfg = compose_config(["model=dyn", "model.reference=dequantized", f"out_dir={tmp_path}"], str(dyn_dir))
    with pytest.raises(ConfigError, match="model.dequantize_dynamic=true"):
        preflight(cfg, str(dyn_dir))


def test_int8_of_a_dynamically_quantized_model_dequantized_is_calibrated_anew(prefect_harness, dyn_dir, tmp_path):
    """model.dequantize_dynamic=true at int8 makes the model float, then calibrates it like any float model: preflight
    asks for calibration data before any stage (exit 2, no run), and with data the build quantizes its layers."""
    import numpy as np

    from flows.config import compose_config, preflight
    from tasks.common.errors import ConfigError

    cfg = compose_config(["model=dyn", "precision=int8", "model.dequantize_dynamic=true", f"out_dir={tmp_path}"],
                         str(dyn_dir))
    with pytest.raises(ConfigError, match=r"needs calibration data \(model.dequantize_dynamic=true makes the model"):
        preflight(cfg, str(dyn_dir))
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).standard_normal((16, 3, 16, 16)).astype(np.float32))
    s = build(["model=dyn", "precision=int8", "model.dequantize_dynamic=true", f"calibration.data={tmp_path / 'cal.npz'}",
               "stages.benchmark=false"], dyn_dir, tmp_path / "c")
    assert s["status"] == "ok", s.get("error")
    assert s["metrics"]["quantized_layers"] >= 1 and s["stages"]["calibrate"]["status"] == "ok"


@pytest.mark.slow
def test_a_dynamically_quantized_conv1d_with_weights_in_the_graph_builds_as_one_engine(prefect_harness, tmp_path):
    """ONNX Runtime's quantize_dynamic of weight-normed Conv1d layers (uint8 activations and uint8 weights, both
    quantized at run time) through the whole flow with model.dequantize_dynamic=true: one TensorRT graph, nothing native,
    its float form within dynamic quantization's error of the model as shipped."""
    from onnxruntime.quantization import quantize_dynamic

    from tests.tasks.prequant.test_dynamic import conv1d_model

    f32 = conv1d_model(tmp_path / "float.onnx", weight_norm=True)
    quantize_dynamic(str(f32), str(tmp_path / "conv1d_dyn.onnx"), op_types_to_quantize=["Conv"])
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "c1d.yaml").write_text(
        f"name: c1d\nformat: onnx\nsource: {tmp_path / 'conv1d_dyn.onnx'}\n"
        "profiles:\n  - x: {min: [1, 4, 16], opt: [2, 4, 64], max: [4, 4, 128]}\n")
    s = build(["model=c1d", "precision=fp32", "model.dequantize_dynamic=true", "stages.benchmark=false"],
              tmp_path / "conf", tmp_path / "b")
    assert s["status"] == "ok", s.get("error")
    assert s["metrics"]["trt_subgraphs"] == 1 and s["metrics"]["fallback_nodes"] == 0, s["metrics"]
    assert s["metrics"]["dequantized_vs_shipped_cosine_min"] >= 0.999, s["metrics"]


def test_an_int8_build_whose_q_dq_reach_no_tensorrt_layer_says_to_build_at_fp16(
        prefect_harness, quantized_models, tmp_path):  # noqa: F811
    """A dynamically quantized model that also carries a Q/DQ pair (on its output, as Kokoro's 4 pairs beside 380
    dynamic ops): built at int8 as shipped, its TensorRT parts compute no int8, and the refusal says to build it at
    fp16 or dequantize it, not to look at fp16's range checks."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(quantized_models["dynamic"]))
    g = m.graph
    out = g.output[0].name
    for n in g.node:
        n.output[:] = [out + "_f" if o == out else o for o in n.output]
    g.initializer.extend([numpy_helper.from_array(np.array(0.05, np.float32), "q_scale"),
                          numpy_helper.from_array(np.array(0, np.int8), "q_zero")])
    g.node.extend([helper.make_node("QuantizeLinear", [out + "_f", "q_scale", "q_zero"], [out + "_q"]),
                   helper.make_node("DequantizeLinear", [out + "_q", "q_scale", "q_zero"], [out])])
    onnx.save(m, str(tmp_path / "mixed.onnx"))
    d = tmp_path / "conf"
    (d / "model").mkdir(parents=True)
    (d / "model" / "mixed.yaml").write_text(f"name: mixed\nformat: onnx\nsource: {tmp_path / 'mixed.onnx'}\n" + PROFILE)
    s = build(["model=mixed", "precision=int8", "stages.benchmark=false"], d, tmp_path / "b")
    assert s["status"] == "failed"
    assert "an engine named int8 would compute fp32 100.0% of its FLOPs" in s["error"], s["error"]
    assert "build it at precision=fp16: none of its int8 layers is in a TensorRT part" in s["error"]
    assert "model.dequantize_dynamic=true" in s["error"] and "fp16_data_max" not in s["error"]
