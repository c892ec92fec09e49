"""The glue between the flow and the pure stages in tasks/: cache keys, inputs, skip rules, status."""
from __future__ import annotations

import contextlib
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from tasks import backend as trt_backend
from tasks.errors import StageError, TrtforgeError
from tasks.samples import GENERATOR_VERSION
from tasks.util import StageResult, sha256_file

TRTFORGE_VERSION = "0.1.0"


def _code_fingerprint() -> str:
    """Hash of the stage code (tasks/*.py and this module): part of every cache key, so a changed conversion,
    calibration or check never serves an output made by the old code (like Prefect's TASK_SOURCE policy)."""
    import hashlib

    h = hashlib.sha256()
    here = Path(__file__).resolve()
    for f in sorted(here.parents[1].joinpath("tasks").glob("*.py")) + [here]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


CODE = _code_fingerprint()


class Skip(Exception):
    """A stage that does not apply, or cannot run on this host; the message is the reason."""


@dataclass
class BuildContext:
    cfg: DictConfig
    facts: dict[str, Any]
    cache: Any
    results: dict[str, StageResult] = field(default_factory=dict)
    stages: dict[str, dict] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    failed: str | None = None
    error: TrtforgeError | None = None
    show_progress: bool = True
    on_stage: Callable[[str, dict], None] | None = None
    origin: dict[str, Any] = field(default_factory=dict)  # this run (e.g. the flow run), stored with what it computes
    computed: list[tuple[str, str]] = field(default_factory=list)  # (cache entry, key) computed by this run

    @property
    def backend(self):
        return self.facts["backend"]

    def c(self, key: str) -> Any:
        """A config value as plain Python (dicts and lists for sections)."""
        v = OmegaConf.select(self.cfg, key)
        return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v

    def cached(self, stage: str, parts: dict, fn: Callable[[Path], StageResult], entry: str | None = None) -> StageResult:
        """Serve a stage's output from the content-addressed cache, or compute and publish it. A stage whose every
        lookup hit reports `cached`. `entry` names the cache folder when a stage keeps several (calibrate)."""
        entry = entry or stage
        key = self.cache.key(entry, {"trtforge": TRTFORGE_VERSION, "code": CODE, **parts})
        hit = self.cache.get(entry, key)
        hits = self.stages.setdefault(stage, {}).setdefault("_hits", [])
        hits.append(hit is not None)
        if hit is not None:
            self.stages[stage].setdefault("_origins", []).append(hit.origin or {})
            return hit
        self.computed.append((entry, key))
        return self.cache.run(entry, key, fn, origin=self.origin)

    def run(self, name: str, fn: Callable[["BuildContext"], StageResult | None]) -> StageResult | None:
        """Run one stage: ok / cached / skipped (with reason) / failed; after a failure the rest are skipped."""
        entry = self.stages.setdefault(name, {})
        t0 = time.perf_counter()
        if self.failed:
            entry.update(status="skipped", seconds=0.0, reason=f"the {self.failed} stage failed")
        else:
            try:
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


def file_hash(result: StageResult, name: str) -> str:
    return result.details.get(f"{name}_sha256") or sha256_file(result.files[name])


# --- the six stages ------------------------------------------------------------------------------------------

def paddle_cache(cfg: DictConfig) -> Path:
    """Where Paddle conversions are kept (preflight reads the model's inputs from them; export reuses them)."""
    return Path(cfg.cache_dir) / "paddle"


