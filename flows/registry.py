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
    the current one by more than the tolerance (lower `cosine_min`); the version is still registered, and the
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
    done = client.search_model_versions(f"name = '{name}' and run_id = '{run.info.run_id}'")
    mv = done[0] if done else \
        client.create_model_version(name, source=f"{run.info.artifact_uri}/engine", run_id=run.info.run_id, tags=tags)
    alias = alias_for(summary["target"], summary["precision"])
    out: dict[str, Any] = {"name": name, "version": int(mv.version), "alias": alias, "promoted": True}
    if tolerance is not None:
        old = current(client, name, summary["target"], summary["precision"])
        old_cos = old.tags.get("cosine_min") if old else None
        if old_cos is not None and (cosine is None or float(cosine) < float(old_cos) - tolerance):
            out.update(promoted=False, previous=int(old.version),
                       reason=f"validates worse than version {old.version}: cosine_min {cosine} < {float(old_cos)} "
                              f"- tolerance {tolerance}; alias {alias} stays on version {old.version}")
            client.set_model_version_tag(name, mv.version, "not_promoted", out["reason"])
            return out
    client.set_registered_model_alias(name, alias, mv.version)
    return out
