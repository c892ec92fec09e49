"""The MLflow run tells the truth about the build: it spans it, opens in the model-training view, is ok and FINISHED
only once the engine is published and its registry version exists, a retried tracking step registers nothing twice,
and a run left RUNNING by a killed build is ended by the next build on any host. Real MLflow (SQLite), real builds."""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from flows.config import compose_config


def build(conf: Path, tmp: Path, experiment: str, *overrides: str, started: float | None = None):
    from flows.build import run_build

    ov = ["model=tiny", "precision=fp32", "stages.benchmark=false", f"experiment={experiment}",
          f"out_dir={tmp / 'out'}", f"cache_dir={tmp / 'cache'}", *overrides]
    return run_build(compose_config(ov, str(conf)), str(conf), show_progress=False, overrides=ov, started=started)


def client():
    from mlflow import MlflowClient

    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def test_the_run_spans_the_build_and_opens_in_the_model_training_view(prefect_harness, user_config_dir, tmp_path):
    exp = f"span-{uuid.uuid4().hex[:8]}"
    t0 = time.time()
    s = build(user_config_dir, tmp_path, exp, started=t0)
    wall = time.time() - t0
    assert s["status"] == "ok", s.get("error")
    run = client().get_run(s["mlflow"]["run_id"])
    assert run.info.start_time == int(t0 * 1000) and run.info.status == "FINISHED"
    duration = (run.info.end_time - run.info.start_time) / 1000
    assert 0.9 * wall <= duration <= wall, (duration, wall)  # the build's own time, not the 0.3 s of logging
    assert client().get_experiment_by_name(exp).tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["status"] == "ok" and json.loads(run.data.tags["registry"])["version"] >= 1


def test_a_failing_registry_call_leaves_no_ok_run_and_publishes_nothing(prefect_harness, user_config_dir, tmp_path,
                                                                          monkeypatch):
    exp = f"reg-{uuid.uuid4().hex[:8]}"
    (tmp_path / "a-file").write_text("a file where the registry's folder would be")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", f"sqlite:///{tmp_path / 'a-file' / 'registry.db'}")  # fails for real
    with pytest.raises(Exception):
        build(user_config_dir, tmp_path, exp)
    c = client()
    runs = c.search_runs([c.get_experiment_by_name(exp).experiment_id])
    assert len(runs) == 1  # the task's retries continued one run, not three
    r = runs[0]
    assert r.info.status == "FAILED" and r.data.tags["status"] == "failed" and "tracking failed" in r.data.tags["failure"]
    assert not (tmp_path / "out" / "tiny" / "sm_86" / "fp32").exists()  # nothing half-written published
    monkeypatch.delenv("MLFLOW_REGISTRY_URI")
    s = build(user_config_dir, tmp_path, exp)  # the store works again: the next build is whole
    assert s["status"] == "ok" and c.get_run(s["mlflow"]["run_id"]).data.tags["status"] == "ok"


def test_a_retried_tracking_step_registers_one_version_per_run(prefect_harness, user_config_dir, tmp_path):
    from flows.registry import register_engines

    exp = f"retry-{uuid.uuid4().hex[:8]}"
    s = build(user_config_dir, tmp_path, exp)
    c = client()
    run = c.get_run(s["mlflow"]["run_id"])
    again = register_engines(c, run, s, s["cache_key"], s["versions"]["backend"])  # what a retry does
    assert again["version"] == s["mlflow"]["registry"]["version"]
    assert len(c.search_model_versions(f"name = 'tiny' and run_id = '{run.info.run_id}'")) == 1


def test_a_run_left_running_by_a_killed_build_is_ended_by_the_next_build_on_any_host(prefect_harness, user_config_dir,
                                                                                     tmp_path):
    from flows.tracking import LEASE_SECONDS, end_orphans, use_experiment

    exp = f"orphan-{uuid.uuid4().hex[:8]}"
    use_experiment(exp)
    c = client()
    eid = c.get_experiment_by_name(exp).experiment_id
    old = int((time.time() - LEASE_SECONDS - 60) * 1000)
    elsewhere = c.create_run(eid, start_time=old, tags={"trtforge.host": "another-host", "trtforge.pid": "1",
                                                        "trtforge.heartbeat": str(old)}).info.run_id
    alive = c.create_run(eid, tags={"trtforge.host": "another-host", "trtforge.pid": "1",
                                    "trtforge.heartbeat": str(int(time.time() * 1000))}).info.run_id
    dead_here = c.create_run(eid, tags={"trtforge.host": socket.gethostname(), "trtforge.pid": "999999",
                                        "trtforge.heartbeat": str(int(time.time() * 1000))}).info.run_id
    assert set(end_orphans(eid)) == {elsewhere, dead_here}
    assert c.get_run(elsewhere).info.status == "FAILED" and "another-host" in c.get_run(elsewhere).data.tags["failure"]
    assert c.get_run(alive).info.status == "RUNNING"  # another host's build still reporting: left alone
    c.set_terminated(alive)


WARM = r"""
import json, sys, threading
from flows.local import tracker
from flows.tracking import warm
warm(prefect=True, mlflow=not tracker.start())  # as a build starts them
next(t for t in threading.enumerate() if t.name == "trtforge-warm").join(120)
out = {m: m in sys.modules for m in ("prefect.flow_engine", "prefect.task_engine", "mlflow")}
out["tracker"] = tracker.running()
if tracker.running():  # a call is answered once the tracker has loaded MLflow (and opened the store when it exists)
    try:
        tracker._tracker.call("nothing", {})
    except ValueError as e:
        out["tracker_answers"] = "serves" in str(e)
print("WARM " + json.dumps(out))
"""


@pytest.mark.parametrize("aside", [True, False], ids=["tracker", "in-process"])
def test_warm_loads_prefect_and_mlflow_and_opens_the_store_in_the_background(tmp_path, aside):
    """What a build needs from Prefect and MLflow loads beside its preflight and the server's start (a build then
    only waits for what is not done yet): Prefect in a thread, MLflow in the build's tracker process (or, with
    TRTFORGE_TRACKER=0, in the thread too: the build's process then imports it); an existing store is opened, and a
    new one is left to the build's run (a build stopped by bad input leaves no file behind)."""
    import subprocess
    import sys

    store = tmp_path / "mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}", "PREFECT_API_URL": "http://127.0.0.1:9/api",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TRTFORGE_TRACKER": "1" if aside else "0"}
    p = subprocess.run([sys.executable, "-c", WARM], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    loaded = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("WARM "))[5:])
    want = {"prefect.flow_engine": True, "prefect.task_engine": True, "mlflow": not aside, "tracker": aside}
    assert loaded == ({**want, "tracker_answers": True} if aside else want)
    assert not store.exists()
