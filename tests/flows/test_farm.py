"""The build farm: two process workers on 127.0.0.1, two pools, each worker takes only its own targets."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.test_serve import api, free_port


@pytest.mark.slow
def test_two_workers_on_two_pools_each_take_only_their_own_targets(tmp_path, user_config_dir):
    from flows.serve import ensure_server

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
               PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1")
    old = dict(os.environ)
    os.environ.update(env)
    os.environ.pop("PREFECT_API_URL", None)
    url, server = ensure_server(port)
    env["PREFECT_API_URL"] = os.environ["PREFECT_API_URL"] = url
    prefect = str(Path(sys.executable).with_name("prefect"))
    workers = []
    try:
        subprocess.run([sys.executable, "-m", "flows.farm", "setup"], env=env, check=True, cwd=tmp_path, timeout=300)
        for pool in ("trtforge-rtx", "trtforge-sm_90"):
            workers.append(subprocess.Popen([prefect, "worker", "start", "--pool", pool, "--name", f"w-{pool}"],
                                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True))
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.farm import submit
        common = ["model=tiny", "precision=fp32", "stages.benchmark=false", f"out_dir={tmp_path / 'out'}",
                  f"cache_dir={tmp_path / 'cache'}"]
        with temporary_settings({PREFECT_API_URL: url}):  # this server, even inside the session's test harness
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
    finally:
        for w in workers:
            for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
                try:
                    os.killpg(w.pid, sig)
                    w.wait(5)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
        os.environ.clear()
        os.environ.update(old)