def export(ctx: BuildContext) -> StageResult:
    from tasks.export import onnx_from_model, source_fingerprint

    m = ctx.c("model")
    parts = {"source": source_fingerprint(m, ctx.facts["search"]), "format": m["format"], "factory": m["factory"],
             "inputs": m["inputs"], "opset": m["opset"], "profiles": ctx.facts["profiles"] if m["format"] == "torch" else None,
             "dequantize_dynamic": m["dequantize_dynamic"], "asymmetric": m["asymmetric"]}
    if m["constants"]:  # bound inputs; dims every profile fixes are pinned for the folds
        parts.update(constants=m["constants"], profiles=ctx.facts["profiles"])

    def work(d: Path) -> StageResult:
        r = onnx_from_model(m, ctx.facts["profiles"], d / "model.onnx", ctx.facts["search"], paddle_cache(ctx.cfg))
        r.details["onnx_sha256"] = sha256_file(r.files["onnx"])
        return r

    r = ctx.cached("export", parts, work)
    if m["constants"]:
        warnings = ctx.stages.setdefault("export", {}).setdefault("warnings", [])
        warnings.append(f"the engine is specialised for {bound_text(m['constants'])} (model.constants): those inputs "
                        "are gone, and the fp32 reference is the model with them bound")
        warnings += [n[len("WARNING: "):] for n in r.details.get("constants", []) if n.startswith("WARNING: ")]
    return r


def bound_text(constants: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in constants.items())


def partition(ctx: BuildContext) -> StageResult:
    return _plan(ctx, ctx.c("partition"))


def _plan(ctx: BuildContext, partition_cfg: dict) -> StageResult:
    from tasks.inputs import generated_feeds
    from tasks.partition import plan_from_onnx

    onnx_r = ctx.results["export"]
    parts = {"onnx": file_hash(onnx_r, "onnx"), "partition": partition_cfg, "backend": ctx.backend.version,
             "profiles": ctx.facts["profiles"]}

    def work(d: Path) -> StageResult:
        # min/opt/max inputs per profile: running the native part on them gives the boundary tensors' profiles
        def feeds():
            return [generated_feeds(ctx.facts["inputs"], [p], 0, ctx.cfg.seed, rules=ctx.facts["shape_rules"])
                    for p in ctx.facts["profiles"]]
        return plan_from_onnx(onnx_r.files["onnx"], partition_cfg, ctx.backend, d, feeds)

    r = ctx.cached("partition", parts, work)
    for w in r.details.get("warnings", []):
        ctx.stages.setdefault("partition", {}).setdefault("warnings", []).append(w)
    return r


def _replan_without_control_flow(ctx: BuildContext, error: TrtforgeError) -> bool:
    """TensorRT can parse control flow and still fail to build it (an internal assertion, not a parser verdict).
    Then run the control-flow nodes natively, as a parser rejection would, and say so. False when that cannot help."""
    import onnx

    from tasks.graph import CONTROL_FLOW

    if not ctx.cfg.partition.control_flow_fallback:
        return False
    model = onnx.load(str(ctx.results["export"].files["onnx"]), load_external_data=False)
    present = sorted({n.op_type for n in model.graph.node if n.op_type in CONTROL_FLOW})
    pcfg = ctx.c("partition")
    if not present or set(present) <= set(pcfg["exclude_ops"]):
        return False
    if pcfg["strict"]:
        return False
    pcfg["exclude_ops"] = list(pcfg["exclude_ops"]) + [op for op in present if op not in pcfg["exclude_ops"]]
    plan = _plan(ctx, pcfg)
    for k in ("_hits", "_origins"):
        ctx.stages["partition"].pop(k, None)
    ctx.results["partition"] = plan
    ctx.metrics.update(plan.metrics)
    ctx.stages["partition"]["note"] = (
        f"re-planned after the TensorRT build failed ({error.message[:200]}): {', '.join(present)} nodes run in "
        f"ONNX Runtime (partition.control_flow_fallback=true)")
    return True


def trt_segments(ctx: BuildContext) -> list[dict]:
    """TensorRT segments with their fp32 ONNX and profiles; a fully supported model is one segment: the whole graph."""
    plan = ctx.results["partition"]
    if not plan.details.get("hybrid"):
        return [{"index": 0, "onnx": ctx.results["export"].files["onnx"], "profiles": ctx.facts["profiles"], "name": ""}]
    return [{"index": s["index"], "onnx": plan.files[f"segment{s['index']}"], "profiles": s["profiles"],
             "name": f".sg{s['index']}"} for s in plan.details["segments"] if s["kind"] == "trt"]


