"""The whole flow with real Prefect (test harness), real TensorRT-RTX builds and a real MLflow store."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flows.config import compose_config
from tasks.common.util import sha256_file
from tests.conftest import model_conf

REPO = Path(__file__).resolve().parents[2]


def build(overrides, config_dir, tmp: Path):
    from flows.build import run_build

    cfg = compose_config([f"cache_dir={tmp / 'cache'}", f"out_dir={tmp / 'out'}", f"summary_out={tmp / 'summary.json'}",
                          "benchmark.iterations=3", "benchmark.repeats=2", *overrides], str(config_dir) if config_dir else None)
    return run_build(cfg, str(config_dir) if config_dir else None, show_progress=False)


def mlflow_client():
    from mlflow.tracking import MlflowClient

    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def mlflow_run(run_id):
    return mlflow_client().get_run(run_id)


@pytest.fixture(scope="module")
def tiny_build(prefect_harness, user_config_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    first = build(["model=tiny", "precision=fp32"], user_config_dir, tmp)
    second = build(["model=tiny", "precision=fp32"], user_config_dir, tmp)
    return tmp, first, second


def test_user_model_builds_a_real_engine_with_an_ok_summary(tiny_build):
    tmp, s, _ = tiny_build
    assert s["status"] == "ok", s.get("error")
    assert [s["stages"][k]["status"] for k in ("export", "partition", "build", "calibrate", "validate", "benchmark")] == \
        ["ok", "ok", "ok", "skipped", "ok", "ok"]
    assert "no calibration" in s["stages"]["calibrate"]["reason"]
    eng = Path(s["out_dir"]) / s["engine"]["file"]
    assert eng.stat().st_size == s["engine"]["bytes"] > 10_000
    assert sha256_file(eng) == s["engine"]["sha256"]
    m = s["metrics"]
    assert m["trt_subgraphs"] == 1 and m["fallback_nodes"] == 0
    assert m["ort_p50_ms"] > 0 and m["build_seconds"] > 0
    assert "engine timing needs" in json.loads((Path(s["out_dir"]) / "benchmark.json").read_text())["engine"]["reason"] \
        or m.get("trt_p50_ms")
    written = json.loads((tmp / "summary.json").read_text())  # summary_out
    assert written["engine"] == s["engine"] and written["status"] == "ok"
    published = json.loads((Path(s["out_dir"]) / "summary.json").read_text())  # the contract: out_dir is in the file
    assert published["out_dir"] == written["out_dir"] == s["out_dir"] and Path(s["out_dir"]).is_absolute()


def test_the_summary_says_what_each_number_measured(tiny_build):
    from tasks.trt.backend import host_gpus

    _, s, _ = tiny_build
    m, v = s["metrics"], s["versions"]
    assert m["engine_bytes"] == sum(e["bytes"] for e in s["engines"])  # the shipped files
    assert not any(k.startswith("baseline_") for k in m) and "convert_seconds" not in m  # fp32: nothing converted
    # fp32 on a host without the GPU: the graph TensorRT builds is the fp32 reference itself; ONNX Runtime could only
    # compare it with itself, so no cosine is reported (not a 1.0 counted as a pass), and the verdict says so
    assert "cosine_min" not in m and "emulation_cosine_min" not in m and "engine_cosine_min" not in m
    val = json.loads((Path(s["out_dir"]) / "validation.json").read_text())
    assert val["identical"] and not val["measured"] and "identical graph, not measured" in val["verdict"]
    assert any("identical graph, not measured" in w for w in s["stages"]["validate"]["warnings"])
    import re
    import tensorrt_rtx_bindings
    assert v["backend"] == f"tensorrt_rtx-{tensorrt_rtx_bindings.__version__}"
    assert re.fullmatch(r"\d+\.\d+", v["cuda_runtime"]) and "cuda" not in v
    if not host_gpus():
        assert v["cuda_driver"] == v["driver"] == v["gpu"] == "not present"


def test_the_summary_has_the_peak_resident_memory_of_the_build_and_of_each_stage_and_the_budget(tiny_build):
    from tasks.common.memory import host_total_mib

    _, s, _ = tiny_build
    peaks = {k: e["peak_rss_mib"] for k, e in s["stages"].items() if "peak_rss_mib" in e}
    assert set(peaks) == {"export", "partition", "build", "calibrate", "validate", "benchmark"}  # calibrate: skipped
    assert all(100 < p < host_total_mib() for p in peaks.values()), peaks  # a Python process with its libraries
    assert s["metrics"]["peak_rss_mib"] >= max(peaks.values())
    assert 0 < s["memory"]["budget_mib"] < host_total_mib() and "available" in s["memory"]["budget_source"]


def test_a_budget_below_what_the_build_holds_already_is_refused_before_any_stage(prefect_harness, user_config_dir,
                                                                                 tmp_path):
    """The budget is below what a build's processes take to start with: no stage can run within it, so the build is
    refused as bad input (exit 2) before any stage, naming the budget, the bound and the fix; no MLflow run. (A stage
    that passes the budget while it runs is stopped: tests/tasks/common/test_memory.py.)"""
    from tasks.common import ConfigError

    def runs() -> int:
        c = mlflow_client()
        return len(c.search_runs([x.experiment_id for x in c.search_experiments()]))

    before = runs()
    with pytest.raises(ConfigError) as e:
        build(["model=tiny", "precision=fp32", "memory_budget_mib=256"], user_config_dir, tmp_path)
    assert e.value.exit_code == 2
    text = e.value.render()
    assert "this build needs at least" in text and "memory budget of 256 MiB (memory_budget_mib)" in text, text
    assert "this build's processes held before reading the model" in text and "fix:" in text and "memory_budget_mib=" in e.value.fix
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "out").exists()
    assert runs() == before  # no run


def test_the_run_is_in_mlflow_with_tags_engine_summary_and_config(tiny_build):
    _, s, _ = tiny_build
    client = mlflow_client()
    run = client.get_run(s["mlflow"]["run_id"])
    assert {k: run.data.tags[k] for k in ("model", "target", "precision", "status")} == \
        {"model": "tiny", "target": "sm_86", "precision": "fp32", "status": "ok"}
    assert run.data.params["target.compute_capability"] == "8.6"
    assert "cosine_min" not in run.data.metrics and run.data.metrics["validate_samples"] >= 5  # fp32: identical graph
    assert "version.backend" in run.data.tags
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.yaml", "engine"} <= top
    engines = client.list_artifacts(run.info.run_id, "engine")
    assert [a.path for a in engines] == [f"engine/{s['engine']['file']}"] and engines[0].file_size == s["engine"]["bytes"]


def test_identical_second_build_is_served_from_the_cache(tiny_build):
    _, first, second = tiny_build
    assert second["status"] == "ok"
    for k in ("export", "partition", "build", "validate", "benchmark"):
        assert second["stages"][k]["status"] == "cached", k
    assert second["engine"]["sha256"] == first["engine"]["sha256"]
    import socket
    origin = second["stages"]["benchmark"]["cached_from"]  # up to date: the numbers are the first run's
    assert origin["mlflow_run"] == first["mlflow"]["run_id"] and origin["host"] == socket.gethostname()


@pytest.fixture(scope="module")
def tiny_elsewhere(tiny_build, user_config_dir):
    """The same build into another out_dir: not up to date there, so a new run whose stages all come from the cache."""
    tmp, first, _ = tiny_build
    from flows.build import run_build

    cfg = compose_config([f"cache_dir={tmp / 'cache'}", f"out_dir={tmp / 'out2'}", "benchmark.iterations=3",
                          "benchmark.repeats=2", "model=tiny", "precision=fp32"], str(user_config_dir))
    return first, run_build(cfg, str(user_config_dir), show_progress=False)


def test_cached_stages_say_when_where_and_by_which_run_they_were_measured(tiny_elsewhere):
    import socket

    first, s = tiny_elsewhere
    assert s["mlflow"]["run_id"] != first["mlflow"]["run_id"]
    origin = s["stages"]["benchmark"]["cached_from"]  # stored in the cache entry when it was computed
    assert s["stages"]["benchmark"]["status"] == "cached" and "cached_from" not in first["stages"]["benchmark"]
    assert origin["host"] == socket.gethostname() and origin["at"]
    assert origin["mlflow_run"] == first["mlflow"]["run_id"] and origin["run"].startswith("tiny-sm_86-fp32 (")
    run = mlflow_run(s["mlflow"]["run_id"])
    assert run.data.tags["cached_from.benchmark"] == \
        f"cached from {origin['at']} on {origin['host']} by MLflow run {first['mlflow']['run_id']}"
    assert "cosine_source" not in run.data.tags  # nothing measured it (fp32: the graph is the reference itself)


def test_the_cli_says_what_accuracy_measured_and_where_cached_numbers_come_from(tiny_elsewhere, capsys):
    from flows.cli import print_stage, print_summary

    first, second = tiny_elsewhere
    print_summary(first, 1.0)
    assert "accuracy not measured on" in capsys.readouterr().out  # fp32 here: the graph is the reference itself
    print_stage("benchmark", second["stages"]["benchmark"])
    assert f"cached from {second['stages']['benchmark']['cached_from']['at']}" in capsys.readouterr().out
    print_summary(second, 1.0)
    assert f"by MLflow run {first['mlflow']['run_id']}" in capsys.readouterr().out


def test_fp16_for_sm_89_and_accuracy_budget_failure(prefect_harness, user_config_dir, tmp_path):
    ok = build(["model=tiny", "precision=fp16", "target=sm_89"], user_config_dir, tmp_path)
    assert ok["status"] == "ok" and 0.999 < ok["metrics"]["cosine_min"] < 1.0
    # fp16 that meets the budget in validate pays nothing for the fp16 accuracy search (it runs only after a miss)
    assert "search_runs" not in ok["metrics"] and "fp16_search" not in ok["stages"]["build"]
    assert list(ok["data"]) == ["validation"]  # the search's held-out inputs were not needed: not made, not reported
    # the validate gate itself (the fp16 search off: with it, a budget of 1.0 fails in the build, test_fp16search_flow)
    bad = build(["model=tiny", "precision=fp16", "target=sm_89", "accuracy.min_cosine=1.0", "calibration.search=false"],
                user_config_dir, tmp_path)
    assert bad["status"] == "failed" and bad["stages"]["validate"]["status"] == "failed"
    assert "accuracy.min_cosine=1.0" in bad["stages"]["validate"]["reason"]
    assert bad["stages"]["benchmark"]["status"] == "skipped" and bad["engines"] == []
    run = mlflow_run(bad["mlflow"]["run_id"])
    assert run.data.tags["status"] == "failed" and run.info.status == "FAILED"
    # the earlier good result stays published untouched; the failure is reported beside it
    published = json.loads((tmp_path / "out" / "tiny" / "sm_89" / "fp16" / "summary.json").read_text())
    assert published["status"] == "ok" and published["engine"] == ok["engine"]
    assert json.loads((tmp_path / "out" / "tiny" / "sm_89" / "fp16.failed" / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow
@pytest.mark.parametrize("model, profile", [
    ("ppocr_det", "{x: {min: [1,3,64,64], opt: [1,3,320,320], max: [2,3,480,480]}}"),
    ("ppocr_rec", "{x: {min: [1,3,48,64], opt: [4,3,48,320], max: [8,3,48,480]}}"),
    ("ppocr_cls", "{x: {min: [1,3,48,96], opt: [4,3,48,192], max: [8,3,48,384]}}"),
])
@pytest.mark.parametrize("target", ["sm_86", "sm_89"])
def test_ppocr_models_build_fp16_with_cosine_above_0999(prefect_harness, tmp_path, model, profile, target):
    s = build([f"model={model}", f"target={target}", "precision=fp16", f"model.profiles=[{profile}]",
               "stages.benchmark=false"], None, tmp_path)
    assert s["status"] == "ok", s.get("error")
    assert s["metrics"]["cosine_min"] >= 0.999
    assert "images" in json.loads((Path(s["out_dir"]) / "validation.json").read_text())["inputs"]


@pytest.mark.slow
def test_torch_model_from_a_user_config_dir(prefect_harness, tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "cnn.yaml").write_text(
        "name: cnn\nformat: torch\nfactory: tests.tasks.torch_models:small_cnn\n"
        "inputs:\n  image: {shape: [1, 3, 32, 32], dtype: float32}\n"
        "profiles:\n  - image: {min: [1, 3, 16, 16], opt: [2, 3, 32, 32], max: [4, 3, 64, 64]}\n")
    s = build(["model=cnn", "precision=fp16"], tmp_path / "conf", tmp_path)
    assert s["status"] == "ok", s.get("error")
    assert s["metrics"]["cosine_min"] >= 0.999


# --- the CLI, as users run it ----------------------------------------------------------------------------------

def cli(args, tmp: Path, timeout=600):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'cli-mlflow.db'}"}
    return subprocess.run([sys.executable, "-m", "flows.build", *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, code, words", [
    (["target=sm_99"], 2, "valid targets"),
    (["precison=fp16"], 2, "did you mean 'precision'"),
    (["precision=fp8"], 2, "fp8 needs sm_89"),
    (["target=sm_30"], 2, "not supported"),
    (["model.name=../../evil"], 2, "not a safe name"),
    (["-m", "target=sm_99,sm_98"], 2, "valid targets"),
    (["target=sm_80,sm_86"], 2, "add -m"),
    (["memory_budget_mib=100"], 2, "memory_budget_mib=100 is too small"),
    (["memory_budget_mib=99999999"], 2, "more than this host's memory"),
])
def test_cli_bad_input_exits_nonzero_with_a_short_message_and_no_run(tmp_path, args, code, words):
    r = cli(args, tmp_path)
    assert r.returncode == code, r.stderr
    assert words in r.stderr and "fix:" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 6
    assert not (tmp_path / "cli-mlflow.db").exists()  # no run at all, so none marked as succeeded


def test_cli_bad_input_found_while_exporting_exits_2_with_no_run(tmp_path):
    """A torch factory that cannot be imported is only found by export: still bad input, so exit 2 and no run."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "gone.yaml").write_text(
        "name: gone\nformat: torch\nfactory: no_such_module_here:make\n"
        "inputs:\n  image: {shape: [1, 3, 32, 32], dtype: float32}\n")
    r = cli(["--config-dir", str(tmp_path / "conf"), "model=gone", "precision=fp32"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "model.factory='no_such_module_here:make'" in r.stderr and "fix:" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 6
    assert not (tmp_path / "cli-mlflow.db").exists()  # no run
    assert not list(tmp_path.glob("out/**/summary.json")) and not list(tmp_path.glob("out/**/*.engine"))  # nothing published


@pytest.mark.slow
def test_cli_sweep_builds_each_combination(tmp_path, user_config_dir):
    r = cli(["--config-dir", str(user_config_dir), "-m", "model=tiny", "target=sm_80,sm_86", "precision=fp32",
             "stages.benchmark=false", f"out_dir={tmp_path / 'out'}", f"cache_dir={tmp_path / 'cache'}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    for t in ("sm_80", "sm_86"):
        s = json.loads((tmp_path / "out" / "tiny" / t / "fp32" / "summary.json").read_text())
        assert s["status"] == "ok" and s["target"] == t
    assert "cudaError" not in r.stdout + r.stderr


@pytest.fixture(scope="module")
def hybrid_conf(tmp_path_factory, hybrid_onnx):
    d = tmp_path_factory.mktemp("hybridconf")
    (d / "model").mkdir()
    (d / "model" / "hybrid.yaml").write_text(
        f"name: hybrid\nsource: {hybrid_onnx}\n"
        "profiles:\n  - x: {min: [1, 3, 8, 8], opt: [2, 3, 16, 16], max: [4, 3, 32, 32]}\n")
    return d


@pytest.mark.parametrize("precision, min_cos", [("fp32", 0.9999), ("fp16", 0.999)])
def test_hybrid_model_builds_one_engine_per_tensorrt_subgraph(prefect_harness, hybrid_conf, tmp_path, precision, min_cos):
    s = build(["model=hybrid", f"precision={precision}"], hybrid_conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    m = s["metrics"]
    assert m["trt_subgraphs"] == 3 and m["fallback_nodes"] == 2
    assert len(s["engines"]) == 3 and s["engine"] == s["engines"][0]
    assert [e["file"] for e in s["engines"]] == [f"hybrid.sm_86.{precision}.sg{i}.engine" for i in (0, 2, 4)]
    for e in s["engines"]:
        f = Path(s["out_dir"]) / e["file"]
        assert f.stat().st_size == e["bytes"] and sha256_file(f) == e["sha256"]
    if precision == "fp32":  # every TensorRT segment's graph is the fp32 segment itself: nothing measured, said
        assert "cosine_min" not in m and "identical graph, not measured" in s["verdict"]
    else:
        assert m["cosine_min"] >= min_cos
    report = json.loads((Path(s["out_dir"]) / "partition.json").read_text())
    assert {f["op"] for f in report["fallback_nodes"]} == {"FastGelu", "QuickGelu"}
    assert (Path(s["out_dir"]) / "partition.png").is_file()
    client = mlflow_client()
    assert len(client.list_artifacts(s["mlflow"]["run_id"], "engine")) == 3
    assert "reports/partition.png" in {a.path for a in client.list_artifacts(s["mlflow"]["run_id"], "reports")}


def test_numbers_of_stages_that_did_not_run_are_absent_not_zero(prefect_harness, hybrid_conf, tmp_path):
    s = build(["model=hybrid", "partition.strict=true"], hybrid_conf, tmp_path)
    assert s["status"] == "failed" and s["stages"]["partition"]["status"] == "failed"
    assert not {"trt_subgraphs", "fallback_nodes", "engine_bytes", "build_seconds", "cosine_min"} & set(s["metrics"])
    run = mlflow_run(s["mlflow"]["run_id"])
    assert "trt_subgraphs" not in run.data.metrics and "engine_bytes" not in run.data.metrics


@pytest.fixture(scope="module")
def tiny_calibration(tmp_path_factory):
    import numpy as np

    d = tmp_path_factory.mktemp("caldata")
    rng = np.random.default_rng(3)
    np.savez(d / "cal.npz", x=rng.standard_normal((12, 1, 3, 16, 16)).astype(np.float32))  # 12 samples, one file
    return d / "cal.npz"


def test_int8_from_calibration_data_is_quantized_validated_and_cached_across_targets(
        prefect_harness, user_config_dir, tiny_calibration, tmp_path):
    args = ["model=tiny", "precision=int8", f"calibration.data={tiny_calibration}", "calibration.method=minmax",
            "accuracy.min_cosine=0.98"]
    s = build([*args, "target=sm_86"], user_config_dir, tmp_path)
    assert s["status"] == "ok", s.get("error")
    m = s["metrics"]
    assert m["quantized_layers"] + m["fallback_layers"] == 2 and m["quantized_layers"] >= 1
    assert m["cosine_min"] >= 0.98
    assert s["engine"]["file"] == "tiny.sm_86.int8.engine" and s["stages"]["calibrate"]["status"] == "ok"
    # engine_bytes/build_seconds are the shipped int8 engine's; no fp16 baseline engine is built on a host without a
    # GPU to time int8 against it (build: skipped, saying so), so no baseline_* figure
    assert m["engine_bytes"] == s["engine"]["bytes"] and m["build_seconds"] > 0
    assert not any(k.startswith("baseline_") for k in m), m
    b = s["stages"]["build"]
    assert b["status"] == "skipped" and "built in calibrate" in b["reason"] and "time int8" in b["reason"], b
    assert m["cosine_source"].startswith("onnxruntime emulation of int8 (int8 layers as TensorRT's fused int8 kernels")
    v = json.loads((Path(s["out_dir"]) / "validation.json").read_text())
    assert v["inputs"].startswith("samples held out for validation of calibration.data") and v["samples"] == 3
    assert "needs a GPU" in json.loads((Path(s["out_dir"]) / "benchmark.json").read_text())["quantized_vs_baseline"]
    # 12 samples: a quarter held out for validation, a quarter for the accuracy search, the rest calibrates
    cal, search, val = s["data"]["calibration"], s["data"]["search"], s["data"]["validation"]
    assert (cal["samples"], search["samples"], val["samples"]) == (6, 3, 3) and cal["kind"] == "file"
    assert cal["shapes"] == [{"shape": {"x": [1, 3, 16, 16]}, "feeds": 6}] and cal["files"][0]["file"] == "cal.npz"
    # the search judges its 3 held-out samples and (up to 8 of) the calibration samples
    assert "held out for the accuracy search" in search["source"] and m["search_samples"] == 3 + 6
    assert m["calibration_samples"] == 6
    # the margin derived from the search's rule: 3 held-out of 9 judged samples, the candidates a search on 2 layers
    # may judge, 3 validation samples (tasks/accuracy/budget.py)
    from tasks.accuracy.budget import derived_margin
    from tasks.search.judging import JUDGE_Z
    from tasks.search.restore import planned_judgements
    assert m["search_candidates"] == planned_judgements(2)
    assert m["search_margin"] == pytest.approx(derived_margin(3, 9, planned_judgements(2), 3, JUDGE_Z))
    assert m["search_target"] == pytest.approx(0.98 + 0.02 * m["search_margin"])
    run = mlflow_run(s["mlflow"]["run_id"])
    assert run.data.tags["validation.data"].startswith("3 samples: samples held out for validation")
    # the precision boundaries beside the FLOPs shares: at least the graph's fp32 input and output cross into and out
    # of int8; estimated on the TensorRT network (no GPU here), said in summary.json, MLflow and the report
    assert m["reformat_layers"] == m["network_reformat_layers"] >= 2 and m["reformat_bytes"] > 0, m
    assert m["reformat_source"].startswith("estimate on the TensorRT network") and "no NVIDIA GPU" in m["reformat_source"]
    assert run.data.metrics["reformat_layers"] == m["reformat_layers"] and run.data.tags["reformat_source"]
    assert "precision boundaries (each a reformat on the GPU)" in (Path(s["out_dir"]) / "report.html").read_text()
    # another target: the Q/DQ graph comes from the cache, only the engine is built
    s2 = build([*args, "target=sm_89"], user_config_dir, tmp_path)
    assert s2["status"] == "ok" and "partly from the cache" in s2["stages"]["calibrate"]["reason"]
    # the same build again: calibrate and build are served from the cache
    s3 = build([*args, "target=sm_89"], user_config_dir, tmp_path)
    assert s3["stages"]["calibrate"]["status"] == "cached" and s3["stages"]["build"]["status"] == "skipped"
    assert s3["engine"]["sha256"] == s2["engine"]["sha256"]


def test_the_cli_ends_when_an_int8_build_is_done(user_config_dir, tiny_calibration, tmp_path):
    """An int8 build with an accuracy budget runs its calibration two pages at a time (tasks.onnxrt.ort.ordered_runs):
    the CLI still ends as soon as the build is published (it joins every thread that is not a daemon before it exits; a
    thread pool's workers held it up forever)."""
    r = cli(["--config-dir", str(user_config_dir), "model=tiny", "precision=int8", "target=sm_86",
             f"calibration.data={tiny_calibration}", "accuracy.min_cosine=0.98", "stages.benchmark=false",
             f"out_dir={tmp_path / 'out'}",
             f"cache_dir={tmp_path / 'cache'}"], tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path / "out" / "tiny" / "sm_86" / "int8" / "summary.json").read_text())
    assert s["status"] == "ok" and s["stages"]["calibrate"]["status"] == "ok"


@pytest.mark.slow
def test_ppocr_det_int8_meets_the_budget_with_most_layers_int8_and_rebuilds_from_cache(prefect_harness, tmp_path):
    """The int8 bar: calibration on text images, accuracy.min_cosine=0.99 met with at least 70% of the conv FLOPs int8;
    an identical second build is served from the cache in at most a quarter of the time."""
    import time

    args = ["model=ppocr_det", "precision=int8", "accuracy.min_cosine=0.99", "calibration.samples=8",
            "model.profiles=[{x: {min: [1,3,64,64], opt: [1,3,480,480], max: [2,3,800,800]}}]"]
    t0 = time.perf_counter()
    s = build(args, None, tmp_path)
    first = time.perf_counter() - t0
    assert s["status"] == "ok", s.get("error")
    m = s["metrics"]
    assert m["cosine_min"] >= 0.99
    assert m["quantized_layers"] + m["fallback_layers"] == 72  # 62 Conv, 2 ConvTranspose, 8 residual Adds
    assert set(m["flops_share"]) == {"fp32", "fp16", "int8", "fp8"} and m["flops_share"]["fp32"] <= 0.05, m
    # the search restores the most harmful layers per FLOP: few FLOPs in many small layers. Its margin is derived from
    # the few held-out pages here (docs/accuracy.md, the search's rule: above a fixed 0.5), and keeps 73.0% of the conv
    # FLOPs int8 (measured; 81.7% at budget_margin=0.5)
    assert m["search_margin"] > 0.5 and m["conv_int8_share"] >= 0.7, m
    out = Path(s["out_dir"])
    sens = json.loads((out / "sensitivity.json").read_text())
    assert len(sens["layers"]) == 72 and (out / "sensitivity.png").is_file()
    # the report names what holds the int8 share back: the kept layer with the most FLOPs first
    kept = max((r for r in sens["layers"] if r["kept_high_precision"]), key=lambda r: r["flops"])
    report = (out / "report.html").read_text()
    assert "of the Conv/MatMul/Gemm FLOPs are quantized" in report and kept["node"] in report.split("hold the most back")[1]
    assert (out / "precision_profile.json").is_file() and (out / "precision_profile.png").is_file()
    t0 = time.perf_counter()
    again = build(args, None, tmp_path)
    second = time.perf_counter() - t0
    assert again["stages"]["calibrate"]["status"] == "cached" and again["stages"]["build"]["status"] == "skipped"
    assert again["engine"]["sha256"] == s["engine"]["sha256"]
    assert second <= first / 4, (first, second)


def test_hybrid_int8_quantizes_inside_the_tensorrt_subgraphs(prefect_harness, hybrid_conf, tiny_calibration, tmp_path):
    s = build(["model=hybrid", "precision=int8", f"calibration.data={tiny_calibration}", "calibration.method=minmax",
               "accuracy.min_cosine=0.98", "stages.benchmark=false"], hybrid_conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    m = s["metrics"]
    assert m["trt_subgraphs"] == 3 and len(s["engines"]) == 3
    assert m["quantized_layers"] + m["fallback_layers"] == 6 and m["quantized_layers"] >= 3
    assert m["cosine_min"] >= 0.98
    assert [e["file"] for e in s["engines"]] == [f"hybrid.sm_86.int8.sg{i}.engine" for i in (0, 2, 4)]


def _gpu_target():
    from tasks.trt.backend import gpu_for

    return next((f"sm_{cc.replace('.', '')}" for cc in ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1") if gpu_for(cc)), None)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_target() is None, reason="no NVIDIA GPU of a TensorRT-RTX compute capability on this host")
def test_on_a_supported_gpu_the_engines_are_validated_and_timed(prefect_harness, hybrid_conf, tiny_calibration, tmp_path):
    target = _gpu_target()
    s = build(["model=hybrid", f"target={target}", "precision=int8", f"calibration.data={tiny_calibration}",
               "calibration.method=minmax", "accuracy.min_cosine=0.98"], hybrid_conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    v = json.loads((Path(s["out_dir"]) / "validation.json").read_text())
    assert v["engine"]["status"] == "ok" and v["engine"]["cosine_min"] >= 0.98
    m = s["metrics"]  # the gate judged the engine, and says so; the emulation's number is kept apart
    assert m["cosine_source"].startswith("engine on ") and m["cosine_min"] == m["engine_cosine_min"]
    assert "emulation_cosine_min" in m and s["versions"]["cuda_driver"] != "not present"
    b = json.loads((Path(s["out_dir"]) / "benchmark.json").read_text())
    assert b["engine"]["p50_ms"] > 0 and m["trt_p50_ms"] > 0  # composed hybrid: host wall clock, says so
    assert b["engine"]["timer"].startswith("host wall clock")
    assert list((tmp_path / "cache" / "runtime-cache" / target).glob("*.bin"))  # TensorRT-RTX kernels kept


def test_two_input_encoder_validates_on_shapes_where_both_inputs_agree(prefect_harness, two_input_conf, tmp_path):
    """input_ids and attention_mask have distinct dim names but are tied by the graph, so drawing them apart (e.g.
    [14, 85] and [9, 40]) fails: every drawn shape agrees, the build is ok, and summary.json says what validated."""
    s = build(["model=encoder", "precision=fp16", "validation.samples=6", "stages.benchmark=false"], two_input_conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    feeds = json.loads((Path(s["out_dir"]) / "validation.json").read_text())["feeds"]
    assert len(feeds) >= 7 and all(f["input_ids"] == f["attention_mask"] for f in feeds)
    assert len({tuple(f["input_ids"]) for f in feeds}) >= 5
    assert s["metrics"]["cosine_min"] >= 0.99
    data = s["data"]["validation"]
    assert data["kind"] == "random" and data["feeds"] == len(feeds) and data["samples"] >= len(feeds)
    assert "random inputs inside the profiles" in s["verdict"]  # thin evidence, said where a user reads it
    client = mlflow_client()
    assert "random" in client.get_run(s["mlflow"]["run_id"]).data.tags["validation.data"]


@pytest.fixture(scope="module")
def mel_conf(tmp_path_factory):
    """A mel-spectrogram-like front end and audio at the 16-bit scale its package feeds it."""
    from tests.conftest import audio_16bit, make_audio_power_model

    d = tmp_path_factory.mktemp("melconf")
    (d / "model").mkdir()
    make_audio_power_model(d / "mel.onnx")
    np.savez(d / "audio.npz", x=audio_16bit(16, seed=3))  # 16 clips, samples along axis 0
    (d / "model" / "mel.yaml").write_text(
        f"name: mel\nsource: {d / 'mel.onnx'}\n"
        "profiles:\n  - x: {min: [1, 1, 256], opt: [4, 1, 256], max: [8, 1, 256]}\n")
    return d


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_values_beyond_fp16s_range_on_the_users_data_stay_fp32(prefect_harness, mel_conf, tmp_path, precision):
    """fp16 passed on random inputs in [0, 1) and int8 failed with 'the fp16 graph without any Q/DQ already gives
    cosine 0' on real-scale audio. Judged on the data the user gave, the overflowing nodes stay fp32 (also in int8's
    float remainder), the fp16 build is validated on that data, and the emulation rounds fp16 as TensorRT stores it."""
    s = build(["model=mel", f"precision={precision}", f"calibration.data={mel_conf / 'audio.npz'}",
               "stages.benchmark=false"], mel_conf, tmp_path)
    assert s["status"] == "ok", s.get("error")
    assert s["metrics"]["cosine_min"] >= 0.99 and "audio.npz" in s["data"]["validation"]["source"]
    assert s["metrics"]["flops_share"]["fp32"] > 0  # the filter bank and the power in fp32
    if precision == "fp16":
        assert any("kept in fp32: their values exceed fp16's safe range" in w for w in s["stages"]["build"]["warnings"])
    else:
        q = json.loads((Path(s["out_dir"]) / "sensitivity.json").read_text())
        assert q["segments"][0]["fp32_by_data_range"]


def make_topk_model(path: Path) -> Path:
    """Conv -> Relu -> Flatten -> TopK(k=5000) -> Mul: TensorRT parses the TopK but its builder refuses K > 3840
    (an API usage error at build time, not a parser verdict, nor control flow)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([5000], np.int64), "k"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"], axis=1),
             helper.make_node("TopK", ["f", "k"], ["v", "i"], axis=1), helper.make_node("Mul", ["v", "two"], ["y"])]
    g = helper.make_graph(nodes, "topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 32, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5000])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_a_segment_the_builder_refuses_falls_back_to_onnx_runtime(prefect_harness, tmp_path):
    """Any builder failure, not only control flow: the failing node is found by bisecting the segment (real TensorRT-RTX
    builds), runs in ONNX Runtime, the rest is rebuilt, and partition.json and the note say which node and why;
    partition.strict=true fails with the builder's words instead."""
    d = model_conf(tmp_path, "topk", make_topk_model(tmp_path / "topk.onnx"),
                   "x: {min: [1, 3, 32, 32], opt: [2, 3, 32, 32], max: [4, 3, 32, 32]}")
    s = build(["model=topk", "precision=fp16", "stages.benchmark=false"], d, tmp_path / "a")
    assert s["status"] == "ok", s.get("error")
    note = s["stages"]["partition"]["note"]
    assert "TopK" in note and "K exceeds the maximum value allowed (3840)" in note
    plan = json.loads((Path(s["out_dir"]) / "partition.json").read_text())
    native = {f["op"]: f["reason"] for f in plan["fallback_nodes"]}
    assert "bisecting the segment" in native["TopK"]
    assert all("min_subgraph_size" in why for op, why in native.items() if op != "TopK")  # the Mul after it, alone
    assert s["metrics"]["trt_subgraphs"] >= 1 and s["metrics"]["cosine_min"] > 0.999
    strict = build(["model=topk", "precision=fp16", "stages.benchmark=false", "partition.build_fallback=false"], d,
                   tmp_path / "b")
    assert strict["status"] == "failed" and "3840" in strict["error"]


def test_the_stage_table_runs_the_schema_stages_and_names_config_keys():
    """One row per stage of tasks/schema.py, in order; every config key a cache key holds is a key of the config."""
    from omegaconf import OmegaConf

    from flows.stages import TABLE
    from tasks.schema import STAGES

    assert tuple(TABLE) == STAGES and all(callable(s.run) for s in TABLE.values())
    cfg = compose_config([])
    missing = [key for s in TABLE.values() for keys in s.keys.values() for key in keys.values()
               if OmegaConf.select(cfg, key, default="<absent>") == "<absent>"]
    assert not missing, missing
