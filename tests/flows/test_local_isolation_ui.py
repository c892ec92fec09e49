"""`make ui` serves only the user who started it: checked as another local user (made with useradd, acted as with
setpriv; tests/flows/test_local_isolation.py), against the real UI (`python -m flows.ui`, MLflow's basic-auth app) of a
second user. And the UI ends however it ends: killed itself, or its parent killed (`make ui` execs it with
--end-with-parent)."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flows.local.net import free_port, listener_uid
from tests.flows.test_local_isolation import as_user, home_of, processes_of, shared, users  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]

# what another local user tries, unauthenticated or with guessed credentials: every class of endpoint (the UI page,
# the REST and ajax APIs, artifact downloads and uploads, the artifact proxy, GraphQL, the assistant, the login page),
# and the steps of the symlinked-artifact attack (an experiment whose artifact location is a folder of the attacker's,
# `artifacts` in it a link to the user's private folder, then get-artifact of the secret and upload-artifact as them)
ATTACK = r'''
import base64, json, sys, urllib.request, urllib.error
base, attacker_dir = sys.argv[1], sys.argv[2]
def call(method, path, body=None, auth=None):
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return [r.status, r.read(2000).decode("latin-1")]
    except urllib.error.HTTPError as e:
        return [e.code, e.read(2000).decode("latin-1")]
out = {
  "home": call("GET", "/"),
  "login": call("GET", "/trtforge-login"),
  "experiments": call("GET", "/api/2.0/mlflow/experiments/search?max_results=100"),
  "ajax_runs": call("POST", "/ajax-api/2.0/mlflow/runs/search", {"experiment_ids": ["0", "1"]}),
  "create_experiment": call("POST", "/api/2.0/mlflow/experiments/create",
                            {"name": "intruder", "artifact_location": "file://" + attacker_dir}),
  "ajax_create_experiment": call("POST", "/ajax-api/2.0/mlflow/experiments/create",
                                 {"name": "intruder2", "artifact_location": "file://" + attacker_dir}),
  "create_run": call("POST", "/api/2.0/mlflow/runs/create", {"experiment_id": "1"}),
  "get_artifact": call("GET", "/get-artifact?path=artifacts/prefect-api-auth&run_uuid=0"),
  "ajax_get_artifact": call("GET", "/ajax-api/2.0/mlflow/get-artifact?path=artifacts/prefect-api-auth&run_uuid=0"),
  "upload_artifact": call("POST", "/ajax-api/2.0/mlflow/upload-artifact?run_uuid=0&path=artifacts/planted", b"owned"),
  "artifact_proxy": call("PUT", "/api/2.0/mlflow-artifacts/artifacts/planted", b"owned"),
  "graphql": call("POST", "/graphql", {"query": "{ mlflowSearchRuns(input: {experimentIds: [\"1\"]}) { runs { info { runId } } } }"}),
  "assistant": call("GET", "/ajax-api/3.0/mlflow/assistant/config"),
  "users": call("GET", "/api/2.0/mlflow/users/get?username=trtforge"),
  "guessed_admin": call("GET", "/api/2.0/mlflow/experiments/search?max_results=100", auth="admin:password"),
  "guessed_user": call("GET", "/api/2.0/mlflow/experiments/search?max_results=100", auth="trtforge:trtforge"),
}
print(json.dumps(out))
'''


def start_ui(user, env: dict, port: int, cwd: Path) -> subprocess.Popen:
    return as_user(user, [sys.executable, "-m", "flows.ui", "--port", str(port)], env, cwd=cwd, wait=False,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def printed_address(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """The address the UI prints (it logs in), once it answers /health."""
    deadline, url = time.monotonic() + timeout, None
    while url is None:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "the UI ended before printing its address"
        m = re.search(r"open (http://\S+)", line)
        url = m.group(1) if m else None
        assert time.monotonic() < deadline, "the UI printed no address"
    port = int(re.search(r"@127\.0\.0\.1:(\d+)/", url).group(1))
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return url
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the UI did not come up"
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def owner_call(base: str, auth: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Basic " + base64.b64encode(auth.encode()).decode()})
    with urllib.request.urlopen(req, timeout=20) as r:
        return r.status, json.loads(r.read() or b"{}")


@pytest.mark.slow
def test_make_ui_answers_another_local_user_401_on_every_endpoint_and_the_artifact_attack_gets_nothing(users, shared):
    peer, squatter = users
    home, env = home_of(peer, shared)
    # the user's private folder holds the Prefect API's secret: what the attack reads through a linked artifact folder
    r = as_user(peer, [sys.executable, "-c", "from flows.local import server; print(server.auth_string())"], env)
    assert r.returncode == 0, r.stderr
    secret = r.stdout.strip()
    private = home / ".cache" / "trtforge" / "private"
    attacker = shared / "attacker"
    plant = (f"import os; os.makedirs({str(attacker)!r}); os.symlink({str(private)!r}, "
             f"{str(attacker / 'artifacts')!r})")
    r = as_user(squatter, [sys.executable, "-c", plant], {"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    port = free_port()
    ui = start_ui(peer, env, port, home)
    try:
        url = printed_address(ui)
        assert listener_uid(port) == peer.pw_uid
        user, password = re.match(r"http://([^:@/]+):([^@/]+)@", url).groups()
        base = f"http://127.0.0.1:{port}"
        r = as_user(squatter, [sys.executable, "-c", ATTACK, base, str(attacker)], {"PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr
        answers = json.loads(r.stdout)
        refused = {k: status for k, (status, _) in answers.items() if status not in (401, 403)}
        assert not refused, refused  # every endpoint closed to them
        assert all(secret not in body for _, body in answers.values())
        assert not (private / "planted").exists()
        # the user who started it gets in (the server was up and serving the store all along)
        status, found = owner_call(base, f"{user}:{password}", "GET", "/api/2.0/mlflow/experiments/search?max_results=100")
        assert status == 200
        assert not {e["name"] for e in found.get("experiments", [])} & {"intruder", "intruder2"}
        # its password is the user's own secret, in their private folder (0600), unreadable to the other user
        pw_file = private / "mlflow-ui-password"
        st = os.lstat(pw_file)
        assert (st.st_uid, st.st_mode & 0o777) == (peer.pw_uid, 0o600) and pw_file.read_text().strip() == password
        r = as_user(squatter, [sys.executable, "-c", f"open({str(pw_file)!r}).read()"], {"PATH": "/usr/bin:/bin"})
        assert r.returncode != 0 and "PermissionError" in r.stderr
    finally:
        stop(ui)
    assert not processes_of(peer.pw_uid, "flows.ui")
    assert not list((home / ".cache" / "trtforge" / "run").glob("mlflow-ui-*"))  # its auth database went with it


def _ui_gone(port: int, marker: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if listener_uid(port) is None and not processes_of(os.geteuid(), marker):
            return True
        time.sleep(0.25)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL of the UI", "SIGKILL of its parent", "SIGTERM of its parent"])
def test_make_ui_ends_with_everything_it_started_however_it_ends(tmp_path, how):
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    marker = f"--port\0{port}\0--end-with-parent"  # (its command line as /proc has it; not the shell's)
    # as `make ui` runs it: exec'd by its parent (here a shell that stays, standing for make) with --end-with-parent
    parent = subprocess.Popen(["sh", "-c", f"{sys.executable} -m flows.ui --port {port} --end-with-parent; echo ended"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        printed_address(parent)
        ui = processes_of(os.geteuid(), marker)
        assert len(ui) == 1 and listener_uid(port) == os.geteuid()
        if how == "SIGKILL of the UI":
            os.kill(ui[0], signal.SIGKILL)
        else:
            os.kill(parent.pid, signal.SIGKILL if how.startswith("SIGKILL") else signal.SIGTERM)
        assert _ui_gone(port, marker), f"the UI outlived {how}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