def prequantized(ctx: BuildContext) -> dict | None:
    """The quantization a model arrived with (export found Q/DQ or dynamic quantization ops), else None."""
    return ctx.results["export"].details.get("prequantized")


def build(ctx: BuildContext) -> StageResult:
    """The baseline engine(s), one per TensorRT segment: fp32 or fp16 graph (int8/fp8: quantized ones in calibrate)."""
    try:
        return _build_engines(ctx)
    except StageError as e:
        if not _replan_without_control_flow(ctx, e):
            raise
        return _build_engines(ctx)


def _build_engines(ctx: BuildContext) -> StageResult:
    from tasks.build import SHIPPED_METRICS, add_metrics, as_baseline, engine_from_onnx, onnx_at_precision

    t = ctx.cfg.target
    # a model that carries its own quantization is built as it is (its Q/DQ in int8, the rest fp32)
    precision, label = ("fp32", ctx.cfg.precision.name) if prequantized(ctx) else (ctx.cfg.precision.baseline,) * 2
    segs = trt_segments(ctx)
    parts = {"segments": [(sha256_file(s["onnx"]), s["profiles"]) for s in segs], "precision": precision, "label": label,
             "build": ctx.c("build"), "backend": ctx.backend.version, "compute_capability": t.compute_capability}

    def work(d: Path) -> StageResult:
        files, metrics, details = {}, {}, {"engines": []}
        for s in segs:
            stem = f"{ctx.cfg.model.name}.{t.name}.{label}{s['name']}"
            conv = onnx_at_precision(s["onnx"], precision, d / f"{stem}.onnx")
            eng = engine_from_onnx(conv.files["onnx"], d / f"{stem}.engine", s["profiles"], t.compute_capability,
                                   ctx.c("build"), ctx.backend, show_progress=ctx.show_progress)
            files[f"onnx{s['index']}"], files[f"engine{s['index']}"] = conv.files["onnx"], eng.files["engine"]
            add_metrics(metrics, eng.metrics, SHIPPED_METRICS)
            add_metrics(metrics, conv.metrics, ("convert_seconds",))
            details["engines"].append({"segment": s["index"], "engine": eng.files["engine"].name,
                                       "onnx": conv.files["onnx"].name, "sha256": eng.details["sha256"]})
            details.update(backend=eng.details["backend"], compute_capability=t.compute_capability, precision=precision)
            details.setdefault("conversion", []).append(conv.details)
        return with_precision_profile(ctx, StageResult(files=files, metrics=metrics, details=details),
                                      [files[f"onnx{s['index']}"] for s in segs], segs, d, precision)

    r = ctx.cached("build", parts, work)
    if builds_baseline(ctx):  # the cache entry is shared with the fp16/fp32 build; here it is the baseline
        r = StageResult(files=r.files, metrics=as_baseline(r.metrics), details=r.details, origin=r.origin)
    return r


def builds_baseline(ctx: BuildContext) -> bool:
    """Whether build's engines are only the baseline on the way to calibrate's quantized ones (which ship)."""
    return bool(ctx.cfg.precision.quantized) and not prequantized(ctx)


