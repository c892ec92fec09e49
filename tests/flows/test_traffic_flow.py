"""Profiles from traffic, end to end with the default det model: the CLI proposes them (and writes them into a model
YAML), a build uses them, validates on the traffic's own shapes, and reports the coverage; a bad record exits 2
before any run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.traffic_data import document_traffic
from tests.flows.test_build_flow import build, cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> Path:
    return document_traffic(tmp_path_factory.mktemp("traffic") / "requests.jsonl")


def profiles_cli(args, cwd: Path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'cli-mlflow.db'}"}
    return subprocess.run([sys.executable, "-m", "flows.profiles", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_cli_proposes_profiles_and_writes_them_into_the_model_yaml(record, tmp_path):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    y = tmp_path / "conf" / "model" / "det.yaml"
    y.write_text((REPO / "conf" / "model" / "ppocr_det.yaml").read_text().replace("name: ppocr_det", "name: det"))
    r = profiles_cli(["--config-dir", str(tmp_path / "conf"), "model=det", f"traffic.source={record}",
                      f"profiles_out={tmp_path / 'p.json'}", "--write"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "p.json").read_text())
    assert out["requests"] == 20_009 and out["coverage"] >= 0.999 and out["outliers"]
    assert "why:" in r.stdout and "profiles:" in r.stdout
    import yaml

    doc = yaml.safe_load(y.read_text())
    assert doc["profiles"] == out["profiles"] and doc["shape_multiple"] == {"x": [1, 1, 32, 32]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": [1, 3, 720, 1280]}\n')  # camera pixels, not the stride-32 shapes the model is fed
    r = profiles_cli(["--config-dir", str(tmp_path / "conf"), "model=det", f"traffic.source={bad}"], tmp_path)
    assert r.returncode == 2 and "no multiple of 32" in r.stderr and "fix:" in r.stderr


def test_a_bad_traffic_record_stops_the_build_before_any_run(record, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": [1, 3, 640]}\n')
    r = cli(["model=ppocr_det", "precision=fp16", f"model.traffic.source={bad}", "model.profiles=[]"], tmp_path)
    assert r.returncode == 2 and "rank 3" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "cli-mlflow.db").exists()


@pytest.mark.slow
def test_a_build_uses_the_traffic_profiles_and_validates_on_its_shapes(prefect_harness, record, tmp_path):
    s = build(["model=ppocr_det", "precision=fp16", f"model.traffic.source={record}", "model.profiles=[]",
               "stages.benchmark=false", "build.optimization_level=1"], None, tmp_path)
    assert s["status"] == "ok", s.get("error")
    t = s["traffic"]
    assert s["metrics"]["traffic_coverage"] == t["coverage"] >= 0.999 and sum(t["per_profile"]) <= t["requests"]
    seen = {tuple(json.loads(line)["x"]) for line in record.read_text().splitlines()}
    shapes = [tuple(f["x"]) for f in json.loads((Path(s["out_dir"]) / "validation.json").read_text())["feeds"]]
    assert len(shapes) >= 8 and all(x in seen for x in shapes)  # the traffic's own shapes (opt shapes are requests)
    assert len({x[0] for x in shapes}) > 1  # every profile's batch: 1, 2 and 4
    report = (Path(s["out_dir"]) / "report.html").read_text()
    assert "<h2>Traffic</h2>" in report and (Path(s["out_dir"]) / "traffic.png").stat().st_size > 10_000
