"""MLflow: one run per (model, target, precision) build, logged only once the result is complete (and before it
is published as current); ok builds' engines go to the model registry (flows/registry.py)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from pathlib import Path


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def artifact_location(uri: str) -> str | None:
    """Artifacts live beside the SQLite store they belong to (MLflow's default is ./mlruns of whatever cwd)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlruns").as_uri()
    return None


def use_experiment(name: str) -> str:
    """Point MLflow at the tracking store and the experiment `name`, creating it when missing; returns the URI."""
    import mlflow

    from flows.cache import named_lock

    _quiet()
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    # the first use of a store creates its tables: builds running in parallel take turns (else half-migrated reads)
    with named_lock(Path(uri), "mlflow-store"):
        if mlflow.get_experiment_by_name(name) is None:
            mlflow.create_experiment(name, artifact_location=artifact_location(uri))
    mlflow.set_experiment(name)
    return uri


def _quiet() -> None:
    for name in ("alembic", "mlflow", "urllib3", "httpx", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)


def client():
    from mlflow.tracking import MlflowClient

    _quiet()
    return MlflowClient(tracking_uri())


def run_matches(run_id: str, key: str) -> dict | None:
    """The run's start time (ms) when it is a finished ok run of a build with this key in the current tracking store.
    Asked without importing MLflow (seconds of imports): SQLite stores are read directly, servers over REST."""
    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        info = _sqlite_run(Path(uri[len("sqlite:///"):]), run_id)
    elif uri.startswith(("http://", "https://")):
        info = _rest_run(uri, run_id)
    else:
        from mlflow.exceptions import MlflowException

        try:
            r = client().get_run(run_id)
            info = {"status": r.info.status, "start_time": r.info.start_time, "deleted": r.info.lifecycle_stage != "active",
                    "tags": r.data.tags}
        except MlflowException:
            info = None
    if info is None or info["deleted"] or info["status"] != "FINISHED":
        return None
    if info["tags"].get("status") != "ok" or info["tags"].get("cache_key") != key:
        return None
    return {"start_time": info["start_time"]}


def _sqlite_run(db: Path, run_id: str) -> dict | None:
    import sqlite3

    if not db.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
            row = con.execute("SELECT status, start_time, lifecycle_stage FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
            if row is None:
                return None
            tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ? AND key IN ('status', 'cache_key')",
                                    (run_id,)).fetchall())
    except sqlite3.Error:
        return None
    return {"status": row[0], "start_time": row[1], "deleted": row[2] != "active", "tags": tags}


def _rest_run(uri: str, run_id: str) -> dict | None:
    import urllib.parse
    import urllib.request

    url = f"{uri.rstrip('/')}/api/2.0/mlflow/runs/get?{urllib.parse.urlencode({'run_id': run_id})}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            run = json.loads(r.read())["run"]
    except (OSError, ValueError, KeyError):
        return None
    info = run["info"]
    return {"status": info.get("status"), "start_time": int(info.get("start_time", 0)),
            "deleted": info.get("lifecycle_stage") != "active",
            "tags": {t["key"]: t["value"] for t in run.get("data", {}).get("tags", [])}}


def end_orphans(experiment_id: str) -> list[str]:
    """Runs left RUNNING by a build process of this host that no longer exists (killed): end them FAILED."""
    from flows.cache import _alive

    c = client()
    host = socket.gethostname()
    ended = []
    for run in c.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=200):
        t = run.data.tags
        if t.get("trtforge.host") == host and t.get("trtforge.pid", "").isdigit() and not _alive(int(t["trtforge.pid"])):
            c.set_tag(run.info.run_id, "status", "failed")
            c.set_tag(run.info.run_id, "failure", "the build process ended before the run was complete (killed)")
            c.set_terminated(run.info.run_id, status="FAILED")
            ended.append(run.info.run_id)
    return ended


def log_build(*, experiment: str, summary: dict, params: dict[str, str], resolved_yaml: str, out_dir: Path,
              engine_files: list[Path], versions: dict[str, str], build_id: str, provenance: dict[str, str],
              tolerance: float | None = None) -> dict[str, str]:
    """Log a finished build. The `status` tag is written last, so a run is never marked ok before it is whole.
    A retry of the same build (same `build_id`) continues its run instead of starting another."""
    import mlflow

    uri = use_experiment(experiment)
    exp = mlflow.set_experiment(experiment)
    end_orphans(exp.experiment_id)
    name = f"{summary['model']}-{summary['target']}-{summary['precision']}"
    ok = summary["status"] == "ok"
    again = client().search_runs([exp.experiment_id], f"tags.`trtforge.build_id` = '{build_id}'", max_results=1)
    # who is logging, set as the run is created: a build killed at any later moment leaves a run end_orphans can end
    owner = {"trtforge.build_id": build_id, "trtforge.pid": str(os.getpid()), "trtforge.host": socket.gethostname()}
    with mlflow.start_run(run_id=again[0].info.run_id) if again else mlflow.start_run(run_name=name, tags=owner) as run:
        try:
            mlflow.set_tags({"model": summary["model"], "target": summary["target"], "precision": summary["precision"],
                             **owner, "cache_key": summary["cache_key"],
                             **{f"trtforge.{k}": v for k, v in provenance.items()},
                             **{f"version.{k}": v for k, v in versions.items()}})
            mlflow.log_params(params)
            for key, d in summary.get("data", {}).items():  # what calibrated, judged the search, validated
                mlflow.set_tag(f"{key}.data", f"{d.get('samples')} samples: {d.get('source', '')}"[:5000])
            mlflow.set_tags({k: v for k, v in summary.get("metrics", {}).items() if isinstance(v, str)})
            from flows.context import origin_text  # a cached stage's numbers were measured by another run: say which
            mlflow.set_tags({f"cached_from.{stage}": origin_text(s["cached_from"])
                             for stage, s in summary["stages"].items() if s.get("cached_from")})
            flat = {}
            for k, v in summary.get("metrics", {}).items():  # dicts of numbers (flops_share) as "flops_share.fp16"
                flat.update({f"{k}.{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {k: v})
            metrics = {k: float(v) for k, v in flat.items()
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
                if f.is_file() and f.suffix in (".json", ".html", ".png", ".txt") and f.name not in ("summary.json", "report.html"):
                    mlflow.log_artifact(str(f), artifact_path="reports")
            mlflow.log_artifact(str(out_dir / "summary.json"))
            if (out_dir / "report.html").is_file():
                mlflow.log_artifact(str(out_dir / "report.html"))
            mlflow.set_tag("status", "ok" if ok else "failed")
        except Exception:
            mlflow.set_tag("status", "failed")
            raise
        if not ok:
            mlflow.end_run(status="FAILED")
    out = {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "tracking_uri": uri,
           "artifact_uri": run.info.artifact_uri}
    if ok:
        from flows.registry import register_engines

        reg = register_engines(client(), run, summary, summary["cache_key"], versions["backend"], tolerance)
        mlflow.MlflowClient(uri).set_tag(run.info.run_id, "registry", json.dumps(reg))
        out["registry"] = reg
    return out