def calibrate(ctx: BuildContext) -> StageResult | None:
    """int8/fp8: the Q/DQ graph of each TensorRT segment (target-independent, cached across targets), then its engine."""
    p = ctx.cfg.precision
    if not p.quantized:
        raise Skip(f"precision {p.name} needs no calibration")
    if prequantized(ctx):
        from tasks.prequant import describe
        raise Skip(f"the model is already quantized ({describe(prequantized(ctx))})")
    from tasks.build import SHIPPED_METRICS, add_metrics, engine_from_onnx
    from tasks.calibrate import qdq_from_onnx
    from tasks.report import sensitivity_report
    from tasks.segments import run_with_intermediates

    cal_feeds, eval_feeds, data_key, record = _calibration_feeds(ctx)
    segs = trt_segments(ctx)
    plan = ctx.results["partition"].details
    c = ctx.cfg.calibration
    budget = ctx.cfg.accuracy.min_cosine
    target = min(1.0, budget + (1.0 - budget) * c.budget_margin) if c.search else None
    q_parts = {"segments": [sha256_file(s["onnx"]) for s in segs], "data": data_key, "method": c.method,
               "samples": c.samples, "precision": p.name, "min_cosine": target}

    def segment_feeds(seg: dict, feeds: list) -> list:
        if not plan.get("hybrid"):
            return feeds
        names = next(s["inputs"] for s in plan["segments"] if s["index"] == seg["index"])
        import onnx
        model = onnx.load(str(ctx.results["export"].files["onnx"]))
        return [{n: r[n] for n in names} for r in run_with_intermediates(model, names, feeds)]

    def quantize(d: Path) -> StageResult:
        files, metrics, details = {}, {"quantized_layers": 0, "fallback_layers": 0, "calibrate_cosine_min": 1.0}, []
        for s in segs:
            with sample_progress(f"calibrating ({c.method or 'default method'}, segment {s['index']})",
                                 ctx.show_progress) as on_sample:
                r = qdq_from_onnx(s["onnx"], segment_feeds(s, cal_feeds), d / f"qdq{s['index']}.onnx", method=c.method,
                                  precision=p.name, min_cosine=target, eval_feeds=segment_feeds(s, eval_feeds),
                                  workdir=d / f"work{s['index']}", on_sample=on_sample, no_layers_ok=len(segs) > 1)
            files[f"qdq{s['index']}"] = r.files["onnx"]
            for k in ("quantized_layers", "fallback_layers"):
                metrics[k] += r.metrics[k]
            metrics["calibrate_cosine_min"] = min(metrics["calibrate_cosine_min"], r.metrics["calibrate_cosine_min"])
            metrics["calibration_samples"] = r.metrics["calibration_samples"]
            details.append({"segment": s["index"], **r.details})
        if not metrics["quantized_layers"] + metrics["fallback_layers"]:
            raise StageError("no TensorRT segment of the model has a Conv/ConvTranspose/MatMul/Gemm node to quantize",
                             stage="calibrate", fix="keep this model at fp16/fp32")
        files.update(sensitivity_report(details, d))
        return StageResult(files=files, metrics=metrics, details={"segments": details})

    q = ctx.cached("calibrate", q_parts, quantize, entry="calibrate-qdq")
    t = ctx.cfg.target
    e_parts = {"qdq": [sha256_file(q.files[f"qdq{s['index']}"]) for s in segs], "profiles": [s["profiles"] for s in segs],
               "build": ctx.c("build"), "backend": ctx.backend.version, "compute_capability": t.compute_capability}

    def build_quantized(d: Path) -> StageResult:
        files, metrics, details = {}, {}, {"engines": []}
        for s in segs:
            stem = f"{ctx.cfg.model.name}.{t.name}.{p.name}{s['name']}"
            eng = engine_from_onnx(q.files[f"qdq{s['index']}"], d / f"{stem}.engine", s["profiles"], t.compute_capability,
                                   ctx.c("build"), ctx.backend, show_progress=ctx.show_progress, stage="calibrate")
            files[f"engine{s['index']}"] = eng.files["engine"]
            add_metrics(metrics, eng.metrics, SHIPPED_METRICS)  # the quantized engines ship
            details["engines"].append({"segment": s["index"], "engine": eng.files["engine"].name, "sha256": eng.details["sha256"]})
        return with_precision_profile(ctx, StageResult(files=files, metrics=metrics, details=details),
                                      [q.files[f"qdq{s['index']}"] for s in segs], segs, d, p.name)

    e = ctx.cached("calibrate", e_parts, build_quantized, entry="calibrate-engine")
    files = dict(e.files)
    files.update({f"onnx{s['index']}": q.files[f"qdq{s['index']}"] for s in segs})
    files.update({k: v for k, v in q.files.items() if k.startswith("sensitivity")})
    details = {"engines": [{**x, "onnx": q.files[f"qdq{x['segment']}"].name} for x in e.details["engines"]],
               "quantization": q.details, "eval_samples": len(eval_feeds), "data": record.as_dict()}
    return StageResult(files=files, metrics={**q.metrics, **e.metrics}, details=details)


