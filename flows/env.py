"""The environment defaults every entry point sets before Prefect or MLflow is imported, in a module of its own
(standard library only): the CLI sets them and starts the shared Prefect server (flows/local/server.py) before its heavier
imports, so the server inherits them. The user's environment always wins."""
from __future__ import annotations

import os

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_LOGGING_TO_API_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "TQDM_DISABLE": "1",
}


def env_defaults() -> None:
    """Quiet, offline-safe defaults for the embedded Prefect server and MLflow (the user's env wins)."""
    for k, v in DEFAULTS.items():
        os.environ.setdefault(k, v)
