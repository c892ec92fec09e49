"""`python -m flows.serve [port=4200] [cron=...] [experiment=...] [tolerance=...]`: the scheduled rebuild.

Connects to the Prefect server at PREFECT_API_URL, or at 127.0.0.1:PORT, or starts `prefect server start` there,
then serves the rebuild flow (flows/rebuild.py) as the deployment `trtforge-rebuild/scheduled` on the cron
schedule in conf/rebuild.yaml. Builds started with PREFECT_API_URL set use that server instead of a temporary one.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from flows.env import env_defaults
from flows.local.net import healthy
from flows.rebuild import settings

env_defaults()

DEPLOYMENT = "scheduled"


def ensure_server(port: int = 4200, timeout: float = 120.0) -> tuple[str, subprocess.Popen | None]:
    """The API URL of a running server (PREFECT_API_URL, or 127.0.0.1:port), starting one when none answers.
    Returns the URL and the server process when this call started it."""
    url = os.environ.get("PREFECT_API_URL") or f"http://127.0.0.1:{port}/api"
    if healthy(url):
        return url, None
    if "PREFECT_API_URL" in os.environ and not url.startswith(("http://127.0.0.1", "http://localhost")):
        from tasks.errors import UnavailableError
        raise UnavailableError(f"PREFECT_API_URL={url} does not answer", fix="start that server, or unset PREFECT_API_URL")
    from flows.local.prefect_api import server_command
    from flows.local.server import seed_home

    first = seed_home()
    proc = subprocess.Popen(server_command(port), env={**os.environ, **first},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            proc.kill()
            from tasks.errors import UnavailableError
            raise UnavailableError(f"prefect server start on 127.0.0.1:{port} did not become healthy",
                                   fix=f"run `prefect server start --port {port}` by hand to see why, or pick another port=")
        time.sleep(0.5)
    return url, proc


def rebuild_flow_object():
    from prefect import flow

    from flows.rebuild import rebuild_pass

    @flow(name="trtforge-rebuild", log_prints=True, persist_result=False)
    def trtforge_rebuild(rebuild_out: str | None = None, tolerance: float | None = None,
                         experiment: str | None = None) -> dict:
        return rebuild_pass(rebuild_out, tolerance, experiment)

    return trtforge_rebuild


def main(argv: list[str] | None = None) -> int:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv) if "=" in a)
    port = int(args.pop("port", 4200))
    opts = settings(**args)
    url, proc = ensure_server(port)
    os.environ["PREFECT_API_URL"] = url  # before Prefect is imported: the flow runs report to this server
    print(f"prefect server {url} ({f'started here, pid {proc.pid}' if proc else 'already running'}); UI {url[:-4]}\n"
          f"serving trtforge-rebuild/{DEPLOYMENT} on cron {opts['cron']!r} (conf/rebuild.yaml); Ctrl-C stops",
          flush=True)
    params = {"tolerance": float(opts["tolerance"]), "experiment": opts["experiment"], "rebuild_out": opts["rebuild_out"]}
    try:
        rebuild_flow_object().serve(name=DEPLOYMENT, cron=opts["cron"], parameters=params)
    finally:
        if proc is not None:
            proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
