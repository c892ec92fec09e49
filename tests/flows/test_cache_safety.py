"""The cache and the published result under concurrency and kills: real `python -m flows.build` processes."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cache import StageCache, remove_dead_temps, temp_name
from tasks.common.util import StageResult


def start(tmp: Path, conf: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "PREFECT_HOME": str(tmp / "prefect")}
    return subprocess.Popen([sys.executable, "-m", "flows.build", "--config-dir", str(conf), "model=tiny",
                             "precision=fp32", "stages.benchmark=false", f"out_dir={tmp / 'out'}",
                             f"cache_dir={tmp / 'cache'}", *extra], cwd=tmp, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def runs(tmp: Path) -> list[tuple[str, str | None]]:
    """(MLflow status, status tag) of every run in the test's store."""
    with sqlite3.connect(tmp / "mlflow.db") as con:
        return con.execute("SELECT r.status, t.value FROM runs r LEFT JOIN tags t "
                           "ON t.run_uuid = r.run_uuid AND t.key = 'status'").fetchall()


def test_a_second_identical_stage_waits_for_the_first_and_reuses_its_entry(tmp_path):
    import threading

    cache, calls = StageCache(tmp_path), []

    def work(d: Path) -> StageResult:
        calls.append(d)
        time.sleep(0.5)
        (d / "out.bin").write_bytes(b"x" * 100)
        return StageResult(files={"out": d / "out.bin"})

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.run("s", "k", work))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({str(r.files["out"]) for r in results}) == 1
    # an entry whose file no longer matches its hash is not served
    (cache.entry("s", "k") / "out.bin").write_bytes(b"tampered")
    assert cache.get("s", "k") is None
    # temp folders of dead processes are swept, live ones kept
    dead = tmp_path / "t" / f"x.tmp-{2 ** 22 + 7}-abc"
    live = tmp_path / "t" / temp_name("y")
    dead.mkdir(parents=True), live.mkdir()
    assert remove_dead_temps(tmp_path / "t") == [dead] and live.is_dir()


@pytest.mark.slow
def test_four_identical_builds_started_together_all_succeed_with_one_engine_built_once(tmp_path, user_config_dir):
    procs = [start(tmp_path, user_config_dir) for _ in range(4)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert sum("up to date" in o for o in outs) == 3, outs
    assert len(list((tmp_path / "cache" / "build").iterdir())) == 1  # one engine entry: computed once
    assert runs(tmp_path) == [("FINISHED", "ok")]
    s = json.loads((tmp_path / "out" / "tiny" / "sm_86" / "fp32" / "summary.json").read_text())
    assert s["status"] == "ok"


@pytest.mark.slow
def test_sigkill_while_tracking_publishes_nothing_and_the_next_build_ends_the_orphan_run(tmp_path, user_config_dir):
    result = tmp_path / "out" / "tiny" / "sm_86"
    p = start(tmp_path, user_config_dir)
    deadline = time.monotonic() + 300
    # the result is written but not yet current and its MLflow run is being logged: kill it there
    while p.poll() is None and time.monotonic() < deadline:
        if list(result.glob(".fp32.tmp-*")) and (tmp_path / "mlflow.db").exists():
            try:
                if any(st == "RUNNING" for st, _ in runs(tmp_path)):
                    break
            except sqlite3.Error:  # tables being created
                pass
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (result / "fp32").exists()
    before = runs(tmp_path) if (tmp_path / "mlflow.db").exists() else []
    assert ("FINISHED", "ok") not in before
    print("runs after the kill:", before)
    again = start(tmp_path, user_config_dir)
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out
    assert json.loads((result / "fp32" / "summary.json").read_text())["status"] == "ok"
    assert not list(result.glob(".fp32.tmp-*"))  # the killed build's folder was swept
    states = runs(tmp_path)
    assert ("RUNNING", None) not in states and all(s != "RUNNING" for s, _ in states), states
    assert states.count(("FINISHED", "ok")) == 1
    assert any(st == "RUNNING" for st, _ in before), "the kill came too late to leave a RUNNING run"
    assert ("FAILED", "failed") in states  # the killed build's run, ended by the next build