def with_precision_profile(ctx: BuildContext, r: StageResult, graphs: list[Path], segs: list[dict], d: Path,
                           precision: str) -> StageResult:
    """Add the precision profile of the engines just built from ``graphs`` (one per segment) to ``r``."""
    from tasks.flops import precision_profile

    prof = precision_profile(graphs, [s["profiles"] for s in segs], ctx.backend, d,
                             f"{ctx.cfg.model.name} {ctx.cfg.target.name} {precision}")
    r.files.update(prof.files)
    r.metrics.update(prof.metrics)
    r.details["precision_profile"] = prof.details
    return r


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


def _calibration_feeds(ctx: BuildContext) -> tuple[list, list, dict, Any]:
    """Calibration samples and held-out samples (for the budget search and for validation when nothing else is given),
    the cache key of both, and the record of what calibrates.

    calibration.data: up to calibration.samples arrays; a quarter (at least one) is held out when there are 4 or more.
    Else the model's images recipe: calibration.samples images at the opt shape, and 3 other images held out."""
    import numpy as np

    from tasks.inputs import DataRecord, calibration_shapes, generated_feeds, heldout_shapes

    c = ctx.cfg.calibration
    data = ctx.facts.get("calibration.data")
    if data:
        n_hold = max(1, len(data) // 4) if len(data) >= 4 else 0
        cal, held = (data[:-n_hold], data[-n_hold:]) if n_hold else (data, [])
        ctx.facts["heldout"] = held
        rec = ctx.facts["calibration.data.record"]
        record = DataRecord.of(cal, "file", path=rec.path, sha256=rec.sha256, files=rec.files,
                               notes=[f"{len(held)} feeds held out for the accuracy search and validation"] if held else [])
        return cal, held or cal, {"data": ctx.facts["calibration.data.sha256"], "hold": n_hold}, record
    recipe = ctx.c("model.images")
    rng = np.random.default_rng(ctx.cfg.seed + 1000)
    rules = ctx.facts["shape_rules"]
    prof = ctx.facts["profiles"][0]
    cal_shapes = calibration_shapes(prof, c.samples, rng, rules)
    held_shapes = heldout_shapes(prof, 3, rng, rules)
    cal = [generated_feeds(ctx.facts["inputs"], [s], 0, ctx.cfg.seed + 1000 + i, recipe=recipe, offset=i)[0]
           for i, s in enumerate(cal_shapes)]
    held = [generated_feeds(ctx.facts["inputs"], [s], 0, ctx.cfg.seed + 5000 + i, recipe=recipe, offset=c.samples + i)[0]
            for i, s in enumerate(held_shapes)]
    record = DataRecord.of(cal, "images" if recipe else "random", recipe=recipe)
    return cal, held, {"recipe": recipe, "shapes": cal_shapes + held_shapes, "seed": ctx.cfg.seed,
                       "generator": GENERATOR_VERSION}, record


def _feeds(ctx: BuildContext, purpose: str) -> tuple[list, str, dict, Any]:
    """Inputs for validation: validation.data, else held-out calibration data, else the model's images recipe, else
    random inside the profiles (tied dims drawn as one, each dim on its step); the cache key; the record."""
    from tasks.inputs import DataRecord, generated_feeds

    v = ctx.cfg.validation
    if ctx.facts.get("validation.data"):
        return (ctx.facts["validation.data"], f"validation.data ({v.data})", {"data": ctx.facts["validation.data.sha256"]},
                ctx.facts["validation.data.record"])
    if ctx.facts.get("heldout"):
        rec = ctx.facts["calibration.data.record"]
        return ctx.facts["heldout"], "held-out calibration samples", {"data": ctx.facts["calibration.data.sha256"],
                                                                      "heldout": len(ctx.facts["heldout"])}, \
            DataRecord.of(ctx.facts["heldout"], "held-out calibration data", path=rec.path, sha256=rec.sha256, files=rec.files)
    recipe = ctx.c("model.images")
    rules = ctx.facts["shape_rules"]
    feeds = generated_feeds(ctx.facts["inputs"], ctx.facts["profiles"], v.samples, v.seed, recipe=recipe, rules=rules)
    src = f"images ({recipe['source']})" if recipe else "random"
    notes = [f"shapes drawn on steps {rules.inferred} inferred from the profiles (set model.shape_multiple to choose)"] \
        if rules.inferred else []
    return feeds, src, {"recipe": recipe, "samples": v.samples, "seed": v.seed, "rules": rules.as_dict(),
                        "generator": GENERATOR_VERSION}, DataRecord.of(feeds, "images" if recipe else "random",
                                                                       recipe=recipe, notes=notes)


def deliverable(ctx: BuildContext) -> StageResult:
    """The stage whose engines ship: calibrate's quantized engines when it made them, else build's."""
    cal = ctx.results.get("calibrate")
    return cal if cal is not None and any(k.startswith("engine") for k in cal.files) else ctx.results["build"]


def engines_of(r: StageResult) -> list[tuple[int, Path, Path]]:
    """(segment index, engine file, precision ONNX file) in segment order."""
    return [(e["segment"], r.files[f"engine{e['segment']}"], r.files[f"onnx{e['segment']}"]) for e in r.details["engines"]]


def engine_runner(ctx: BuildContext, engine: Path, stage: str, runners: contextlib.ExitStack, cuda_graph: bool = False):
    """An EngineRunner for one engine file (TensorRT-RTX's runtime cache kept per target in cache_dir), closed (buffers
    freed, runtime cache saved) when `runners` closes."""
    from tasks.runtime import EngineRunner, runtime_cache_file

    cache = runtime_cache_file(ctx.cfg.cache_dir, ctx.cfg.target.name, ctx.backend.version)
    return runners.enter_context(
        EngineRunner(Path(engine).read_bytes(), ctx.backend, runtime_cache=cache, cuda_graph=cuda_graph, stage=stage))


def candidate_runner(ctx: BuildContext, use_engines: bool, runners: contextlib.ExitStack | None = None,
                     stage: str = "validate"):
    """The model as it will run: the precision graph (or the engine, on a GPU) per TensorRT segment, and for a hybrid
    model the native segments in ONNX Runtime between them. Engine runners are closed with `runners`."""
    from tasks.segments import Composed, ort_runner

    r = deliverable(ctx)
    by_segment = {i: (eng, onnx) for i, eng, onnx in engines_of(r)}

    def runner_for(seg: dict):
        if seg["kind"] == "trt":
            eng, onnx = by_segment[seg["index"]]
            if use_engines:
                return engine_runner(ctx, eng, stage, runners).infer
            # ORT's full optimisation fuses Q/DQ into kernels that have no float8 version
            return ort_runner(onnx, basic=ctx.cfg.precision.name == "fp8")
        return ort_runner(ctx.results["partition"].files[f"segment{seg['index']}"])

    plan = ctx.results["partition"].details
    if plan.get("hybrid"):
        outputs = [o["name"] for o in ctx.results["export"].details["outputs"]]
        return Composed(plan["segments"], outputs, runner_for)
    return runner_for({"kind": "trt", "index": 0})


def validate(ctx: BuildContext) -> StageResult:
    from tasks.errors import AccuracyError
    from tasks.validate import spread_note, validate_onnx

    if not ctx.cfg.stages.validate:
        raise Skip("disabled (stages.validate=false)")
    ref = ctx.results["export"]
    reference = ref.files.get("reference", ref.files["onnx"])  # a pre-quantized model: as shipped, in ONNX Runtime
    reference_label = "the model as shipped" if "reference" in ref.files else "fp32"
    if ctx.cfg.model.constants:
        reference_label += f" with {bound_text(ctx.c('model.constants'))} bound (model.constants)"
    ctx.stages.setdefault("validate", {})["reference"] = reference_label
    cand = deliverable(ctx)
    cc = ctx.cfg.target.compute_capability
    gpu = trt_backend.gpu_for(cc)
    engine_reason = None if (gpu and ctx.cfg.validation.engine) else (
        "disabled (validation.engine=false)" if not ctx.cfg.validation.engine else trt_backend.no_gpu_reason(cc))
    feeds, source, feed_key, record = _feeds(ctx, "validate")
    parts = {"reference": sha256_file(reference), "candidate": [sha256_file(o) for _, _, o in engines_of(cand)],
             "plan": sha256_file(ctx.results["partition"].files["partition"]), "feeds": feed_key,
             "min_cosine": ctx.cfg.accuracy.min_cosine, "precision": ctx.cfg.precision.name,  # in the result's labels
             "engines": [sha256_file(e) for _, e, _ in engines_of(cand)] if engine_reason is None else None}

    def work(d: Path) -> StageResult:
        with contextlib.ExitStack() as runners:
            run_engine = candidate_runner(ctx, use_engines=True, runners=runners) if engine_reason is None else None
            try:
                return validate_onnx(reference, candidate_runner(ctx, use_engines=False), feeds,
                                     ctx.cfg.accuracy.min_cosine, source, d / "validation.json", engine=run_engine,
                                     engine_skip_reason=engine_reason, label=label, reference_label=reference_label,
                                     emulation=f"onnxruntime emulation of {ctx.cfg.precision.name}",
                                     engine_device=gpu and f"engine on {gpu.name} (sm {gpu.compute_capability})",
                                     reference_spread="reference" in ref.files)
            except AccuracyError as e:  # the verdict is a result too: cache it, gate below
                return e.result

    label = f"{ctx.cfg.model.name} at {ctx.cfg.precision.name}"
    r = ctx.cached("validate", parts, work)
    if r.details.get("left_out"):  # shapes the fp32 model itself fails on: a property of the model, said once
        ctx.stages.setdefault("validate", {})["warnings"] = r.details["warnings"][:1]
        record.notes.append(f"{len(r.details['left_out'])} shapes left out: the fp32 model itself fails on them")
    r.details["data"] = record.as_dict()
    if not r.details["passed"]:
        worst = min(r.details["outputs"], key=lambda n: r.details["outputs"][n]["cosine"])
        e = AccuracyError(f"output {worst!r} has cosine {r.metrics['cosine_min']:.6f} to {reference_label} "
                          f"({r.metrics['cosine_source']}), below "
                          f"accuracy.min_cosine={ctx.cfg.accuracy.min_cosine}{spread_note(r.details, reference_label)}",
                          stage="validate", file=label,
                          fix=_accuracy_fix(ctx, r.details.get("reference_spread", {}).get("cosine_min")))
        e.result = r
        raise e
    return r


def _accuracy_fix(ctx: BuildContext, spread: float | None = None) -> str:
    from tasks.prequant import accuracy_fix

    return accuracy_fix(prequantized(ctx) or {}, spread, ctx.cfg.accuracy.min_cosine)


def benchmark(ctx: BuildContext) -> StageResult:
    from tasks.benchmark import benchmark_model, host_info
    from tasks.inputs import generated_feeds

    if not ctx.cfg.stages.benchmark:
        raise Skip("disabled (stages.benchmark=false)")
    ref = ctx.results["export"]
    eng_r = deliverable(ctx)
    cc = ctx.cfg.target.compute_capability
    opt = {n: {"min": r["opt"], "opt": r["opt"], "max": r["opt"]} for n, r in ctx.facts["profiles"][0].items()}
    feed = generated_feeds(ctx.facts["inputs"], [opt], 0, ctx.cfg.seed, recipe=ctx.c("model.images"))[0]
    gpu = trt_backend.gpu_for(cc)
    quantized = bool(ctx.cfg.precision.quantized)
    build_metrics = {k: ctx.metrics[k] for k in ("engine_bytes", "build_seconds", "baseline_engine_bytes",
                                                 "baseline_build_seconds") if k in ctx.metrics}
    parts = {"onnx": file_hash(ref, "onnx"), "bench": ctx.c("benchmark"), "host": host_info(), "gpu": gpu and gpu.name,
             "shape": {n: list(a.shape) for n, a in feed.items()},
             "engines": [sha256_file(e) for _, e, _ in engines_of(eng_r)] if gpu else None}

    def work(d: Path) -> StageResult:
        timing = None
        if gpu:  # engines on the GPU; a hybrid model end to end (engines + native segments + copies)
            timing = {"runtime": f"{ctx.backend.version} on {gpu.name} (sm {gpu.compute_capability})"}
            with contextlib.ExitStack() as runners:
                timing.update(_time_engines(ctx, eng_r, feed, runners))
                if quantized and not ctx.results["partition"].details.get("hybrid"):  # engine vs engine
                    timing["baseline_p50_ms"] = _time_engines(ctx, ctx.results["build"], feed, runners)["p50_ms"]
                    timing["quantized_but_slower"] = bool(timing["p50_ms"] > timing["baseline_p50_ms"])
        extra = {}
        if quantized:
            extra["quantized_vs_baseline"] = (
                f"{ctx.cfg.precision.name} engine vs the {ctx.cfg.precision.baseline} baseline: "
                + (("QUANTIZED BUT SLOWER" if timing.get("quantized_but_slower") else "quantized is faster")
                   if timing and "baseline_p50_ms" in timing else
                   "needs a GPU of compute capability " + cc + " to time both engines"))
        return benchmark_model(ref.files["onnx"], feed, ctx.c("benchmark"), d / "benchmark.json", build_metrics, timing,
                               None if gpu else trt_backend.no_gpu_reason(cc) + "; engine timing needs that GPU", extra)

    return ctx.cached("benchmark", parts, work)


def _time_engines(ctx: BuildContext, r: StageResult, feed: dict, runners: contextlib.ExitStack) -> dict:
    """One engine: CUDA-event timing of GPU compute apart from the copies. A hybrid model: host wall clock of the
    whole composed run (engines, ONNX Runtime segments and the copies between them)."""
    from tasks.benchmark import batch_of, measure

    bench = ctx.c("benchmark")
    if ctx.results["partition"].details.get("hybrid"):
        composed = candidate_runner(ctx, use_engines=True, runners=runners, stage="benchmark")
        return {"timer": "host wall clock: engines + ONNX Runtime segments + copies",
                **measure(lambda: composed(feed), bench, batch_of(feed))}
    runner = engine_runner(ctx, engines_of(r)[0][1], "benchmark", runners, cuda_graph=bench["cuda_graph"])
    t = runner.measure(feed, bench["warmup"], bench["iterations"], bench["repeats"])
    return {**t, "timer": "cuda events: p50_ms... is GPU compute (execute_async_v3); h2d/d2h copies apart"}


def publish_engines(ctx: BuildContext, out: Path) -> list[dict]:
    """Copy (hard-link when possible) the deliverable engine(s), one per TensorRT segment, into the output folder."""
    result = []
    for _, src, _ in engines_of(deliverable(ctx)):
        dst = out / Path(src).name
        try:
            dst.hardlink_to(src)
        except OSError:
            shutil.copy2(src, dst)
        result.append({"file": dst.name, "sha256": sha256_file(dst), "bytes": dst.stat().st_size})
    return result
