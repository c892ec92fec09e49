"""`python -m flows.serve [port=4200] [cron=...] [experiment=...] [tolerance=...]`: the scheduled rebuild.

Connects to the Prefect server at PREFECT_API_URL, or to this user's authenticated server at 127.0.0.1:PORT, or
starts one there (Prefect's API authentication with the user's secret, flows/local/server.py), then serves the
rebuild flow (flows/rebuild.py) as the deployment `trtforge-rebuild/scheduled` on the cron schedule in
conf/rebuild.yaml. Builds started with PREFECT_API_URL (and PREFECT_API_AUTH_STRING) set use that server.

A server started here ends with this process however it ends (PR_SET_PDEATHSIG: even SIGKILL); with
`--end-with-parent` (what `make serve` passes) this process ends with whatever started it too (make, killed).
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
    """The API URL of a Prefect server to serve on: the user's PREFECT_API_URL (with their own
    PREFECT_API_AUTH_STRING), else this user's authenticated server on 127.0.0.1:port, started when the port is free
    (bound here and handed to the server: never free in between). A server on that port that is another user's, or
    that does not require and accept this user's secret, is refused: its rebuilds would write where anyone's
    parameters say. Sets PREFECT_API_AUTH_STRING for this process. Returns the URL and the server process when this
    call started it."""
    from flows.local import private
    from flows.local import server as local
    from flows.local.net import authenticated, listener_uid, reserve
    from tasks.common import UnavailableError

    if os.environ.get("PREFECT_API_URL"):
        url = os.environ["PREFECT_API_URL"]
        if healthy(url):
            return url, None
        raise UnavailableError(f"PREFECT_API_URL={url} does not answer", fix="start that server, or unset PREFECT_API_URL")
    local.private_home()  # its database and records: the user's own folder, or refused (exit 2)
    secret = local.auth_string()  # (NotPrivate, exit 2, when its folder or file is not private)
    url = local.api_url(port)
    try:
        sock = reserve(port)
    except OSError:  # taken: used only when the kernel says it is this user's and it knows the secret
        uid = listener_uid(port)
        if uid is not None and uid != os.geteuid():
            raise UnavailableError(f"127.0.0.1:{port} is served by uid {uid}, not by you: trtforge runs its rebuilds only "
                                   "on a Prefect server of yours that requires your secret",
                                   fix=f"pick another port=, or stop that server") from None
        if uid is None or not authenticated(url, secret):
            raise UnavailableError(f"the server on 127.0.0.1:{port} cannot be authenticated: it does not require and "
                                   f"accept your secret ({private.secret_dir() / local.SECRET_NAME})",
                                   fix=f"stop it and run `make serve` again (it starts one that does), or pick another "
                                       f"port=") from None
        os.environ["PREFECT_API_AUTH_STRING"] = secret
        return url, None
    from flows.local.prefect_api import server_command

    me = os.getpid()
    with sock:  # the server gets SIGTERM when this process dies, however it dies
        proc = subprocess.Popen(server_command(port, sock.fileno()), pass_fds=(sock.fileno(),),
                                env={**local.server_env(secret), **local.seed_home()},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=lambda: private.die_with_parent(me))
    t0 = time.monotonic()
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            proc.kill()
            raise UnavailableError(f"the Prefect server on 127.0.0.1:{port} did not become healthy",
                                   fix=f"run `python -m flows.local.prefect_api {port}` by hand to see why, or pick "
                                       "another port=")
        time.sleep(0.5)
    os.environ["PREFECT_API_AUTH_STRING"] = secret
    return url, proc


def rebuild_flow_object():
    from prefect import flow

    from flows.rebuild import rebuild_pass

    @flow(name="trtforge-rebuild", log_prints=True, persist_result=False)
    def trtforge_rebuild(rebuild_out: str | None = None, tolerance: float | None = None,
                         experiment: str | None = None) -> dict:
        return rebuild_pass(rebuild_out, tolerance, experiment)

    return trtforge_rebuild


def end_with_parent(argv: list[str]) -> list[str]:
    """With `--end-with-parent` in argv (what the Makefile passes, exec'd by make): this process gets SIGTERM when
    its parent dies, however it dies. Returns argv without the flag."""
    if "--end-with-parent" in argv:
        from flows.local.private import die_with_parent

        die_with_parent(os.getppid())
    return [a for a in argv if a != "--end-with-parent"]


def main(argv: list[str] | None = None) -> int:
    argv = end_with_parent(sys.argv[1:] if argv is None else argv)
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    port = int(args.pop("port", 4200))
    opts = settings(**args)
    from tasks.common import TrtforgeError

    try:
        url, proc = ensure_server(port)
    except TrtforgeError as e:
        print(f"trtforge: error: {e.render()}", file=sys.stderr)
        return e.exit_code
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
