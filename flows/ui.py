"""`python -m flows.ui [--port N] [--experiment NAME]` (what `make ui` runs): the MLflow UI on 127.0.0.1 over the
tracking store and artifacts that builds write to, with light settings (one worker, no job execution)."""
from __future__ import annotations

import argparse
import os
import sys

from flows.env import env_defaults
from flows.tracking import artifact_location, tracking_uri


def command(port: int) -> list[str]:
    uri = tracking_uri()
    cmd = [sys.executable, "-m", "mlflow", "ui", "--workers", "1", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", uri]
    root = artifact_location(uri)
    if root:  # experiments made from the UI keep their artifacts where builds keep theirs
        cmd += ["--default-artifact-root", root, "--no-serve-artifacts"]
    return cmd


def environment() -> dict[str, str]:
    env_defaults()
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def experiment_url(port: int, name: str) -> str:
    """The UI's page of the experiment when it exists yet, else its front page."""
    base = f"http://127.0.0.1:{port}/"
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.ui")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT") or 5000))
    p.add_argument("--experiment", default="trtforge")
    args = p.parse_args(argv)
    print(f"trtforge: MLflow UI for {tracking_uri()}\n  open {experiment_url(args.port, args.experiment)}  (Ctrl-C stops it)",
          flush=True)
    os.execvpe(sys.executable, command(args.port), environment())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
