"""A build that cannot fit in its memory budget is refused before any heavy stage (tasks/common/memory.py fit_check,
flows/config.py preflight): exit 2 as bad input, no MLflow run, the message naming the model file or profile, the lower
bound, the budget and its source, and the fix. A model whose bound is under the budget is not refused and builds, its
measured peak at or above the bound."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import model_conf
from tests.tasks.graph.test_footprint import chain

REPO = Path(__file__).resolve().parents[2]


def cli(args, tmp: Path, timeout=900):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'cli-mlflow.db'}"}
    return subprocess.run([sys.executable, "-m", "flows.build", *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=timeout)


def sparse_model(tmp: Path, gigabytes: int = 10) -> Path:
    """x[n, 50000] @ w -> y with w in a sparse external data file of ``gigabytes`` GB (no disk, never read)."""
    width = 50_000
    rows = gigabytes * 10**9 // (width * 4)
    t = onnx.TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[width, rows])
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(width * rows * 4))):
        e = t.external_data.add()
        e.key, e.value = k, v
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", rows])
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [t]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, str(tmp / "big.onnx"))
    with open(tmp / "w.bin", "wb") as f:
        os.truncate(f.fileno(), width * rows * 4)
    return tmp / "big.onnx"


def refused(r, tmp: Path, seconds: float) -> str:
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 8, r.stderr
    assert not (tmp / "cli-mlflow.db").exists()  # no run
    assert not list(tmp.glob("outputs/**/*.engine")) and not list(tmp.glob("**/summary.json"))
    assert "export" not in r.stdout and "partition" not in r.stdout  # no stage ran
    assert seconds < 120, seconds  # before any heavy work (the CLI's own start-up is most of it)
    return r.stderr


def test_weights_that_cannot_fit_are_refused_before_they_are_read(tmp_path):
    """2 GB of weights (under protobuf's limit, which a larger model meets first) against a 3 GiB budget: refused from
    the files' sizes, without reading them."""
    conf = model_conf(tmp_path, "big", sparse_model(tmp_path, 2), "x: {min: [1, 50000], opt: [1, 50000], max: [1, 50000]}")
    t0 = time.monotonic()
    r = cli(["--config-dir", str(conf), "model=big", "precision=fp16", "memory_budget_mib=3072"], tmp_path)
    err = refused(r, tmp_path, time.monotonic() - t0)
    assert "model.source: this build needs at least" in err, err
    assert "memory budget of 3072 MiB (memory_budget_mib)" in err
    assert "big.onnx and 1 external data file: 1907 MiB) held 2 times" in err  # 2 * 10**9 bytes
    assert "fix: " in err and "build on a host with more memory" in err  # (memory_budget_mib=N where this host has it)
    assert str(tmp_path / "big.onnx") in err  # the file


def test_a_profile_whose_max_shape_cannot_fit_is_refused_naming_the_profile(tmp_path):
    """A small model whose profile's max shape makes one step take 2 x 3 GiB against a 4 GiB budget."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1024])
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, str(tmp_path / "wide.onnx"))
    conf = model_conf(tmp_path, "wide", tmp_path / "wide.onnx", "x: {min: [1, 1024], opt: [8, 1024], max: [786432, 1024]}")
    t0 = time.monotonic()
    r = cli(["--config-dir", str(conf), "model=wide", "precision=fp16", "memory_budget_mib=4096"], tmp_path)
    err = refused(r, tmp_path, time.monotonic() - t0)
    assert "model.profiles[0]: this build needs at least" in err, err
    assert "6144 MiB for the largest step at the max shapes (x [786432, 1024]): node 'relu'" in err
    assert "memory budget of 4096 MiB (memory_budget_mib)" in err
    assert "lower the max shapes of model.profiles[0]" in err


@pytest.mark.slow
def test_a_model_under_its_bound_is_not_refused_and_builds_above_the_bound(tmp_path):
    """The bound holds on a real build: a 64 MiB MatMul chain passes preflight with a budget just above its bound
    (refused just below it), and built with a budget it fits in, its measured peak is at least the bound."""
    from flows.config import compose_config, preflight
    from tasks.common import ConfigError
    from tasks.common.memory import MIB, Budget

    chain(tmp_path / "chain.onnx", 4, 2048)
    conf = model_conf(tmp_path, "chain", tmp_path / "chain.onnx", "x: {min: [1, 2048], opt: [4, 2048], max: [16, 2048]}")
    cfg = compose_config(["model=chain", "precision=fp16", f"cache_dir={tmp_path / 'cache'}"], str(conf))
    preflight(cfg, str(conf), Budget(1 << 20, "test"))  # the libraries a first preflight imports: held from then on
    bound = preflight(cfg, str(conf), Budget(1 << 20, "test")).memory_estimate.total / MIB
    near = preflight(cfg, str(conf), Budget(int(bound) + 128, "test"))
    assert near.memory_estimate.total / MIB < bound + 128
    assert any("of its memory budget" in w and "may be stopped at the budget" in w for w in near.warnings)
    with pytest.raises(ConfigError, match="this build needs at least"):
        preflight(cfg, str(conf), Budget(int(bound) - 128, "test"))

    r = cli(["--config-dir", str(conf), "model=chain", "precision=fp16", "stages.benchmark=false",
             f"summary_out={tmp_path / 's.json'}", "memory_budget_mib=6000"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["status"] == "ok"
    assert s["memory"]["budget_mib"] == 6000 and "lower bound" in s["memory"]["estimate"]
    assert s["metrics"]["peak_rss_mib"] >= s["memory"]["estimate_mib"] > 2 * 64  # measured >= the bound
