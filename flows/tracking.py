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


def seed_store(uri: str) -> None:
    """A new SQLite tracking store starts from the migrated template database when there is one (flows/local/templates.py):
    MLflow then skips its table creation and migrations."""
    if uri.startswith("sqlite:///"):
        from flows.local.templates import seed

        seed(Path(uri[len("sqlite:///"):]), "mlflow")


def artifact_location(uri: str) -> str | None:
    """Artifacts live beside the SQLite store they belong to (MLflow's default is ./mlruns of whatever cwd)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlruns").as_uri()
    return None


# MLflow 3's UI opens experiments in its GenAI view (traces, an assistant pane). The experiment tag marks ours as model
# development; MLflow 3.17's UI takes the view from the `workflowType` URL parameter (else the browser's last choice,
# GenAI at first), so every link trtforge prints carries it (ui_link).
EXPERIMENT_KIND, MODEL_DEVELOPMENT = "mlflow.experimentKind", "custom_model_development"
WORKFLOW = "workflowType=machine_learning"


def ui_link(base: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI address of an experiment (or a run), opening in the model-training view."""
    path = f"#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{base.rstrip('/')}/{path}?{WORKFLOW}"


def use_experiment(name: str) -> str:
    """Point MLflow at the tracking store and the experiment `name`, creating it when missing; returns the URI."""
    import mlflow

    from flows.local.locks import named_lock

    _quiet()
    uri = tracking_uri()
    seed_store(uri)
    mlflow.set_tracking_uri(uri)
    # the first use of a store creates its tables: builds running in parallel take turns (else half-migrated reads)
    with named_lock(Path(uri), "mlflow-store"):
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            mlflow.create_experiment(name, artifact_location=artifact_location(uri), tags={EXPERIMENT_KIND: MODEL_DEVELOPMENT})
        elif exp.tags.get(EXPERIMENT_KIND) != MODEL_DEVELOPMENT:  # an experiment made before: the same view
            mlflow.MlflowClient(uri).set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_DEVELOPMENT)
    mlflow.set_experiment(name)
    return uri


def warm(prefect: bool = False, mlflow: bool = True) -> None:
    """While the build does its own work, in a background thread: import Prefect (when ``prefect``: its API URL must be
    set), and MLflow and its store (when ``mlflow``: no tracker process loads them, flows/local/tracker.py): seconds of
    imports and store set-up off the critical path. Errors are left for the real calls to report."""
    import threading

    from flows import timeline

    def work() -> None:
        import gc

        collecting = gc.isenabled()
        gc.disable()  # the collector's passes over the objects these imports create: a third of MLflow's import time
        try:
            if with_prefect:  # (not `prefect`: the import below would make that name local to work())
                import prefect.cache_policies  # noqa: F401
                import prefect.flow_engine  # noqa: F401
                import prefect.task_engine  # noqa: F401
                timeline.mark("warm: prefect imported")
            if with_mlflow:
                warm_store()
                timeline.mark("warm: mlflow store open")
        except Exception:  # noqa: BLE001 - the build's own calls report what is wrong
            pass
        finally:
            if collecting:
                gc.enable()

    global _warming
    with_prefect, with_mlflow = prefect, mlflow
    _warming = threading.Thread(target=work, name="trtforge-warm", daemon=True)
    _warming.start()


def warm_store() -> None:
    """Import MLflow and open the tracking store when it exists (a new one is made by the build's run, not here: a
    build stopped by bad input leaves no file). Errors are left for the real calls to report."""
    from flows.local.locks import named_lock

    try:
        uri = tracking_uri()
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
            import mlflow.store.model_registry.sqlalchemy_store  # noqa: F401
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
            from mlflow.tracking import MlflowClient  # noqa: F401
            return
        c = client()
        with named_lock(Path(uri), "mlflow-store"):  # a new store creates its tables: one build at a time
            c._tracking_client.store  # noqa: B018  (MLflow caches the store per URI)
        c._get_registry_client().store  # noqa: B018
    except Exception:  # noqa: BLE001
        pass


_warming = None  # the thread warm() started


def warmed() -> None:
    """Wait for warm()'s imports before this thread imports from the same libraries: two threads importing one
    package at once see it partially initialized ("cannot import name 'SettingsContext' from partially initialized
    module 'prefect.context'", seen opening builds' output)."""
    if _warming is not None:
        _warming.join()


def _quiet() -> None:
    for name in ("alembic", "mlflow", "urllib3", "httpx", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)


def client():
    from mlflow.tracking import MlflowClient

    _quiet()
    uri = tracking_uri()
    seed_store(uri)
    return MlflowClient(uri)


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


