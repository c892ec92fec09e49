"""Content-addressed stage outputs: key = stage + stage config + input hashes + backend version + target.

An entry is a folder `<cache_dir>/<stage>/<key>/` with the stage's files and `result.json` (with their sha256,
checked on every read); it is written in a temporary folder and renamed into place under an exclusive lock per
entry, so a reader never sees half an entry and two identical builds compute it once. Temporary folders of
processes that died are swept.

Also here: the whole build's key (computed before any server starts) and the published result folder,
swapped in by replacing one symlink atomically.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import uuid
from contextvars import ContextVar
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from flows.local.locks import locked, named_lock, pid_alive  # noqa: F401  (named_lock: used by flows)
from flows.local.private import for_user
from tasks.common import changed, merge_deps, recording
from tasks.common import StageResult, sha256_file, sha256_json, write_json

CACHE_FORMAT = 2


def temp_name(prefix: str) -> str:
    """`<prefix>.tmp-<pid>-<random>`: the pid lets a later process sweep it once its writer is gone."""
    return f"{prefix}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_dead_temps(folder: Path, prefix: str = "") -> list[Path]:
    """Remove `<prefix>.tmp-<pid>-*` folders and links whose writing process no longer exists."""
    gone = []
    if not folder.is_dir():
        return gone
    for d in folder.glob(f"{prefix}*.tmp-*"):
        try:
            pid = int(d.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except (IndexError, ValueError):
            continue
        if not pid_alive(pid):
            if d.is_symlink() or d.is_file():
                d.unlink(missing_ok=True)
            else:
                shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


class StageCache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.stale: dict[tuple[str, str], str] = {}

    def key(self, stage: str, parts: dict) -> str:
        return sha256_json({"stage": stage, "format": CACHE_FORMAT, **parts})

    def entry(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def get(self, stage: str, key: str) -> StageResult | None:
        """The entry, or None when there is none, it is damaged, or a file it read or a library it used has changed
        since (then `self.stale[(stage, key)]` says what)."""
        d = self.entry(stage, key)
        meta = d / "result.json"
        if not meta.is_file():
            return None
        try:
            data = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        files = {k: d / v for k, v in data["files"].items()}
        digests = data.get("sha256", {})
        if not all(p.is_file() and sha256_file(p) == digests.get(k) for k, p in files.items()):
            shutil.rmtree(d, ignore_errors=True)  # damaged or tampered with: recompute
            return None
        why = changed(data.get("deps"))
        if why:  # computed from inputs that have changed since: recompute (the new entry replaces it)
            self.stale[(stage, key)] = why
            return None
        return StageResult(files=files, metrics=data["metrics"], details=data["details"], origin=data.get("origin"),
                           deps=data.get("deps") or {})

    def run(self, stage: str, key: str, fn: Callable[[Path], StageResult], origin: dict | None = None) -> StageResult:
        """Run fn(workdir) and publish its files atomically under the key; return the published result.
        Under the entry's lock: an identical build waits here, then reuses what the first one published.
        The entry records when and on what host it was computed (and `origin`, e.g. the run), so a hit can say so."""
        with locked(self.root / ".locks" / f"{stage}-{key}.lock"):
            hit = self.get(stage, key)
            return hit if hit is not None else self._compute(stage, key, fn, origin)

    def annotate(self, stage: str, key: str, origin: dict) -> None:
        """Add to an entry's origin what is known only later (the MLflow run that computed it)."""
        with locked(self.root / ".locks" / f"{stage}-{key}.lock"):
            meta = self.entry(stage, key) / "result.json"
            try:
                data = json.loads(meta.read_text())
            except (OSError, json.JSONDecodeError):
                return
            data["origin"] = {**(data.get("origin") or {}), **origin}
            write_json(meta, data)
            for_user(meta)

    def _compute(self, stage: str, key: str, fn: Callable[[Path], StageResult], origin: dict | None) -> StageResult:
        remove_dead_temps(self.root / ".tmp")
        tmp = self.root / ".tmp" / temp_name(stage)
        tmp.mkdir(parents=True)
        try:
            with recording(exclude=[self.root]) as reads:  # every file the stage reads, beyond its cache inputs
                result = fn(tmp)
            rel = {}
            for name, p in result.files.items():
                p = Path(p)
                if tmp not in p.parents:  # a stage may name files outside its workdir: copy them in
                    shutil.copy2(p, tmp / p.name)
                    p = tmp / p.name
                rel[name] = str(p.relative_to(tmp))
            made = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
                    **(origin or {})}
            write_json(tmp / "result.json", {"files": rel, "metrics": result.metrics, "details": result.details,
                                             "sha256": {k: sha256_file(tmp / v) for k, v in rel.items()},
                                             "origin": made, "deps": merge_deps(reads.record(), result.deps)})
            for_user(tmp)  # (the user's umask, like every result: flows/local/private.py)
            final = self.entry(stage, key)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # a damaged entry (its files failed the hash check)
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            cached = self.get(stage, key)
            assert cached is not None
            return cached
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


# the stage cache a build uses: this machine's (the default), or one a farm worker sets for its build (flows/farmstore.py)
_shared: ContextVar[Callable[[str], StageCache] | None] = ContextVar("trtforge_shared_cache", default=None)


