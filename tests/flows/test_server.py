"""The shared local Prefect server (flows/local/server.py): builds reuse one instead of starting a temporary server each,
and a killed build leaves nothing running: the server stops by itself once no live build holds a lease."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.local.server import pid_alive, healthy


def cli(tmp: Path, conf: Path, *extra: str, env_extra: dict | None = None, wait: bool = True):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "PREFECT_HOME": str(tmp / "prefect"),
           **(env_extra or {})}
    env.pop("PREFECT_API_URL", None)
    args = [sys.executable, "-m", "flows.build", "--config-dir", str(conf), "model=tiny", "stages.benchmark=false",
            f"out_dir={tmp / 'out'}", f"cache_dir={tmp / 'cache'}", *extra]
    if not wait:
        return subprocess.Popen(args, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def server_processes(port: int) -> list[int]:
    """The processes serving Prefect's API on that port: `python -m flows.local.prefect_api PORT [FD]` (how trtforge starts it),
    or a `prefect server start --port PORT`."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid, *args = line.split()
        ours = "flows.local.prefect_api" in args and args[args.index("flows.local.prefect_api") + 1:][:1] == [str(port)]
        if ours or ("prefect" in line and "server" in args and f"--port {port}" in line):
            pids.append(int(pid))
    return pids


@pytest.mark.slow
def test_builds_share_one_local_server_and_a_killed_build_leaves_nothing_running(tmp_path, user_config_dir):
    idle = {"TRTFORGE_SERVER_IDLE": "6"}
    first = cli(tmp_path, user_config_dir, "precision=fp32", env_extra=idle)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    state = json.loads((tmp_path / "prefect" / "trtforge-server.json").read_text())
    assert healthy(state["url"])
    from flows.local.net import status
    from flows.local.server import auth_string

    assert status(state["url"], "/admin/version", None) == 401  # the user's own: closed without the secret
    assert status(state["url"], "/admin/version", auth_string()) == 200
    assert server_processes(state["port"]), "the leak check below cannot see the running server"
    second = cli(tmp_path, user_config_dir, "precision=fp16", env_extra=idle)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert json.loads((tmp_path / "prefect" / "trtforge-server.json").read_text())["pid"] == state["pid"]  # reused

    killed = cli(tmp_path, user_config_dir, "precision=fp16", "target=sm_89", env_extra=idle, wait=False)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "prefect" / "trtforge-leases").glob(str(killed.pid))) and time.monotonic() < deadline:
        time.sleep(0.05)  # the build holds its lease: it is using the server
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    deadline = time.monotonic() + 60
    while (pid_alive(state["pid"]) or server_processes(state["port"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not pid_alive(state["pid"]) and not server_processes(state["port"]), "the server outlived its builds"
    assert not (tmp_path / "prefect" / "trtforge-server.json").exists()
    third = cli(tmp_path, user_config_dir, "precision=fp32", "target=sm_80", env_extra=idle)  # starts a new one
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    st = json.loads((tmp_path / "prefect" / "trtforge-server.json").read_text())
    assert st["pid"] != state["pid"] and healthy(st["url"])
    os.kill(st["pid"], signal.SIGTERM)  # the test's own cleanup (it would stop by itself after 6 s idle)
    deadline = time.monotonic() + 30
    while server_processes(st["port"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not server_processes(st["port"])


def test_a_command_with_bad_input_leaves_no_server_running(tmp_path, user_config_dir):
    """The CLI starts the shared server early (beside its imports and checks); a command whose input is bad needs no
    flow, so the server it started is stopped again before it exits."""
    p = cli(tmp_path, user_config_dir, "precision=fp33")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "precision" in p.stderr
    log = tmp_path / "prefect" / "trtforge-server.log"
    assert log.is_file()  # it was started (early) ...
    deadline = time.monotonic() + 30
    state = tmp_path / "prefect" / "trtforge-server.json"
    while state.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not state.exists(), "the server a bad command started is still running"  # ... and stopped


def test_builds_run_their_flow_without_prefect_heartbeats_unless_the_user_wants_them(monkeypatch):
    from prefect.settings import get_current_settings

    from flows.local.server import without_heartbeats

    monkeypatch.delenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", raising=False)
    monkeypatch.delenv("PREFECT_RUNNER_HEARTBEAT_FREQUENCY", raising=False)
    default = get_current_settings().flows.heartbeat_frequency
    assert default is not None
    with without_heartbeats():
        assert get_current_settings().flows.heartbeat_frequency is None
    assert get_current_settings().flows.heartbeat_frequency == default
    monkeypatch.setenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "60")
    with without_heartbeats():  # the user's setting wins: Prefect reads it as it always does
        assert get_current_settings().flows.heartbeat_frequency == default