def _rest_auth() -> dict[str, str]:
    """The credentials MLflow's own client sends to a tracking server (its basic-auth app, or a token)."""
    import base64

    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _rest_run(uri: str, run_id: str) -> dict | None:
    import urllib.parse
    import urllib.request

    url = f"{uri.rstrip('/')}/api/2.0/mlflow/runs/get?{urllib.parse.urlencode({'run_id': run_id})}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_rest_auth()), timeout=10) as r:
            run = json.loads(r.read())["run"]
    except (OSError, ValueError, KeyError):
        return None
    info = run["info"]
    return {"status": info.get("status"), "start_time": int(info.get("start_time", 0)),
            "deleted": info.get("lifecycle_stage") != "active",
            "tags": {t["key"]: t["value"] for t in run.get("data", {}).get("tags", [])}}


LEASE_SECONDS = 900  # a RUNNING run whose build has not reported for this long (on any host) was killed


def end_orphans(experiment_id: str) -> list[str]:
    """Runs left RUNNING by a build that died (killed) end FAILED: on this host when its process is gone, on any host
    sharing the tracking store when its heartbeat (`trtforge.heartbeat`, ms, renewed while it logs) is older than
    LEASE_SECONDS."""
    import time

    from flows.cache import pid_alive

    c = client()
    host, now = socket.gethostname(), time.time() * 1000
    ended = []
    for run in c.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=200):
        t = run.data.tags
        beat = float(t.get("trtforge.heartbeat") or run.info.start_time or now)
        dead_here = t.get("trtforge.host") == host and t.get("trtforge.pid", "").isdigit() and not pid_alive(int(t["trtforge.pid"]))
        if dead_here or now - beat > LEASE_SECONDS * 1000:
            why = "killed" if dead_here else f"no word from host {t.get('trtforge.host', '?')} for {LEASE_SECONDS} s"
            c.set_tag(run.info.run_id, "status", "failed")
            c.set_tag(run.info.run_id, "failure", f"the build process ended before the run was complete ({why})")
            c.set_terminated(run.info.run_id, status="FAILED")
            ended.append(run.info.run_id)
    return ended


NOTE = "mlflow.note.content"  # the run's description in the UI (markdown)


def note(summary: dict) -> str:
    """The run's description: the build's verdict, so that a run reads at a glance in the UI."""
    lines = [f"**{summary['status']}**: {summary['model']} → {summary['target']} {summary['precision']}"]
    if summary.get("error"):
        lines.append(summary["error"].splitlines()[0])
    m = summary.get("metrics", {})
    if summary.get("verdict"):
        lines.append(f"accuracy: {summary['verdict']}")
    elif "cosine_min" in m:
        lines.append(f"accuracy: cosine_min {m['cosine_min']:.6f}")
    engines = summary.get("engines") or []
    if engines:
        lines.append(f"engines: {len(engines)}, {sum(e['bytes'] for e in engines) / 1e6:.1f} MB")
    return "\n\n".join(lines)[:5000]


def end_run(run_id: str, ok: bool, failure: BaseException | str | None = None) -> None:
    """The last word on a build's run, once its result is published (or not): the `status` tag, then the run ended
    FINISHED or FAILED with this moment as its end time; a failure is added to its description."""
    import time

    c = client()
    if failure is not None:
        c.set_tag(run_id, "failure", failure_text(failure))
        said = c.get_run(run_id).data.tags.get(NOTE, "")
        c.set_tag(run_id, NOTE, (f"{said}\n\n" if said else "") + f"**failed**: {failure_text(failure)}"[:5000])
    c.set_tag(run_id, "status", "ok" if ok and failure is None else "failed")
    c.set_terminated(run_id, status="FINISHED" if ok and failure is None else "FAILED", end_time=int(time.time() * 1000))


def failure_text(failure: BaseException | str) -> str:
    """The `failure` tag of a run whose result did not make it."""
    from tasks.common import cause

    return (f"tracking failed: {type(failure).__name__}: {cause(failure)}" if isinstance(failure, BaseException)
            else str(failure))[:5000]


def run_tags(summary: dict, owner: dict, provenance: dict[str, str], versions: dict[str, str]) -> dict:
    """A build's run tags: model, target, precision, who runs it, provenance, library versions, the data sets, the
    metrics that are words, the description (its verdict) and, per cached stage, the run that measured it."""
    from flows.context import origin_text  # a cached stage's numbers were measured by another run: say which

    tags = {"model": summary["model"], "target": summary["target"], "precision": summary["precision"],
            **owner, "cache_key": summary["cache_key"],
            **{f"trtforge.{k}": v for k, v in provenance.items()},
            **{f"version.{k}": v for k, v in versions.items()},
            **{f"{k}.data": f"{d.get('samples')} samples: {d.get('source', '')}"[:5000]
               for k, d in summary.get("data", {}).items()},  # what calibrated, judged the search, validated
            **{k: v for k, v in summary.get("metrics", {}).items() if isinstance(v, str)},
            NOTE: note(summary)}
    tags.update({f"cached_from.{stage}": origin_text(s["cached_from"])
                 for stage, s in summary["stages"].items() if s.get("cached_from")})
    return tags


