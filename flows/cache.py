"""Content-addressed stage outputs: key = stage + stage config + input hashes + backend version + target.

An entry is a folder `<cache_dir>/<stage>/<key>/` with the stage's files and `result.json`; it is written
in a temporary folder and renamed into place, so a reader never sees half an entry.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from tasks.util import StageResult, sha256_json, write_json

CACHE_FORMAT = 1


class StageCache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()

    def key(self, stage: str, parts: dict) -> str:
        return sha256_json({"stage": stage, "format": CACHE_FORMAT, **parts})

    def entry(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def get(self, stage: str, key: str) -> StageResult | None:
        d = self.entry(stage, key)
        meta = d / "result.json"
        if not meta.is_file():
            return None
        try:
            data = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        files = {k: d / v for k, v in data["files"].items()}
        if not all(p.exists() for p in files.values()):
            return None
        return StageResult(files=files, metrics=data["metrics"], details=data["details"])

    def run(self, stage: str, key: str, fn: Callable[[Path], StageResult]) -> StageResult:
        """Run fn(workdir) and publish its files atomically under the key; return the published result."""
        tmp = self.root / ".tmp" / f"{stage}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir(parents=True)
        try:
            result = fn(tmp)
            rel = {}
            for name, p in result.files.items():
                p = Path(p)
                if tmp not in p.parents:  # a stage may name files outside its workdir: copy them in
                    shutil.copy2(p, tmp / p.name)
                    p = tmp / p.name
                rel[name] = str(p.relative_to(tmp))
            write_json(tmp / "result.json", {"files": rel, "metrics": result.metrics, "details": result.details})
            final = self.entry(stage, key)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, final)
            except OSError:  # another build published the same key first: theirs is identical
                shutil.rmtree(tmp, ignore_errors=True)
            cached = self.get(stage, key)
            assert cached is not None
            return cached
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
