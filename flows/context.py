"""What a build carries from stage to stage: typed records (what preflight found, the data split, the build's
identity) and the BuildContext that runs a stage, serves it from the content-addressed cache and records its status."""
from __future__ import annotations

import contextlib
import hashlib
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from tasks.data import DataSplit
from tasks.common import STAGE_LIBRARIES, library_versions, merge_deps
from tasks.common import TrtforgeError
from tasks.common import StageResult

TRTFORGE_VERSION = "0.1.0"


def _code_fingerprint() -> str:
    """Hash of the stage code (every module under tasks/, subpackages included, and the flows modules that shape stage
    outputs): part of every cache key, so a changed conversion, calibration or check never serves an output made by
    the old code (like Prefect's TASK_SOURCE policy)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve()
    tasks = here.parents[1] / "tasks"
    files = sorted(tasks.rglob("*.py")) + [here, here.with_name("stages.py"), here.with_name("runners.py")]
    for f in files:
        h.update(str(f.relative_to(here.parents[1])).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


CODE = _code_fingerprint()


@dataclass
class BuildInputs:
    """What preflight found out about a build before any heavy step."""
    backend: Any  # tasks.trt.backend.Backend
    inputs: list  # tasks.graph.models.TensorInfo of the model's remaining inputs
    outputs: list
    profiles: list[dict]
    rules: Any  # tasks.data.profiles.ShapeRules
    search: list[Path]  # where relative model sources resolve (the user's config dir)
    prequantized: dict | None  # the quantization the model arrived with (Q/DQ, dynamic, QLinear), else None
    data: DataSplit  # calibration / search / validation sets
    traffic: Any = None  # (tasks.data.traffic.Traffic, Proposal) when model.traffic is set
    memory_estimate: Any = None  # tasks.common.memory.Estimate: the lower bound checked against the budget
    warnings: list[str] = field(default_factory=list)  # what preflight found worth saying (said by the export stage)
    resident: int = 0  # bytes the build's processes held when preflight began (part of the memory bound)


@dataclass
class BuildIdentity:
    """Who this build is: its cache key, a unique id, and how a scheduled rebuild re-resolves it."""
    cache_key: str
    build_id: str
    config_dir: str = ""
    overrides: str = "null"  # JSON list of the overrides
    tolerance: float | None = None  # rebuild: how much worse than the last good version a new one may validate
    started: float | None = None  # when the build began (epoch seconds): the MLflow run's start time


class Skip(Exception):
    """A stage that does not apply, or cannot run on this host; the message is the reason."""


@dataclass
class BuildContext:
    cfg: DictConfig
    inputs: BuildInputs
    identity: BuildIdentity
    cache: Any  # flows.cache.StageCache
    results: dict[str, StageResult] = field(default_factory=dict)
    stages: dict[str, dict] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    failed: str | None = None
    error: TrtforgeError | None = None
    show_progress: bool = True
    on_stage: Callable[[str, dict], None] | None = None
    origin: dict[str, Any] = field(default_factory=dict)  # this run (e.g. the flow run), stored with what it computes
    computed: list[tuple[str, str]] = field(default_factory=list)  # (cache entry, key) computed by this run
    deps: dict = field(default_factory=dict)  # files read and libraries used by every stage result (summary "inputs")
    fp16_search: bool = False  # fp16: the build searches the nodes to keep fp32 (set once validate missed the budget)
    memory: Any = None  # tasks.common.memory.MemoryWatch: each stage's peak resident memory, the budget it stays within

    @property
    def backend(self):
        return self.inputs.backend

    @property
    def data(self) -> DataSplit:
        return self.inputs.data

    def c(self, key: str) -> Any:
        """A config value as plain Python (dicts and lists for sections)."""
        v = OmegaConf.select(self.cfg, key)
        return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v

    def warn(self, stage: str, text: str) -> None:
        warnings = self.stages.setdefault(stage, {}).setdefault("warnings", [])
        if text not in warnings:
            warnings.append(text)

    def cached(self, stage: str, parts: dict, fn: Callable[[Path], StageResult], entry: str | None = None,
               data: bool = False) -> StageResult:
        """Serve a stage's output from the content-addressed cache, or compute and publish it. A stage whose every
        lookup hit reports `cached`. `entry` names the cache folder when a stage keeps several (calibrate). The key
        holds the versions of the libraries that shape the stage's output (`data`: also those that make its inputs);
        the entry records the files the stage read, and is served only while they are unchanged."""
        entry = entry or stage
        libraries = library_versions(STAGE_LIBRARIES[stage] + (STAGE_LIBRARIES["data"] if data else ()))
        key = self.cache.key(entry, {"trtforge": TRTFORGE_VERSION, "code": CODE, "libraries": libraries, **parts})
        hit = self.cache.get(entry, key)
        hits = self.stages.setdefault(stage, {}).setdefault("_hits", [])
        hits.append(hit is not None)
        if hit is not None:
            self.stages[stage].setdefault("_origins", []).append(hit.origin or {})
        else:
            if (entry, key) in self.cache.stale:  # same config, but a file it read or a library it used changed
                self.stages[stage]["reason"] = f"recomputed: {self.cache.stale[(entry, key)]} since the cached result"
            self.computed.append((entry, key))

            def work(d: Path) -> StageResult:  # with a record of the data it made: a cached result needs none of it
                r = fn(d)
                made = self.data.made_records()
                if made:
                    r.details["data_records"] = made
                return r
            hit = self.cache.run(entry, key, work, origin=self.origin)
        self.data.remember(hit.details.get("data_records") or {})
        self.deps = merge_deps(self.deps, hit.deps)
        return hit

    def run(self, name: str, fn: Callable[["BuildContext"], StageResult | None]) -> StageResult | None:
        """Run one stage: ok / cached / skipped (with reason) / failed; after a failure the rest are skipped."""
        entry = self.stages.setdefault(name, {})
        t0 = time.perf_counter()
        if self.failed:
            entry.update(status="skipped", seconds=0.0, reason=f"the {self.failed} stage failed")
        else:
            try:
                with self.memory.stage(name) if self.memory is not None else contextlib.nullcontext():
                    result = fn(self)
                hits = entry.get("_hits")
                entry.setdefault("status", "cached" if hits and all(hits) else "ok")
                if hits and any(hits) and not all(hits):
                    entry["reason"] = f"partly from the cache ({sum(hits)} of {len(hits)} outputs)"
                origins = entry.get("_origins")
                if origins:  # the oldest result served: when, where and in which run it was measured
                    entry["cached_from"] = min(origins, key=lambda o: o.get("at", ""))
                if result is not None:
                    self.results[name] = result
                    self.metrics.update(result.metrics)
            except Skip as s:
                entry.update(status="skipped", reason=str(s))
            except TrtforgeError as e:
                entry.update(status="failed", reason=e.render())
                res = getattr(e, "result", None)
                if res is not None:
                    self.results[name] = res
                    self.metrics.update(res.metrics)
                self.failed, self.error = name, e
            except Exception as e:  # a bug or an unwrapped library error: report it, keep the traceback
                entry.update(status="failed", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
                self.failed, self.error = name, TrtforgeError(f"{type(e).__name__}: {e}", stage=name)
            entry["seconds"] = round(time.perf_counter() - t0, 3)
            if self.memory is not None and self.memory.stage_peak_mib(name) is not None:
                entry["peak_rss_mib"] = self.memory.stage_peak_mib(name)
        entry.pop("_hits", None)
        entry.pop("_origins", None)
        if self.on_stage:
            self.on_stage(name, entry)
        return self.results.get(name)


def origin_text(origin: dict) -> str:
    """`cached from …` wording for a cache entry's origin (CLI, MLflow tags)."""
    if not origin.get("at"):
        return "cached (made before trtforge recorded when and where)"
    run = f" by MLflow run {origin['mlflow_run']}" if origin.get("mlflow_run") else \
        f" by flow run {origin['run']}" if origin.get("run") else ""
    return f"cached from {origin['at']} on {origin.get('host', '?')}{run}"


@contextlib.contextmanager
def sample_progress(description: str, show: bool):
    """A Rich progress bar over calibration samples (on stderr); yields the per-sample callback."""
    if not show:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)
