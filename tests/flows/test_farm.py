"""The build farm with authentication on, as the README's recipe runs it: a Prefect server that requires its API
secret, an MLflow tracking server behind its basic-auth app, two process workers on 127.0.0.1 on two pools (each takes
only its own targets) and a submitter, all passing the credentials; requests without them get 401."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.test_serve import api, free_port, unauthenticated


def start_mlflow_with_basic_auth(tmp: Path, port: int, password: str) -> subprocess.Popen:
    """`mlflow server --app-name basic-auth` (MLflow's own authentication; mlflow[auth]) on 127.0.0.1:port."""
    ini = tmp / "basic_auth.ini"
    ini.write_text("[mlflow]\ndefault_permission = READ\n"
                   f"database_uri = sqlite:///{tmp / 'basic_auth.db'}\nadmin_username = admin\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    import secrets

    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": password,
           "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),  # the basic-auth app's CSRF protection
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    return subprocess.Popen([mlflow, "server", "--app-name", "basic-auth", "--workers", "1", "--host", "127.0.0.1",
                             "--port", str(port), "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--serve-artifacts", "--artifacts-destination", str(tmp / "artifacts")],
                            env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop(p: subprocess.Popen, sig=signal.SIGINT) -> None:
    """Stop a process group: ``sig``, then SIGKILL after 10 s."""
    for s in (sig, signal.SIGKILL):
        try:
            os.killpg(p.pid, s)
            p.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def stop_farm(workers: list, server, tracking: subprocess.Popen, env: dict, uri: str) -> None:
    """A farm test's teardown: its workers, its Prefect server (if started) and tracking server stopped, this process's
    environment and MLflow tracking URI restored."""
    import mlflow

    for w in workers:
        stop(w)
    if server is not None:
        os.killpg(server.pid, signal.SIGTERM)
    stop(tracking, signal.SIGTERM)
    os.environ.clear()
    os.environ.update(env)
    mlflow.set_tracking_uri(uri)


def mlflow_get(url: str, path: str, auth: tuple[str, str] | None) -> tuple[int, dict]:
    import base64
    import json
    import urllib.error
    import urllib.request

    headers = {"Authorization": "Basic " + base64.b64encode(":".join(auth).encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=10) as r:
            body = r.read()
            return r.status, json.loads(body) if body.startswith(b"{") else {}
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:  # not answering yet
        return 0, {}


@pytest.mark.slow
def test_two_workers_on_two_pools_each_take_only_their_own_targets_with_authentication(tmp_path, user_config_dir):
    import secrets

    from flows.serve import ensure_server

    port, mlflow_port, password = free_port(), free_port(), secrets.token_urlsafe(16)
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    tracking = start_mlflow_with_basic_auth(tmp_path, mlflow_port, password)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=mlflow_url,
               MLFLOW_TRACKING_USERNAME="admin", MLFLOW_TRACKING_PASSWORD=password,
               PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1",
               TRTFORGE_FARM_WORKDIR=str(tmp_path / "farm"))  # the workers' folders in the test's own
    import mlflow

    old, old_uri = dict(os.environ), mlflow.get_tracking_uri()
    os.environ.update(env)
    os.environ.pop("PREFECT_API_URL", None)
    mlflow.set_tracking_uri(mlflow_url)  # this process's calls too (an in-process build earlier set its own store)
    server, workers = None, []
    try:
        url, server = ensure_server(port)  # this user's server, requiring the secret
        env["PREFECT_API_URL"] = os.environ["PREFECT_API_URL"] = url
        env["PREFECT_API_AUTH_STRING"] = secret = os.environ["PREFECT_API_AUTH_STRING"]
        assert unauthenticated(url, "/admin/version") == 401
        deadline = time.monotonic() + 180
        while mlflow_get(mlflow_url, "/health", None)[0] != 200:
            assert tracking.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(1)
        search = "/api/2.0/mlflow/experiments/search?max_results=10"
        assert mlflow_get(mlflow_url, search, None)[0] == 401
        assert mlflow_get(mlflow_url, search, ("admin", "wrong"))[0] == 401
        prefect = str(Path(sys.executable).with_name("prefect"))
        subprocess.run([sys.executable, "-m", "flows.farm", "setup"], env=env, check=True, cwd=tmp_path, timeout=300)
        (tmp_path / "tmp").mkdir(mode=0o700)  # the workers' temp folder: Prefect's runner keeps attempt folders there
        for pool in ("trtforge-rtx", "trtforge-sm_90"):
            workers.append(subprocess.Popen([prefect, "worker", "start", "--pool", pool, "--name", f"w-{pool}"],
                                            env={**env, "TMPDIR": str(tmp_path / "tmp")}, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True))
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        from flows.farm import submit
        common = ["model=tiny", "precision=fp32", "stages.benchmark=false", f"out_dir={tmp_path / 'out'}",
                  f"cache_dir={tmp_path / 'cache'}"]
        # this server, even inside the session's test harness; the submitter passes the secret
        with temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: secret}):
            rtx = submit([*common, "target=sm_86"], str(user_config_dir))
            ent = submit([*common, "target=sm_90"], str(user_config_dir))
        assert (rtx.work_pool_name, ent.work_pool_name) == ("trtforge-rtx", "trtforge-sm_90")
        deadline, done = time.monotonic() + 400, {}
        while len(done) < 2 and time.monotonic() < deadline:
            for r in (rtx, ent):
                fr = api(url, f"/flow_runs/{r.id}")
                if fr["state_type"] in ("COMPLETED", "FAILED", "CRASHED"):
                    done[r.id] = fr
            time.sleep(2)
        assert done[rtx.id]["state_type"] == "COMPLETED", done[rtx.id]["state"]
        # the Enterprise pool's worker took the sm_90 build; this host has no such GPU, so it fails saying so
        assert done[ent.id]["state_type"] == "FAILED"
        assert "Enterprise TensorRT" in done[ent.id]["state"]["message"]
        assert (tmp_path / "out" / "tiny" / "sm_86" / "fp32" / "summary.json").is_file()
        assert not (tmp_path / "out" / "tiny" / "sm_90").exists()
        # the worker's build logged its run, engine and registry version through MLflow's authentication
        code, found = mlflow_get(mlflow_url, "/api/2.0/mlflow/registered-models/get?name=tiny", ("admin", password))
        assert code == 200 and found["registered_model"]["aliases"][0]["alias"] == "sm_86-fp32", found
    finally:
        stop_farm(workers, server, tracking, old, old_uri)
