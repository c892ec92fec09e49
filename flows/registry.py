"""MLflow model registry of engines: one registered model per trtforge model, one version per ok build, and the
alias `<target>-<precision>` on the last good version (`models:/NAME@sm_86-fp16` downloads its engines)."""
from __future__ import annotations

from typing import Any


def alias_for(target: str, precision: str) -> str:
    return f"{target}-{precision}"


def current(client, model: str, target: str, precision: str):
    """The version the alias points at, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(model, alias_for(target, precision))
    except MlflowException:
        return None


def register_engines(client, run, summary: dict, cache_key: str, backend: str,
                     tolerance: float | None = None) -> dict[str, Any]:
    """Register an ok build's `engine/` artifacts as a new version of the model and move the alias to it.

    With `tolerance` set (scheduled rebuilds), the alias stays where it is when the new engine validates worse than
    the current one by more than the tolerance: a worse `accuracy_score` when both were judged by the same
    `accuracy.metric` (not cosine) with the same settings, else a lower `cosine_min`; the version is still registered, and the
    returned dict says why it was not promoted. A run that has a version already (a retried tracking step) keeps
    that one: one version per run."""
    from mlflow.exceptions import MlflowException

    name = summary["model"]
    try:
        client.create_registered_model(name, description=f"trtforge engines of model {name!r}; "
                                                          "alias <target>-<precision> = the last good version")
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code) and "already exists" not in str(e):
            raise
    cosine = summary.get("metrics", {}).get("cosine_min")
    tags = {"target": summary["target"], "precision": summary["precision"],
            "sha256": ",".join(e["sha256"] for e in summary["engines"]), "backend": backend, "cache_key": cache_key,
            "engines": ",".join(e["file"] for e in summary["engines"])}
    if cosine is not None:
        tags["cosine_min"] = repr(float(cosine))
    acc = summary.get("accuracy") or {}
    if acc.get("score") is not None:  # the metric that gated (accuracy.metric), its settings and its worst value
        import json
        tags.update(accuracy_metric=acc["metric"], accuracy_score=repr(float(acc["score"])),
                    accuracy_settings=json.dumps(acc.get("settings") or {}, sort_keys=True)[:5000],
                    accuracy_greater_is_better=str(bool(acc.get("greater_is_better", True))).lower())
    done = client.search_model_versions(f"name = '{name}' and run_id = '{run.info.run_id}'")
    mv = done[0] if done else \
        client.create_model_version(name, source=f"{run.info.artifact_uri}/engine", run_id=run.info.run_id, tags=tags)
    alias = alias_for(summary["target"], summary["precision"])
    out: dict[str, Any] = {"name": name, "version": int(mv.version), "alias": alias, "promoted": True}
    if tolerance is not None:
        old = current(client, name, summary["target"], summary["precision"])
        old_cos = old.tags.get("cosine_min") if old else None
        # the user's metric decides when both versions were judged by it with the same settings; else cosine_min
        why = regression(old, acc, tolerance) if old else None
        if why is None and old_cos is not None and not same_metric(old, acc) and \
                (cosine is None or float(cosine) < float(old_cos) - tolerance):
            why = f"cosine_min {cosine} < {float(old_cos)} - tolerance {tolerance}"
        if why is not None:
            out.update(promoted=False, previous=int(old.version),
                       reason=f"validates worse than version {old.version}: {why}; alias {alias} stays on version "
                              f"{old.version}")
            client.set_model_version_tag(name, mv.version, "not_promoted", out["reason"])
            return out
    client.set_registered_model_alias(name, alias, mv.version)
    return out


def same_metric(old, acc: dict) -> bool:
    """Whether the registered version was judged by the same non-cosine metric with the same settings."""
    import json

    metric, tags = acc.get("metric"), old.tags
    return bool(metric) and metric != "cosine" and tags.get("accuracy_metric") == metric and "accuracy_score" in tags \
        and tags.get("accuracy_settings") == json.dumps(acc.get("settings") or {}, sort_keys=True)[:5000]


def regression(old, acc: dict, tolerance: float) -> str | None:
    """Why the new build's accuracy metric is worse than the registered version's by more than ``tolerance`` (in the
    metric's own units), or None. Only a version judged by the same metric with the same settings compares (a changed
    metric is the user's decision); a cosine-judged pair is left to the cosine_min check."""
    import math

    if not same_metric(old, acc):
        return None
    metric, tags = acc["metric"], old.tags
    before, new = float(tags["accuracy_score"]), acc.get("score")
    higher = acc.get("greater_is_better", True)
    if new is not None and math.isfinite(float(new)) and \
            (float(new) >= before - tolerance if higher else float(new) <= before + tolerance):
        return None
    return (f"accuracy.metric={metric} scores {new} against version {old.version}'s {before} "
            f"({'higher' if higher else 'lower'} is better; tolerance {tolerance})")
