"""The build's tracker process (flows/local/tracker.py): MLflow loads beside the build, which sends it its two calls."""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from flows.local import tracker


@pytest.fixture()
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from flows.tracking import client, use_experiment

    use_experiment("tracker-test")
    c = client()
    exp = c.get_experiment_by_name("tracker-test")
    return c, exp.experiment_id


def _running_run(c, exp_id) -> str:
    return c.create_run(exp_id, tags={"trtforge.build_id": uuid.uuid4().hex}).info.run_id


def test_the_tracker_ends_a_run_in_its_own_process_and_serves_nothing_else(store, monkeypatch):
    c, exp_id = store
    t = tracker.Tracker()
    assert t.start()
    try:
        monkeypatch.setattr(tracker, "_tracker", t)
        rid = _running_run(c, exp_id)
        tracker.call("end_run", run_id=rid, ok=True)  # served by the child (it is running and stays so)
        assert t.running()
        run = c.get_run(rid)
        assert run.info.status == "FINISHED" and run.data.tags["status"] == "ok"
        # anything but its two calls is refused by the child, which keeps serving
        with pytest.raises(ValueError, match="serves"):
            t.call("use_experiment", {"name": "x"})
        with pytest.raises(AssertionError):
            tracker.call("use_experiment", name="x")
        rid2 = _running_run(c, exp_id)
        tracker.call("end_run", run_id=rid2, ok=False, failure="published result missing")
        run = c.get_run(rid2)
        assert run.info.status == "FAILED" and run.data.tags["failure"] == "published result missing"
    finally:
        t.stop()
    assert t.proc is None


def test_a_tracker_that_died_leaves_the_call_to_the_build(store, monkeypatch):
    c, exp_id = store
    t = tracker.Tracker()
    assert t.start()
    monkeypatch.setattr(tracker, "_tracker", t)
    t.proc.kill()
    t.proc.wait()
    rid = _running_run(c, exp_id)
    tracker.call("end_run", run_id=rid, ok=True)
    assert c.get_run(rid).info.status == "FINISHED"


def test_the_tracker_ends_with_the_build_that_started_it(tmp_path):
    """A CLI build's tracker is gone once the command returns (it reads EOF, or dies with its parent)."""
    import subprocess
    import sys

    mark = uuid.uuid4().hex
    env = {**os.environ, "TRTFORGE_TEST_MARK": mark, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"}
    code = ("import os, sys; from flows.local import tracker; assert tracker.start(); "
            "print(tracker._tracker.proc.pid, flush=True); os._exit(0)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[0])
    deadline = time.time() + 30
    while _carries(pid, mark) and time.time() < deadline:
        time.sleep(0.2)
    assert not _carries(pid, mark), "the tracker outlived the build that started it"


def _carries(pid: int, mark: str) -> bool:
    """Whether process `pid` runs with `mark` in its environment (a zombie or a gone process does not)."""
    try:
        return mark.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
