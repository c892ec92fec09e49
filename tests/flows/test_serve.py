"""`make serve`: a real Prefect server on 127.0.0.1, with the user's secret, and the rebuild flow served on a cron
schedule; a server `make serve` cannot authenticate is refused."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None, secret: str | None = None):
    """A Prefect API call, with this user's secret (the one trtforge's local servers require) unless told."""
    from flows.local.net import auth_header
    from flows.local.server import auth_string

    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", **auth_header(secret or auth_string())},
                                 method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def unauthenticated(url: str, path: str) -> int:
    """The status a request without the secret gets."""
    try:
        with urllib.request.urlopen(url + path, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_the_rebuild_deployment_runs_on_its_cron_schedule(tmp_path):
    port, out = free_port(), tmp_path / "rebuild.json"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_RUNNER_POLL_FREQUENCY="1",
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(mode=0o700)  # Prefect's runner keeps its attempt folders there
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
        assert unauthenticated(url, "/deployments/name/trtforge-rebuild/scheduled") == 401  # only with the secret
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


def test_make_serve_refuses_a_server_it_cannot_authenticate(tmp_path):
    """Something of this user's answers on the port without requiring the secret (a plain `prefect server start`):
    `make serve` will not run its rebuilds there, and says why."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING",
                                                            "PREFECT_SERVER_API_AUTH_STRING")}
    env.update(PREFECT_HOME=str(tmp_path / "open"))
    from flows.local.prefect_api import server_command
    from flows.local.net import healthy

    open_server = subprocess.Popen(server_command(port), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not healthy(f"http://127.0.0.1:{port}/api") and time.monotonic() < deadline:
            assert open_server.poll() is None
            time.sleep(0.5)
        assert unauthenticated(f"http://127.0.0.1:{port}/api", "/admin/version") == 200  # open to anyone
        r = subprocess.run([sys.executable, "-m", "flows.serve", f"port={port}"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 3, r.stdout + r.stderr
        assert f"the server on 127.0.0.1:{port} cannot be authenticated" in r.stderr, r.stderr
        assert "deployment" not in r.stdout
    finally:
        os.killpg(open_server.pid, signal.SIGTERM)
        open_server.wait(30)
