"""`python -m flows.ui [--port N] [--experiment NAME] [--end-with-parent]` (what `make ui` runs): the MLflow UI on
127.0.0.1 over the tracking store and artifacts that builds write to, for the user who starts it only.

The UI, its REST and ajax APIs and its artifact downloads and uploads read and write whatever the user's files allow
(an experiment's artifact location is any folder), so it runs MLflow's own basic-auth app: every request but /health,
/server-info and the static files of the page shell needs the user's name and password (401 without them, 403 for any
other account), and the accounts' default permission is NO_PERMISSIONS. The password is a random secret kept like the
Prefect API's (flows/local/private.py: `~/.cache/trtforge/private/mlflow-ui-password`, 0600 in a 0700 folder); the
auth database and its config live in a folder of this run inside the user's private runtime folder, removed when it
stops. The address printed carries the name and password
(`http://trtforge:SECRET@127.0.0.1:PORT/trtforge-login#/experiments/N?...`): its login page opens the UI at the bare
address and the browser keeps sending the credentials, so nothing is asked; the bare address asks for them (basic
auth).

One process: MLflow's app runs here, in uvicorn, on a socket bound before anything is printed (no other user can take
the port between its choice and the server's start), so nothing outlives it however it ends; with `--end-with-parent`
(what `make ui` passes) it also ends when make does.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

from flows.env import env_defaults
from flows.tracking import artifact_location, tracking_uri

USERNAME = "trtforge"
PASSWORD_NAME = "mlflow-ui-password"  # the user's UI password (private.secret)
FLASK_KEY_NAME = "mlflow-ui-flask-key"  # the Flask session/CSRF key of the basic-auth app


def credentials() -> tuple[str, str]:
    """The name and password of the user's MLflow UI (NotPrivate when the private folder is not private)."""
    from flows.local import private

    return USERNAME, private.secret(PASSWORD_NAME)


