"""`python -m flows.compare [model=NAME] [experiment=NAME]`: the tracked builds side by side, to choose which engine
to ship. Prints one row per (model, target, precision) (its latest run) and writes `compare.html` in the working
directory; the page, its plot and the rows as JSON are also logged as a run of the experiment `<experiment>-compare`,
so the build experiment keeps exactly one run per build."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from flows.env import env_defaults

env_defaults()

from flows.tracking import _quiet, tracking_uri, use_experiment  # noqa: E402
from tasks.report import compare_html, compare_plot, compare_text  # noqa: E402

USAGE = "usage: python -m flows.compare [model=NAME] [experiment=NAME]"


def collect(experiment: str, model: str | None = None) -> list[dict[str, Any]]:
    """The latest run of each (model, target, precision) with its summary.json numbers and registry aliases."""
    from mlflow.tracking import MlflowClient

    _quiet()
    client = MlflowClient(tracking_uri())
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    flt = "tags.status != ''" + (f" and tags.model = '{model}'" if model else "")
    runs = client.search_runs([exp.experiment_id], filter_string=flt, order_by=["attributes.start_time DESC"],
                              max_results=5000)
    latest: dict[tuple, Any] = {}
    count: dict[tuple, int] = {}
    for run in runs:
        t = run.data.tags
        if not all(k in t for k in ("model", "target", "precision")):
            continue
        key = (t["model"], t["target"], t["precision"])
        count[key] = count.get(key, 0) + 1
        latest.setdefault(key, run)
    aliases = {name: registry_aliases(client, name) for name in {k[0] for k in latest}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in sorted(latest):
            rows.append(row_of(client, latest[key], count[key], aliases[key[0]], Path(tmp)))
    return rows


def row_of(client, run, runs: int, aliases: dict[str, tuple[str, str]], tmp: Path) -> dict[str, Any]:
    t, m = run.data.tags, run.data.metrics
    summary = {}
    try:
        summary = json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp))).read_text())
    except Exception:  # a run logged before summary.json existed, or whose artifacts are gone: its metrics still count
        pass
    sm = summary.get("metrics") or m
    engines = summary.get("engines")
    row = {"model": t["model"], "target": t["target"], "precision": t["precision"], "status": t.get("status"),
           "run_id": run.info.run_id, "start_time": run.info.start_time, "runs": runs,
           "cosine_min": sm.get("cosine_min"),
           "engine_bytes": sum(e["bytes"] for e in engines) if engines else None,
           # the shipped engines' build time: quantized engines report under quantized_* until the names settle
           "build_seconds": sm.get("quantized_build_seconds", sm.get("build_seconds")),
           "engine_p50_ms": sm.get("trt_p50_ms"), "flops_share": sm.get("flops_share")}
    acc = summary.get("accuracy") or {}
    if acc.get("score") is not None:  # the metric that gated this build (accuracy.metric), by name
        row.update(accuracy_metric=acc["metric"], accuracy_score=acc["score"], accuracy_passed=acc.get("passed"))
    alias = f"{t['target']}-{t['precision']}"
    if alias in aliases:
        version, run_id = aliases[alias]
        row["registry"] = f"{alias} → v{version}" + (" (this run)" if run_id == run.info.run_id else "")
    return row


def registry_aliases(client, name: str) -> dict[str, tuple[str, str]]:
    """alias -> (version, run id) of the registered model `name`; empty when there is no registry or no such model."""
    try:
        rm = client.get_registered_model(name)
        return {a: (str(v), client.get_model_version(name, str(v)).run_id) for a, v in (rm.aliases or {}).items()}
    except Exception:
        return {}


def log_compare(experiment: str, html_path: Path, plot: Path | None, rows: list[dict], model: str | None) -> str:
    import mlflow

    use_experiment(f"{experiment}-compare")
    with mlflow.start_run(run_name="compare" + (f"-{model}" if model else "")) as run:
        mlflow.set_tags({"compare.experiment": experiment, "compare.rows": str(len(rows)), **({"model": model} if model else {})})
        mlflow.log_artifact(str(html_path))
        if plot is not None:
            mlflow.log_artifact(str(plot))
        mlflow.log_text(json.dumps(rows, indent=2, default=str), "compare.json")
    return run.info.run_id


def parse(argv: list[str]) -> dict[str, str]:
    opts = {"experiment": "trtforge", "model": None}
    for a in argv:
        k, sep, v = a.partition("=")
        if a in ("-h", "--help"):
            print(USAGE)
            sys.exit(0)
        if not sep or k not in opts or not v:
            print(f"trtforge: error: unknown argument {a!r}\n  fix: {USAGE}", file=sys.stderr)
            sys.exit(2)
        opts[k] = v
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    rows = collect(opts["experiment"], opts["model"])
    source = f"{tracking_uri()} (experiment {opts['experiment']}" + (f", model {opts['model']})" if opts["model"] else ")")
    if rows:
        print(compare_text(rows))
    else:
        print(f"no tracked builds in {source}", file=sys.stderr)
    out = Path.cwd() / "compare.html"
    with tempfile.TemporaryDirectory() as tmp:
        plot = compare_plot(rows, Path(tmp) / "compare.png") if rows else None
        out.write_text(compare_html(rows, source, plot))
        if rows:
            run_id = log_compare(opts["experiment"], out, plot, rows, opts["model"])
            print(f"\ncompare.html written; logged as run {run_id} of experiment {opts['experiment']}-compare")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `| head`
        sys.exit(0)
