"""MLflow: one run per (model, target, precision) build, logged only once the result is complete."""
from __future__ import annotations

import logging
import os
from pathlib import Path


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def _quiet() -> None:
    for name in ("alembic", "mlflow", "urllib3", "httpx", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)


def log_build(*, experiment: str, summary: dict, params: dict[str, str], resolved_yaml: str, out_dir: Path,
              engine_files: list[Path], versions: dict[str, str]) -> dict[str, str]:
    """Log a finished build. The `status` tag is written last, so a run is never marked ok before it is whole."""
    import mlflow

    _quiet()
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        # artifacts live beside the SQLite store they belong to (MLflow's default is ./mlruns of whatever cwd)
        location = None
        if uri.startswith("sqlite:///"):
            location = (Path(uri[len("sqlite:///"):]).resolve().parent / "mlruns").as_uri()
        try:
            mlflow.create_experiment(experiment, artifact_location=location)
        except Exception:  # created meanwhile by a parallel build
            pass
    mlflow.set_experiment(experiment)
    name = f"{summary['model']}-{summary['target']}-{summary['precision']}"
    ok = summary["status"] == "ok"
    with mlflow.start_run(run_name=name) as run:
        try:
            mlflow.set_tags({"model": summary["model"], "target": summary["target"], "precision": summary["precision"],
                             **{f"version.{k}": v for k, v in versions.items()}})
            mlflow.log_params(params)
            for key, d in summary.get("data", {}).items():
                mlflow.set_tag(f"{key}.sha256", d["sha256"])
            metrics = {k: float(v) for k, v in summary.get("metrics", {}).items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(float(v)) != float("inf")}
            for stage, s in summary["stages"].items():
                if s.get("seconds") is not None:
                    metrics[f"stage_seconds.{stage}"] = float(s["seconds"])
            if metrics:
                mlflow.log_metrics(metrics)
            for f in engine_files:
                mlflow.log_artifact(str(f), artifact_path="engine")
            mlflow.log_text(resolved_yaml, "config.yaml")
            for f in sorted(out_dir.glob("*")):
                if f.is_file() and f.suffix in (".json", ".html", ".png", ".txt") and f.name != "summary.json":
                    mlflow.log_artifact(str(f), artifact_path="reports")
            mlflow.log_artifact(str(out_dir / "summary.json"))
            mlflow.set_tag("status", "ok" if ok else "failed")
        except Exception:
            mlflow.set_tag("status", "failed")
            raise
        if not ok:
            mlflow.end_run(status="FAILED")
    return {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "tracking_uri": uri,
            "artifact_uri": run.info.artifact_uri}
