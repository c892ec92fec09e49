"""Migrated template databases (flows/local/templates.py): a new Prefect home or MLflow store starts from one made by the
library's own code, works as one the library made itself, and nothing already there is ever overwritten. Real MLflow,
a real `prefect server start`."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.local import templates

ROOT = Path(__file__).resolve().parents[2]


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_a_new_mlflow_store_from_the_template_is_a_working_store_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    tpl = templates.make_mlflow()
    assert tpl == templates.template("mlflow") and tpl.is_file()

    store = tmp_path / "team" / "mlflow.db"
    assert templates.seed(store, "mlflow") and sha(store) == sha(tpl)
    before = sha(store)
    assert not templates.seed(store, "mlflow") and sha(store) == before  # never over a store that exists

    uri = f"sqlite:///{store}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from mlflow import MlflowClient

    from flows.tracking import artifact_location, use_experiment

    use_experiment("from-template")
    c = MlflowClient(uri)
    default = c.get_experiment("0")  # created by this store on first use, not carried over from the template's folder
    assert "trtforge-template-" not in default.artifact_location
    exp = c.get_experiment_by_name("from-template")
    assert exp.artifact_location == artifact_location(uri)
    run = c.create_run(exp.experiment_id)
    c.log_metric(run.info.run_id, "cosine_min", 0.999)
    c.set_terminated(run.info.run_id)
    assert c.get_run(run.info.run_id).data.metrics == {"cosine_min": 0.999}


def test_without_a_template_nothing_is_seeded(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    assert not templates.seed(tmp_path / "mlflow.db", "mlflow")
    assert not (tmp_path / "mlflow.db").exists()


PROBE = r"""
import json, os, sys, time
from flows.local import server
t = time.perf_counter(); server.begin(); began = time.perf_counter() - t
db = server.home() / "prefect.db"
seeded = db.is_file() and __import__("hashlib").sha256(db.read_bytes()).hexdigest()
t = time.perf_counter(); url = server.ensure(); waited = time.perf_counter() - t
print("PROBE " + json.dumps({"url": url, "began": began, "waited": waited, "seeded": seeded,
                             "pid": json.loads(server.state_file().read_text())["pid"]}))
"""


@pytest.mark.slow
def test_a_new_prefect_home_starts_from_the_template_and_builds_starting_at_once_share_one_server(tmp_path):
    """Two processes that find no server at once: one server, started from the template; begin() does not wait for
    it (the build's own work runs meanwhile), ensure() does, until it answers."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    made = subprocess.run([sys.executable, "-m", "flows.local.templates"], env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    tpl = Path(env["XDG_CACHE_HOME"]) / "trtforge" / "templates"
    prefect_tpl = next(tpl.glob("prefect-*.db"))

    procs = [subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    res = []
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, out + err
        res.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("PROBE "))[6:]))
    try:
        assert res[0]["url"] == res[1]["url"] and res[0]["pid"] == res[1]["pid"]  # one server
        # the home's database was the template when the server had not even imported Prefect yet
        assert sha(prefect_tpl) in (res[0]["seeded"], res[1]["seeded"])
        starter = min(res, key=lambda r: r["began"])
        assert starter["began"] < 1.0 < starter["waited"], res  # begin() returned at once; ensure() waited
        from flows.local.server import healthy

        assert healthy(res[0]["url"])
    finally:
        import signal

        os.kill(res[0]["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 30
        from flows.local.server import pid_alive

        while pid_alive(res[0]["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
