"""accuracy.metric end to end: a two-class softmax classifier built here at int8 (real TensorRT-RTX builds,
the real int8 search in ONNX Runtime, a real MLflow store and Prefect), gated by allclose, by a user function from the
config dir, and guarded by it in a scheduled rebuild."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from flows.config import compose_config
from tasks.common.errors import ConfigError
from tests.tasks.accuracy.test_metric import MINORITY, make_softmax_classifier

PROFILE = "profiles:\n  - x: {min: [1, 3, 16, 16], opt: [4, 3, 16, 16], max: [8, 3, 16, 16]}\n"


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """Two classifiers in a --config-dir with the user's metric module beside the YAMLs, calibration data, its own
    experiment, out and cache folders (shared: export and the fp16 baseline are built once)."""
    tmp = tmp_path_factory.mktemp("accuracy_metric")
    conf = tmp / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "minority_metric.py").write_text(MINORITY)
    names = {}
    for key, weight, gap in (("mild", 1.0, 8.0), ("strong", 5.0, 3.5)):  # strong: int8 moves the minority > 5%
        names[key] = f"cls_{key}_{uuid.uuid4().hex[:6]}"
        make_softmax_classifier(tmp / f"{key}.onnx", feature_weight=weight, bias_gap=gap)
        (conf / "model" / f"{names[key]}.yaml").write_text(
            f"name: {names[key]}\nformat: onnx\nsource: {tmp / (key + '.onnx')}\n{PROFILE}")
    np.savez(tmp / "data.npz", x=np.random.default_rng(1).standard_normal((24, 3, 16, 16)).astype(np.float32))
    return {"tmp": tmp, "conf": conf, "names": names, "experiment": f"accuracy-{uuid.uuid4().hex[:8]}"}


def overrides(farm, model: str, precision: str, *extra: str) -> list[str]:
    return [f"model={farm['names'][model]}", f"precision={precision}", f"experiment={farm['experiment']}",
            f"calibration.data={farm['tmp'] / 'data.npz'}", "stages.benchmark=false", f"out_dir={farm['tmp'] / 'out'}",
            f"cache_dir={farm['tmp'] / 'cache'}", *extra]


def build(farm, model: str, precision: str, *extra: str) -> dict:
    from flows.build import run_build

    ov = overrides(farm, model, precision, *extra)
    return run_build(compose_config(ov, str(farm["conf"])), str(farm["conf"]), show_progress=False, overrides=ov)


def client():
    from mlflow import MlflowClient

    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def test_allclose_on_a_saturated_softmax_keeps_layers_in_fp16_until_it_passes(prefect_harness, farm):
    """Cosine says 1.000000 at all-int8 while the minority probability moves by more than 1%: allclose (atol 1e-5,
    rtol 0.01) makes the search keep layers in fp16 until every element is within, and the build passes."""
    s = build(farm, "mild", "int8")
    assert s["status"] == "ok" and s["metrics"]["fallback_layers"] == 0 and s["metrics"]["cosine_min"] > 0.99999
    assert s["accuracy"]["metric"] == "cosine"
    assert s["accuracy"]["logits"]["prob"]["op"] == "Softmax"  # the logits reported beside the output
    s = build(farm, "mild", "int8", "accuracy.metric=allclose", "accuracy.atol=1e-5", "accuracy.rtol=0.01")
    acc = s.get("accuracy") or {}
    # docs/accuracy.md: keeps 2 of the 3 layers in fp16 (every layer int8: half the elements within) and passes
    assert s["status"] == "ok", s.get("error")
    assert s["metrics"]["fallback_layers"] == 2 and s["metrics"]["quantized_layers"] == 1, s["metrics"]
    assert s["metrics"]["search_metric"] == "allclose"
    assert s["metrics"]["search_score_all_quantized"] < 1.0 <= s["metrics"]["search_score_worst_feed"]
    assert acc["metric"] == "allclose" and acc["passed"] and acc["outputs"] == {"prob": 1.0}
    assert acc["settings"] == {"atol": 1e-5, "rtol": 0.01, "min_within": 1.0}
    assert len(acc["per_sample"]) == s["metrics"]["validate_samples"]
    assert "accuracy.metric=allclose" in s["verdict"] and "cosine_min" in s["verdict"]
    mv = client().get_model_version_by_alias(farm["names"]["mild"], "sm_86-int8")
    assert mv.tags["accuracy_metric"] == "allclose" and float(mv.tags["accuracy_score"]) == 1.0


def test_a_user_function_from_the_config_dir_gates_the_build_and_its_search(prefect_harness, farm):
    s = build(farm, "strong", "int8")  # cosine: every layer int8
    assert s["status"] == "ok" and s["metrics"]["fallback_layers"] == 0, s.get("error")
    s = build(farm, "strong", "int8", "accuracy.metric=minority_metric:within_5pct", "accuracy.greater_is_better=false")
    assert s["status"] == "ok", s.get("error")
    m, acc = s["metrics"], s["accuracy"]
    # the search judged by the function: all-int8 fails it (0), the written graph passes it (1)
    assert m["search_metric"] == "minority_metric:within_5pct" and m["fallback_layers"] >= 1
    assert (m["search_score_all_quantized"], m["search_score_worst_feed"]) == (0.0, 1.0)
    assert acc["metric"] == "minority_metric:within_5pct" and acc["passed"] and acc["score"] <= 0.05
    assert acc["score"] == max(b["score"] for b in acc["per_sample"]) and all(b["passed"] for b in acc["per_sample"])
    assert m["accuracy_score"] == acc["score"] and "minority_metric:within_5pct worst score" in s["verdict"]


def test_a_raising_function_or_bad_settings_stop_the_build_with_a_clear_error_and_no_run(prefect_harness, farm):
    from flows.config import preflight

    def runs() -> int:
        exp = client().get_experiment_by_name(farm["experiment"])
        return len(client().search_runs([exp.experiment_id])) if exp else 0

    before = runs()
    for extra, words in ((["accuracy.metric=minority_metric:boom"], "accuracy.metric=minority_metric:boom raised "
                                                                   "ValueError: no labels for batch of"),
                         (["accuracy.metric=minority_metric:missing"], "has no function 'missing'"),
                         (["accuracy.metric=allclos"], "did you mean 'allclose'"),
                         (["accuracy.metric=allclose", "accuracy.atol=-0.5"], "accuracy.atol=-0.5"),
                         (["accuracy.metric=allclose", "+accuracy.outputs.prb.atol=1e-3"], "did you mean 'prob'")):
        with pytest.raises(ConfigError) as e:
            build(farm, "mild", "int8", *extra)
        assert words in e.value.render() and "fix:" in e.value.render() and e.value.exit_code == 2, extra
        if "boom" not in extra[0]:  # found by preflight, before any stage
            with pytest.raises(ConfigError):
                preflight(compose_config(overrides(farm, "mild", "int8", *extra), str(farm["conf"])), str(farm["conf"]))
    assert runs() == before  # bad input: no MLflow run
    np.save(farm["tmp"] / "labels.npy", np.zeros(5, dtype=np.int64))
    np.savez(farm["tmp"] / "val.npz", x=np.random.default_rng(2).standard_normal((8, 3, 16, 16)).astype(np.float32))
    labels = ["accuracy.metric=minority_metric:within_5pct", f"validation.labels={farm['tmp'] / 'labels.npy'}"]
    for extra, words in (([], "validation.data, which is not set"),
                         ([f"validation.data={farm['tmp'] / 'val.npz'}"], "holds 5 labels but validation.data holds 8")):
        with pytest.raises(ConfigError, match=words):
            preflight(compose_config(overrides(farm, "mild", "fp16", *labels, *extra), str(farm["conf"])),
                      str(farm["conf"]))


def test_a_rebuild_that_worsens_the_users_metric_is_refused_naming_it(prefect_harness, farm):
    """fp16 with the user's metric (the minority's relative error, lower is better, passing unless it doubles): the
    model changes into one whose fp16 logits underflow, the rebuild validates (it still passes the function) but its
    score is worse than the registered version's, so the alias stays and the reason names the metric."""
    from flows.rebuild import rebuild_pass

    name = farm["names"]["mild"]
    metric = ["accuracy.metric=minority_metric:relative_error", "accuracy.greater_is_better=false"]
    s = build(farm, "mild", "fp16", *metric)
    assert s["status"] == "ok", s.get("error")
    c = client()
    mv = c.get_model_version_by_alias(name, "sm_86-fp16")
    assert mv.tags["accuracy_metric"] == "minority_metric:relative_error"
    assert float(mv.tags["accuracy_score"]) == pytest.approx(s["accuracy"]["score"])
    make_softmax_classifier(farm["tmp"] / "mild.onnx", underflow=19)  # the same function in fp32 (2^-22 is kept fp32 by the underflow guard)
    r = rebuild_pass(None, experiment=farm["experiment"], log=lambda *_: None)
    failed = [x for x in r["failed"] if x["model"] == name and x["precision"] == "fp16"]
    assert failed and "accuracy.metric=minority_metric:relative_error scores" in failed[0]["reason"], r
    assert "validates worse" in failed[0]["reason"]
    assert c.get_model_version_by_alias(name, "sm_86-fp16").version == mv.version
    worse = c.get_model_version(name, failed[0]["version"])
    assert float(worse.tags["accuracy_score"]) > float(mv.tags["accuracy_score"]) + 0.001
