"""`python -m flows.rebuild [rebuild_out=PATH] [tolerance=X] [experiment=NAME] [farm=true]`: one pass of the scheduled
rebuild (farm=true: the stale builds run on the build farm, flows/farm.py).

For every (model, target, precision) with an ok run in the tracking store: re-resolve its config as it stands
now (conf/ and the --config-dir and overrides the run recorded), rebuild only when the build's key changed (model
content, resolved config, data, stage code, backend version), and never move the registry alias to an engine that
validates worse than the current one by more than `tolerance` (conf/rebuild.yaml).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from flows.config import CONF_DIR
from flows.env import env_defaults

env_defaults()

SETTINGS = CONF_DIR / "rebuild.yaml"


def settings(**overrides: Any) -> dict:
    from omegaconf import OmegaConf

    s = OmegaConf.to_container(OmegaConf.load(SETTINGS), resolve=True)
    unknown = set(overrides) - set(s) - {"rebuild_out"}
    if unknown:
        from tasks.common import ConfigError
        raise ConfigError(f"unknown rebuild option {sorted(unknown)[0]!r}",
                          fix=f"use {', '.join(sorted(s) + ['rebuild_out'])} (see {SETTINGS})")
    return {**s, "rebuild_out": None, **overrides}


def tracked(experiment: str) -> list:
    """The newest ok run per (model, target, precision), or the run of the version its alias points at."""
    from flows.registry import current
    from flows.tracking import client

    c = client()
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    latest: dict[tuple, Any] = {}
    for run in c.search_runs([exp.experiment_id], "tags.status = 'ok'", order_by=["attributes.start_time DESC"],
                             max_results=5000):
        t = run.data.tags
        latest.setdefault((t.get("model"), t.get("target"), t.get("precision")), run)
    out = []
    for (m, t, p), run in sorted(latest.items()):
        mv = current(c, m, t, p)
        if mv is not None and mv.run_id and mv.run_id != run.info.run_id:
            run = c.get_run(mv.run_id)
        out.append(run)
    return out


def recorded_overrides(run) -> tuple[list[str], str | None]:
    t = run.data.tags
    ov = json.loads(t.get("trtforge.overrides") or "null")
    if ov is None:  # a run logged without its overrides: its config groups
        ov = [f"model={t['model']}", f"target={t['target']}", f"precision={t['precision']}"]
    return [o for o in ov if not o.startswith("summary_out=")], t.get("trtforge.config_dir") or None


def rebuild_pass(rebuild_out: str | None = None, tolerance: float | None = None, experiment: str | None = None,
                 log=print, farm: bool | None = None) -> dict:
    """`farm` (default: conf/rebuild.yaml's): a stale build is submitted to the build farm (flows/farm.py) and waited
    for, instead of built here; the check of what is stale stays here."""
    from flows.build import run_build
    from flows.cache import build_key
    from flows.config import compose_config
    from flows.farmship import KEY_TAG, MANIFEST_TAG
    from tasks.common import TrtforgeError

    s = settings()
    tolerance = s["tolerance"] if tolerance is None else tolerance
    farm = truthy(s["farm"]) if farm is None else farm
    report: dict[str, Any] = {"checked": 0, "rebuilt": [], "fresh": [], "failed": []}
    for run in tracked(experiment or s["experiment"]):
        t = run.data.tags
        item = {"model": t["model"], "target": t["target"], "precision": t["precision"], "run_id": run.info.run_id}
        name = f"{item['model']} {item['target']} {item['precision']}"
        report["checked"] += 1
        overrides, config_dir = recorded_overrides(run)
        try:
            cfg = compose_config(overrides, config_dir)
            key = build_key(cfg, config_dir)
            farm_built = MANIFEST_TAG in t  # (its cache_key is the worker's, computed on the files it fetched)
            stale = ("its config or content changed" if key != t.get(KEY_TAG if farm_built else "cache_key") else
                     shipped_changed(run, cfg, config_dir) if farm_built else inputs_changed(run, cfg))
            if stale is None:
                report["fresh"].append(item)
                log(f"fresh    {name}")
                continue
            if farm:
                from flows.farm import run_on_farm
                summary = run_on_farm(overrides, config_dir, tolerance=tolerance)
            else:
                summary = run_build(cfg, config_dir, show_progress=False, overrides=overrides, tolerance=tolerance)
        except TrtforgeError as e:
            report["failed"].append({**item, "reason": e.render()})
            log(f"failed   {name}: {e.render().splitlines()[0]}")
            continue
        new = {**item, "run_id": summary.get("mlflow", {}).get("run_id"), "previous_run_id": run.info.run_id}
        reg = summary.get("mlflow", {}).get("registry") or registry_of(new["run_id"])
        if summary["status"] != "ok":
            reason = summary.get("error") or "a stage failed"
            report["failed"].append({**new, "reason": reason})
            log(f"failed   {name}: {reason.splitlines()[0]}")
        elif reg and not reg.get("promoted", True):
            report["failed"].append({**new, "reason": reg["reason"], "version": reg["version"]})
            log(f"failed   {name}: {reg['reason']}")
        else:
            report["rebuilt"].append({**new, **({"version": reg["version"], "alias": reg["alias"]} if reg else {})})
            log(f"rebuilt  {name}" + (f": version {reg['version']} is now @{reg['alias']}" if reg else ""))
    if rebuild_out:
        from tasks.common import write_json
        from flows.local.private import for_user

        for_user(write_json(rebuild_out, report))
    return report


def shipped_changed(run, cfg, config_dir: str | None) -> str | None:
    """A farm build: what it was shipped (every file it read that the user supplies, flows/farmship.py) against those
    files now; None when they are the same."""
    from flows.farmship import MANIFEST_TAG, collect, manifest_hash, manifest_of

    if manifest_hash(manifest_of(collect(cfg, config_dir))) != run.data.tags[MANIFEST_TAG]:
        return "a file it was shipped to the farm changed"
    return None


def truthy(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")


def inputs_changed(run, cfg) -> str | None:
    """What changed behind an unchanged config since the run built it (a file it read: external weights, a checkpoint,
    a module; a library it used), from the published summary here or the run's own summary.json; None if nothing."""
    import tempfile

    from flows.cache import result_dir
    from tasks.common import changed

    local = result_dir(cfg) / "summary.json"
    try:
        s = json.loads(local.read_text())
        if s.get("mlflow", {}).get("run_id") != run.info.run_id:
            raise OSError("another run's result")
    except (OSError, json.JSONDecodeError):
        from mlflow.tracking import MlflowClient

        with tempfile.TemporaryDirectory() as tmp:
            try:
                s = json.loads(Path(MlflowClient().download_artifacts(run.info.run_id, "summary.json", tmp)).read_text())
            except Exception:  # noqa: BLE001 - no summary to check against: rebuild rather than trust
                return "the run's summary.json cannot be read"
    return changed(s.get("inputs"))


def registry_of(run_id: str | None) -> dict | None:
    """The registry outcome a run recorded (for a result that was already up to date)."""
    if not run_id:
        return None
    from flows.tracking import client

    raw = client().get_run(run_id).data.tags.get("registry")
    return json.loads(raw) if raw else None


def main(argv: list[str] | None = None) -> int:
    import os

    from tasks.common import ConfigError, TrtforgeError

    args = sys.argv[1:] if argv is None else argv
    try:
        bad = [a for a in args if "=" not in a]
        if bad:
            raise ConfigError(f"{bad[0]!r} is not key=value", fix="e.g. python -m flows.rebuild rebuild_out=rebuild.json")
        kv = dict(a.split("=", 1) for a in args)
        opts = settings(**kv)
        tol = float(opts["tolerance"])
        r = rebuild_pass(opts["rebuild_out"], tol, opts["experiment"], farm=truthy(opts["farm"]))
    except TrtforgeError as e:
        if os.environ.get("TRTFORGE_TRACEBACK"):
            raise
        print(f"trtforge: error: {e.render()}", file=sys.stderr)
        return e.exit_code
    print(f"checked {r['checked']}: {len(r['rebuilt'])} rebuilt, {len(r['fresh'])} fresh, {len(r['failed'])} failed")
    return 1 if r["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