def stage_cache(root: str | os.PathLike) -> StageCache:
    make = _shared.get()
    return StageCache(root) if make is None else make(root)


@contextlib.contextmanager
def shared_cache(make: Callable[[str], StageCache]):
    """Builds inside the block use `make(cache_dir)` for their stage cache (the farm's shared cache)."""
    token = _shared.set(make)
    try:
        yield
    finally:
        _shared.reset(token)


# --- the whole build: its key, and the published result folder ----------------------------------------------

RUNTIME_KEYS = ("out_dir", "cache_dir", "summary_out", "memory_budget_mib")  # where things go, how much memory: not what is built


def build_key(cfg: Any, config_dir: str | None = None) -> str:
    """Everything a build's result depends on, hashed cheaply (no TensorRT import, no model load, no server):
    the resolved config, the model's content, calibration/validation data and images, the stage code, the
    backend and library versions, and the GPUs of this host (validate and benchmark use them when present)."""
    from omegaconf import OmegaConf

    from flows.config import config_dir_search
    from flows.context import CODE, TRTFORGE_VERSION
    from tasks.trt import host_gpus, installed_version
    from tasks.common import all_stage_libraries
    from tasks.sources import source_fingerprint
    from tasks.data import data_hash
    from tasks.data import GENERATOR_VERSION

    c = OmegaConf.to_container(cfg, resolve=True)
    parts: dict[str, Any] = {"format": CACHE_FORMAT, "trtforge": TRTFORGE_VERSION, "code": CODE,
                             "config": {k: v for k, v in c.items() if k not in RUNTIME_KEYS},
                             "source": source_fingerprint(c["model"], config_dir_search(config_dir)),
                             "backend": installed_version(c["target"]["backend"]),
                             "libs": all_stage_libraries(),
                             "gpus": [(g.name, g.compute_capability, g.driver) for g in host_gpus()],
                             "samples": GENERATOR_VERSION}
    for key in ("calibration.data", "validation.data"):
        path = OmegaConf.select(cfg, key)
        if path:
            parts[key] = data_hash(path, key)
    labels = OmegaConf.select(cfg, "validation.labels")
    if labels and Path(labels).is_file():  # (a missing file is preflight's error to report)
        parts["validation.labels"] = sha256_file(labels)
    from tasks.accuracy import fingerprint
    metric = fingerprint(c.get("accuracy") or {}, config_dir_search(config_dir))  # a user metric's module file
    if metric:
        parts["metric"] = metric
    if (c["model"].get("traffic") or {}).get("source"):
        from tasks.data import traffic_hash
        parts["traffic"] = traffic_hash(c["model"]["traffic"]["source"], config_dir_search(config_dir))
    images = (c["model"].get("images") or {}).get("source")
    if images and not str(images).startswith("synthetic:"):
        from tasks.data import list_images
        parts["images"] = [(f.name, sha256_file(f)) for f in list_images(images, "model.images.source")]
    return sha256_json(parts)


def result_dir(cfg: Any, ok: bool = True) -> Path:
    p = cfg.precision.name
    return Path(cfg.out_dir).expanduser().resolve() / cfg.model.name / cfg.target.name / (p if ok else p + ".failed")


def new_result_dir(final: Path) -> Path:
    """A fresh folder beside `final` to write the next result in; `publish_dir` makes it current."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temps(final.parent, f".{final.name}")
    d = final.parent / temp_name(f".{final.name}")
    d.mkdir()
    return d


def publish_dir(folder: Path, final: Path) -> None:
    """Make `folder` the current result: it becomes the version folder `.<name>.v-<id>` and `final` a symlink to it,
    replaced in one atomic rename; other versions are removed. A reader sees the old result or the new one."""
    for_user(folder)  # its files follow the user's umask, whichever helper wrote them (flows/local/private.py)
    with named_lock(final, "publish"):
        version = final.parent / f".{final.name}.v-{uuid.uuid4().hex[:12]}"
        os.replace(folder, version)
        link = final.parent / temp_name(f".{final.name}.link")
        os.symlink(version.name, link)
        if final.exists() and not final.is_symlink():  # a result folder written before results were versioned
            shutil.rmtree(final)
        os.replace(link, final)
        for old in final.parent.glob(f".{final.name}.v-*"):
            if old != version:
                shutil.rmtree(old, ignore_errors=True)


def remove_result(final: Path) -> None:
    with named_lock(final, "publish"):
        if final.is_symlink():
            final.unlink()
        elif final.is_dir():
            shutil.rmtree(final, ignore_errors=True)
        for old in final.parent.glob(f".{final.name}.v-*"):
            shutil.rmtree(old, ignore_errors=True)


def published(cfg: Any, key: str) -> dict | None:
    """The published ok summary when it was built from exactly these inputs (its key, and the files and libraries it
    recorded having read and used) and its engines are intact."""
    final = result_dir(cfg)
    try:
        s = json.loads((final / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if s.get("status") != "ok" or s.get("cache_key") != key or not s.get("mlflow", {}).get("run_id"):
        return None
    if changed(s.get("inputs")):  # a file the build read (external weights, a checkpoint, ...) or a library changed
        return None
    for e in s.get("engines", []):
        f = final / e["file"]
        if not f.is_file() or f.stat().st_size != e["bytes"] or sha256_file(f) != e["sha256"]:
            return None
    s["out_dir"] = str(final)
    return s