def run_metrics(summary: dict) -> dict[str, float]:
    """A build's finite numeric metrics (dicts of numbers such as flops_share as "flops_share.fp16") and each stage's
    seconds and peak resident memory."""
    flat = {}
    for k, v in summary.get("metrics", {}).items():
        flat.update({f"{k}.{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {k: v})
    metrics = {k: float(v) for k, v in flat.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(float(v)) != float("inf")}
    metrics.update({f"stage_seconds.{st}": float(s["seconds"]) for st, s in summary["stages"].items()
                    if s.get("seconds") is not None})
    metrics.update({f"stage_peak_rss_mib.{st}": float(s["peak_rss_mib"]) for st, s in summary["stages"].items()
                    if s.get("peak_rss_mib") is not None})
    return metrics


def log_build(*, experiment: str, summary: dict, params: dict[str, str], resolved_yaml: str, out_dir: Path,
              engine_files: list[Path], versions: dict[str, str], build_id: str, provenance: dict[str, str],
              tolerance: float | None = None, started: float | None = None, pid: int | None = None) -> dict[str, str]:
    """Log a finished build as a run that spans it: created with the build's start time (`started`, epoch seconds).
    Everything is logged first, then the engines are registered; the caller publishes the result and then ends the
    run (`end_run`: the `status` tag and FINISHED/FAILED with the build's end time), so a run is never `ok` or FINISHED
    before its engines are published and its registry version exists. A failure here ends it FAILED with the reason.
    A retry of the same build (same `build_id`) continues its run and reuses a version already registered for it."""
    import time

    from mlflow.entities import Metric, Param, RunTag

    uri = use_experiment(experiment)
    c = client()
    exp = c.get_experiment_by_name(experiment)
    end_orphans(exp.experiment_id)
    name = f"{summary['model']}-{summary['target']}-{summary['precision']}"
    ok = summary["status"] == "ok"
    now_ms = lambda: int(time.time() * 1000)  # noqa: E731
    # the build's process (`pid`: the caller's when another process logs for it, flows/local/tracker.py): a run it
    # leaves RUNNING is an orphan once that process is gone (end_orphans)
    owner = {"trtforge.build_id": build_id, "trtforge.pid": str(pid or os.getpid()), "trtforge.host": socket.gethostname(),
             "trtforge.heartbeat": str(now_ms())}
    again = c.search_runs([exp.experiment_id], f"tags.`trtforge.build_id` = '{build_id}'", max_results=1)
    if again:
        run = again[0]
        c.update_run(run.info.run_id, status="RUNNING")
    else:
        run = c.create_run(exp.experiment_id, start_time=int((started or time.time()) * 1000), tags=owner, run_name=name)
    rid = run.info.run_id

    def beat() -> None:
        c.set_tag(rid, "trtforge.heartbeat", str(now_ms()))

    try:
        tags, metrics = run_tags(summary, owner, provenance, versions), run_metrics(summary)
        ts = now_ms()
        items = ([RunTag(k, str(v)) for k, v in tags.items()], [Param(k, v) for k, v in params.items()],
                 [Metric(k, v, ts, 0) for k, v in metrics.items()])
        if not again:  # params are written once per run (a retry has them)
            for i in range(0, max(len(items[1]), 1), 100):  # MLflow takes at most 100 params per batch
                c.log_batch(rid, params=items[1][i:i + 100])
        c.log_batch(rid, metrics=items[2], tags=items[0])
        for f in engine_files:
            c.log_artifact(rid, str(f), artifact_path="engine")
            beat()
        c.log_text(rid, resolved_yaml, "config.yaml")
        for f in sorted(out_dir.glob("*")):
            if f.is_file() and f.suffix in (".json", ".html", ".png", ".txt") and f.name not in ("summary.json", "report.html"):
                c.log_artifact(rid, str(f), artifact_path="reports")
        c.log_artifact(rid, str(out_dir / "summary.json"))
        if (out_dir / "report.html").is_file():
            c.log_artifact(rid, str(out_dir / "report.html"))
        beat()
        reg = None
        if ok:
            from flows.registry import register_engines

            reg = register_engines(c, c.get_run(rid), summary, summary["cache_key"], versions["backend"], tolerance)
            c.set_tag(rid, "registry", json.dumps(reg))
    except Exception as e:
        end_run(rid, ok=False, failure=e)
        raise
    out = {"run_id": rid, "experiment_id": exp.experiment_id, "tracking_uri": uri, "artifact_uri": run.info.artifact_uri}
    if reg is not None:
        out["registry"] = reg
    return out
