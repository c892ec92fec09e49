"""The stage code is part of every cache key, wherever it lives under tasks/: editing a module of a subject package
rebuilds what it shapes. Real builds of a copy of this checkout (flows/, tasks/, conf/), so the edit touches no file
of the checkout itself."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def build(copy: Path, conf: Path, tmp: Path, summary: str) -> dict:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "PREFECT_HOME": str(tmp / "prefect"),
           "TRTFORGE_DAEMON": "0"}
    r = subprocess.run([sys.executable, "-m", "flows.build", "--config-dir", str(conf), "model=tiny", "precision=fp32",
                        "stages.benchmark=false", f"out_dir={tmp / 'out'}", f"cache_dir={tmp / 'cache'}",
                        f"summary_out={tmp / summary}"], cwd=copy, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads((tmp / summary).read_text())


@pytest.mark.slow
def test_editing_a_module_in_a_subject_package_rebuilds_the_stages(tmp_path, user_config_dir):
    copy = tmp_path / "checkout"
    for d in ("flows", "tasks", "conf"):
        shutil.copytree(REPO / d, copy / d, ignore=shutil.ignore_patterns("__pycache__"))
    code = "import flows.context, sys; print(flows.context.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True, check=True)
    assert where.stdout.strip().startswith(str(copy)), "the copy's modules must be the ones imported"

    first = build(copy, user_config_dir, tmp_path, "first.json")
    again = build(copy, user_config_dir, tmp_path, "again.json")
    assert {s["status"] for s in again["stages"].values()} <= {"cached", "skipped"}, again["stages"]
    assert again["engine"]["sha256"] == first["engine"]["sha256"]

    module = copy / "tasks" / "graph" / "models.py"  # two levels down: tasks/<subject>/<module>.py
    module.write_text(module.read_text() + "\n# an edit that changes no behaviour still changes the code\n")
    edited = build(copy, user_config_dir, tmp_path, "edited.json")
    for stage in ("export", "partition", "build"):
        assert edited["stages"][stage]["status"] == "ok", (stage, edited["stages"][stage])