def auth_config(folder: Path, password: str) -> Path:
    """The basic-auth app's config (MLFLOW_AUTH_CONFIG_PATH) in `folder` (private), its database beside it: the one
    admin account is this user's, and no account has any permission by default."""
    from flows.local import private

    ini = folder / "basic_auth.ini"
    private.write_private(ini, "[mlflow]\n"
                               "default_permission = NO_PERMISSIONS\n"
                               f"database_uri = sqlite:///{folder / 'auth.db'}\n"
                               f"admin_username = {USERNAME}\n"
                               f"admin_password = {password}\n"
                               "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                               "grant_default_workspace_access = false\n")
    return ini


def server_environment(uri: str, ini: Path, flask_key: str) -> dict[str, str]:
    """What `mlflow ui --app-name basic-auth --workers 1 --no-serve-artifacts` sets for its server process (mlflow/
    server/__init__.py _run_server), with job execution off; the admin name and password come from the config file
    only (an MLFLOW_AUTH_ADMIN_* of the user's would win over it)."""
    import uuid

    from mlflow.server.constants import ARTIFACT_ROOT_ENV_VAR, BACKEND_STORE_URI_ENV_VAR, REGISTRY_STORE_URI_ENV_VAR

    env = {BACKEND_STORE_URI_ENV_VAR: uri, REGISTRY_STORE_URI_ENV_VAR: uri,
           "MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": flask_key,
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_ENABLE_WORKSPACES": "false",
           "_MLFLOW_SGI_NAME": "uvicorn", "_MLFLOW_IN_JOB_EXECUTOR": "false", "_MLFLOW_SERVER_BOOT_ID": uuid.uuid4().hex}
    root = artifact_location(uri)
    if root:  # experiments made from the UI keep their artifacts where builds keep theirs
        env[ARTIFACT_ROOT_ENV_VAR] = root
    return env


def experiment_url(base: str, name: str) -> str:
    """The UI's page of the experiment when it exists yet, else its front page."""
    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        return base
    try:
        from mlflow.tracking import MlflowClient

        exp = MlflowClient(uri).get_experiment_by_name(name)
    except Exception:  # an unreachable or empty store: the UI says more than we could
        return base
    from flows.tracking import ui_link

    return ui_link(base, exp.experiment_id) if exp else base


LOGIN = "/trtforge-login"


# what a first visit of this browser to the UI starts with, unless the user chose otherwise before (the UI's own
# localStorage entries): the model-training view, not the GenAI one (every page, a run's too), and the Assistant pane
# closed (MLflow opens it by itself on a first visit to a server on 127.0.0.1)
FIRST_VISIT = {"mlflow.workflowType_v1": '"machine_learning"', "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
               "mlflow.assistant.panelOpen_v1": "false"}
LOGIN_PAGE = """<!doctype html><meta charset="utf-8"><title>MLflow (trtforge)</title><p>Opening the MLflow UI...</p>
<script>
for (const [k, v] of Object.entries(%s)) if (localStorage.getItem(k) === null) localStorage.setItem(k, v);
location.replace(location.protocol + "//" + location.host + "/" + location.hash);
</script>"""


def _login():
    """The page the printed address opens (behind basic auth, like every page): it sets FIRST_VISIT, then opens the UI
    at the same address without the name and password in it (location.host has none). The browser keeps the
    credentials it was given for this server and sends them with the UI's own requests, which a page whose address
    holds credentials cannot make (fetch() refuses such a URL); the #fragment (the experiment's page) carries over."""
    import json

    from flask import make_response

    r = make_response(LOGIN_PAGE % json.dumps(FIRST_VISIT))
    r.headers["Content-Type"] = "text/html; charset=utf-8"
    r.headers["Cache-Control"] = "no-store"
    return r


def login_url(port: int, user: str, password: str, page: str = "") -> str:
    """The address `make ui` prints: log in (the credentials in the URL), then open `page` (a `#/...` fragment)."""
    return f"http://{user}:{password}@127.0.0.1:{port}{LOGIN}{page}"


def serve(sock, uri: str, folder: Path, password: str, flask_key: str) -> int:
    """MLflow's basic-auth app over the store `uri`, in this process, on the bound socket `sock` (until stopped)."""
    import uvicorn

    ini = auth_config(folder, password)
    for k in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD"):
        os.environ.pop(k, None)
    os.environ.update(server_environment(uri, ini, flask_key))
    from mlflow.server import _UVICORN_LOG_CONFIG, _bootstrap_basic_auth
    from mlflow.server.handlers import initialize_backend_stores

    initialize_backend_stores(uri, uri, artifact_location(uri))
    _bootstrap_basic_auth()  # the admin account, from the config file
    os.environ["_MLFLOW_AUTH_ADMIN_BOOTSTRAPPED"] = "true"
    from mlflow.server import app as flask_app
    from mlflow.server.auth import create_app

    flask_app.add_url_rule(LOGIN, "trtforge_login", _login)
    app = create_app()
    config = uvicorn.Config(app=app, host="127.0.0.1", port=sock.getsockname()[1], log_config=str(_UVICORN_LOG_CONFIG),
                            workers=1)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def auth_folder(run: Path) -> Path:
    """A new private folder for this run's auth database (`mlflow-ui-<pid>` in the runtime folder); those of UIs that
    are gone (killed before they could remove theirs) are removed."""
    from flows.local.locks import pid_alive

    for old in run.glob("mlflow-ui-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    folder = run / f"mlflow-ui-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    os.mkdir(folder, 0o700)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.ui")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT") or 5000))
    p.add_argument("--experiment", default="trtforge")
    p.add_argument("--end-with-parent", action="store_true", help="end when the process that started this one ends")
    args = p.parse_args(argv)
    from flows.local import private
    from flows.local.net import listener_uid, reserve

    if args.end_with_parent:
        private.die_with_parent(os.getppid())
    env_defaults()
    try:
        user, password = credentials()
        flask_key = private.secret(FLASK_KEY_NAME)
        run = private.ensure(private.runtime_dir())
    except private.NotPrivate as e:
        print(f"trtforge: error: {e.render()}", file=sys.stderr)
        return e.exit_code
    try:
        sock = reserve(args.port)
    except OSError as e:
        uid = listener_uid(args.port)
        who = f"uid {uid}" if uid is not None else "another process"
        print(f"trtforge: error: 127.0.0.1:{args.port} is taken ({e.strerror}; served by {who})\n"
              f"  fix: make ui PORT=<another port>, or stop what serves it", file=sys.stderr)
        return 2
    folder = auth_folder(run)
    base = f"http://127.0.0.1:{args.port}/"
    page = experiment_url(base, args.experiment)[len(base):]
    print(f"trtforge: MLflow UI for {tracking_uri()}, for you only (MLflow basic auth: user {user}, password in "
          f"{private.secret_dir() / PASSWORD_NAME})\n  open {login_url(args.port, user, password, page)}  "
          f"(Ctrl-C stops it)", flush=True)
    # uvicorn stops on SIGTERM, then raises it again: as an exception here, so that the folder goes too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with sock:
            return serve(sock, tracking_uri(), folder, password, flask_key)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
