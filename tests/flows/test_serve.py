"""`make serve`: a real `prefect server start` on 127.0.0.1 and the rebuild flow served on a cron schedule."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"}, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_the_rebuild_deployment_runs_on_its_cron_schedule(tmp_path):
    port, out = free_port(), tmp_path / "rebuild.json"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_RUNNER_POLL_FREQUENCY="1",
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    serve = subprocess.Popen([sys.executable, "-m", "flows.serve", f"port={port}", "cron=* * * * *",
                              "experiment=nothing-tracked-yet", f"rebuild_out={out}"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url, server_pid = f"http://127.0.0.1:{port}/api", None
    try:
        head = serve.stdout.readline()  # printed once the server is healthy
        m = re.search(r"pid (\d+)", head)
        assert m, head + (serve.stdout.read() if serve.poll() is not None else "")
        server_pid = int(m.group(1))
        dep = None
        deadline = time.monotonic() + 60
        while dep is None and time.monotonic() < deadline:
            try:
                dep = api(url, "/deployments/name/trtforge-rebuild/scheduled")
            except OSError:
                time.sleep(1)
        assert dep and dep["schedules"][0]["schedule"]["cron"] == "* * * * *"
        deadline = time.monotonic() + 150  # the next minute boundary, then the runner's poll
        while not out.exists() and time.monotonic() < deadline and serve.poll() is None:
            time.sleep(1)
        assert json.loads(out.read_text()) == {"checked": 0, "rebuilt": [], "fresh": [], "failed": []}
        time.sleep(2)
        runs = api(url, "/flow_runs/filter", {"deployments": {"id": {"any_": [dep["id"]]}}})
        assert any(r["auto_scheduled"] and r["state_type"] in ("COMPLETED", "RUNNING") for r in runs), runs
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
        if server_pid:
            try:
                os.killpg(server_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
