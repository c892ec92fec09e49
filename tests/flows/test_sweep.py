"""Sweeps: the builds run in parallel build processes and the stages they share are computed once."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_sweep_builds_in_parallel_processes_sharing_export_and_partition(tmp_path, user_config_dir):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "TRTFORGE_JOBS": "2",
           "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run([sys.executable, "-m", "flows.build", "--config-dir", str(user_config_dir), "-m", "model=tiny",
                        "target=sm_80,sm_86", "precision=fp32,fp16", "stages.benchmark=false",
                        f"out_dir={tmp_path / 'out'}", f"cache_dir={tmp_path / 'cache'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    pids = set()
    for t in ("sm_80", "sm_86"):
        for p in ("fp32", "fp16"):
            s = json.loads((tmp_path / "out" / "tiny" / t / p / "summary.json").read_text())
            assert s["status"] == "ok" and (s["target"], s["precision"]) == (t, p)
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        rows = con.execute("SELECT r.status, t.value FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                           "AND t.key = 'trtforge.pid'").fetchall()
    pids = {pid for _, pid in rows}
    assert [st for st, _ in rows] == ["FINISHED"] * 4 and len(pids) == 2  # two build processes
    assert len(list((tmp_path / "cache" / "export").iterdir())) == 1  # shared stages: computed once
    assert len(list((tmp_path / "cache" / "partition").iterdir())) == 1
    assert len(list((tmp_path / "cache" / "build").iterdir())) == 4
