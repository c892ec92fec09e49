"""The glue between the flow and the pure stages in tasks/: per stage, what its cache key holds, which task function
it calls, and what it records. Policy lives in tasks/ (the data split in tasks/datasets.py, the search target in
tasks/search.py, the verdict in tasks/validate.py, control-flow fallback in tasks/partition.py, segment composition in
tasks/segments.py); the context that runs a stage is flows/context.py."""
from __future__ import annotations

import contextlib
from pathlib import Path

from flows.context import BuildContext, Skip, sample_progress
from tasks import backend as trt_backend
from tasks.build import engines_of, same_graph
from tasks.errors import StageError, TrtforgeError
from tasks.util import StageResult, sha256_file

STAGE_NAMES = ("export", "partition", "build", "calibrate", "validate", "benchmark")


def paddle_cache(cfg) -> Path:
    """Where Paddle conversions are kept (preflight reads the model's inputs from them; export reuses them)."""
    return Path(cfg.cache_dir) / "paddle"


def file_hash(result: StageResult, name: str) -> str:
    return result.details.get(f"{name}_sha256") or sha256_file(result.files[name])


def prequantized(ctx: BuildContext) -> dict | None:
    """The quantization a model arrived with (export found Q/DQ or dynamic quantization ops), else None."""
    return ctx.results["export"].details.get("prequantized")


def bound_text(constants: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in constants.items())


# --- the six stages ------------------------------------------------------------------------------------------

def export(ctx: BuildContext) -> StageResult:
    from tasks.export import onnx_from_model, source_fingerprint

    m, profiles = ctx.c("model"), ctx.inputs.profiles
    parts = {"source": source_fingerprint(m, ctx.inputs.search), "format": m["format"], "factory": m["factory"],
             "inputs": m["inputs"], "opset": m["opset"], "profiles": profiles if m["format"] == "torch" else None,
             "dequantize_dynamic": m["dequantize_dynamic"], "asymmetric": m["asymmetric"]}
    if m["constants"]:  # bound inputs; dims every profile fixes are pinned for the folds
        parts.update(constants=m["constants"], profiles=profiles)

    def work(d: Path) -> StageResult:
        r = onnx_from_model(m, profiles, d / "model.onnx", ctx.inputs.search, paddle_cache(ctx.cfg))
        r.details["onnx_sha256"] = sha256_file(r.files["onnx"])
        return r

    r = ctx.cached("export", parts, work)
    if m["constants"]:
        ctx.warn("export", f"the engine is specialised for {bound_text(m['constants'])} (model.constants): those inputs "
                           "are gone, and the fp32 reference is the model with them bound")
        for n in r.details.get("constants", []):
            if n.startswith("WARNING: "):
                ctx.warn("export", n[len("WARNING: "):])
    return r


def partition(ctx: BuildContext, partition_cfg: dict | None = None) -> StageResult:
    from tasks.inputs import generated_feeds
    from tasks.partition import plan_from_onnx

    onnx_r, i = ctx.results["export"], ctx.inputs
    partition_cfg = partition_cfg or ctx.c("partition")
    parts = {"onnx": file_hash(onnx_r, "onnx"), "partition": partition_cfg, "backend": ctx.backend.version,
             "profiles": i.profiles}

    def work(d: Path) -> StageResult:
        # min/opt/max inputs per profile: running the native part on them gives the boundary tensors' profiles
        def feeds():
            return [generated_feeds(i.inputs, [p], 0, ctx.cfg.seed, rules=i.rules) for p in i.profiles]
        return plan_from_onnx(onnx_r.files["onnx"], partition_cfg, ctx.backend, d, feeds)

    r = ctx.cached("partition", parts, work)
    for w in r.details.get("warnings", []):
        ctx.warn("partition", w)
    return r


def trt_segments(ctx: BuildContext) -> list[dict]:
    from tasks.segments import trt_segments as segments

    plan = ctx.results["partition"]
    return segments(plan.details, plan.files, ctx.results["export"].files["onnx"], ctx.inputs.profiles)


def build(ctx: BuildContext) -> StageResult:
    """The baseline engine(s), one per TensorRT segment: fp32 or fp16 graph (int8/fp8: quantized ones in calibrate).
    TensorRT can parse control flow and still fail to build it: then it runs in ONNX Runtime (re-planned, said)."""
    from tasks.partition import without_control_flow

    try:
        return _build_engines(ctx)
    except StageError as e:
        replan = without_control_flow(ctx.results["export"].files["onnx"], ctx.c("partition"))
        if replan is None:
            raise
        plan = partition(ctx, replan[0])
        ctx.results["partition"] = plan
        ctx.metrics.update(plan.metrics)
        ctx.stages["partition"]["note"] = (
            f"re-planned after the TensorRT build failed ({e.message[:200]}): {', '.join(replan[1])} nodes run in "
            f"ONNX Runtime (partition.control_flow_fallback=true)")
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
    if ctx.cfg.precision.quantized and not prequantized(ctx):  # the entry is shared with the fp16/fp32 build
        r = StageResult(files=r.files, metrics=as_baseline(r.metrics), details=r.details, origin=r.origin)
    return r


def calibrate(ctx: BuildContext) -> StageResult | None:
    """int8/fp8: the Q/DQ graph of each TensorRT segment (target-independent, cached across targets), then its engine."""
    p, c = ctx.cfg.precision, ctx.cfg.calibration
    if not p.quantized:
        raise Skip(f"precision {p.name} needs no calibration")
    if prequantized(ctx):
        from tasks.prequant import describe
        raise Skip(f"the model is already quantized ({describe(prequantized(ctx))})")
    from tasks.build import SHIPPED_METRICS, add_metrics, engine_from_onnx
    from tasks.calibrate import qdq_from_onnx
    from tasks.report import sensitivity_report
    from tasks.search import search_target
    from tasks.segments import segment_feeds

    cal, held = ctx.data.calibration, ctx.data.search
    segs, plan, model = trt_segments(ctx), ctx.results["partition"].details, ctx.results["export"].files["onnx"]
    target = search_target(ctx.cfg.accuracy.min_cosine, c.budget_margin) if c.search else None
    q_parts = {"segments": [sha256_file(s["onnx"]) for s in segs], "calibration": cal.key,
               "search": held.key if held else None, "method": c.method, "precision": p.name, "min_cosine": target}

    def quantize(d: Path) -> StageResult:
        files, metrics, details = {}, {"quantized_layers": 0, "fallback_layers": 0}, []
        for s in segs:
            with sample_progress(f"calibrating ({c.method or 'default method'}, segment {s['index']})",
                                 ctx.show_progress) as on_sample:
                r = qdq_from_onnx(s["onnx"], segment_feeds(model, plan, s["index"], cal.feeds), d / f"qdq{s['index']}.onnx",
                                  method=c.method, precision=p.name, min_cosine=target,
                                  eval_feeds=segment_feeds(model, plan, s["index"], held.feeds) if held else None,
                                  workdir=d / f"work{s['index']}", on_sample=on_sample, no_layers_ok=len(segs) > 1)
            files[f"qdq{s['index']}"] = r.files["onnx"]
            for k in ("quantized_layers", "fallback_layers"):
                metrics[k] += r.metrics[k]
            for k in ("search_cosine_worst_feed", "search_cosine_all_quantized"):  # absent when not measured
                if k in r.metrics:
                    metrics[k] = min(metrics.get(k, 1.0), r.metrics[k])
            metrics.update(calibration_samples=r.metrics["calibration_samples"], search_samples=r.metrics["search_samples"])
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
    files = {**e.files, **{f"onnx{s['index']}": q.files[f"qdq{s['index']}"] for s in segs},
             **{k: v for k, v in q.files.items() if k.startswith("sensitivity")}}
    details = {"engines": [{**x, "onnx": q.files[f"qdq{x['segment']}"].name} for x in e.details["engines"]],
               "quantization": q.details}
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


def deliverable(ctx: BuildContext) -> StageResult:
    """The stage whose engines ship: calibrate's quantized engines when it made them, else build's."""
    cal = ctx.results.get("calibrate")
    return cal if cal is not None and any(k.startswith("engine") for k in cal.files) else ctx.results["build"]


def candidate_runner(ctx: BuildContext, runners: contextlib.ExitStack | None = None, stage: str = "validate",
                     cuda_graph: bool = False):
    """The model as it will run: per TensorRT segment the engine (with `runners`: on a GPU, closed with it) or its
    precision graph in ONNX Runtime, the native segments of a hybrid model in ONNX Runtime between them."""
    from tasks.ort import ort_runner
    from tasks.runtime import EngineRunner, runtime_cache_file
    from tasks.segments import composed_runner

    by_segment = {i: (eng, onnx) for i, eng, onnx in engines_of(deliverable(ctx))}
    cache = runtime_cache_file(ctx.cfg.cache_dir, ctx.cfg.target.name, ctx.backend.version)

    def runner_for(seg: dict):
        if seg["kind"] != "trt":
            return ort_runner(ctx.results["partition"].files[f"segment{seg['index']}"])
        eng, onnx = by_segment[seg["index"]]
        if runners is not None:
            return runners.enter_context(EngineRunner(Path(eng).read_bytes(), ctx.backend, runtime_cache=cache,
                                                      cuda_graph=cuda_graph, stage=stage)).infer
        # ORT's full optimisation fuses Q/DQ into kernels that have no float8 version
        return ort_runner(onnx, optimization="basic" if ctx.cfg.precision.name == "fp8" else "all")

    outputs = [o["name"] for o in ctx.results["export"].details["outputs"]]
    return composed_runner(ctx.results["partition"].details, outputs, runner_for)


def validate(ctx: BuildContext) -> StageResult:
    from tasks.datasets import describe_thin
    from tasks.prequant import accuracy_fix
    from tasks.validate import gate, validate_onnx

    if not ctx.cfg.stages.validate:
        raise Skip("disabled (stages.validate=false)")
    ref, cand, val = ctx.results["export"], deliverable(ctx), ctx.data.validation
    reference = ref.files.get("reference", ref.files["onnx"])  # a pre-quantized model: as shipped, in ONNX Runtime
    reference_label = "the model as shipped" if "reference" in ref.files else "fp32"
    if ctx.cfg.model.constants:
        reference_label += f" with {bound_text(ctx.c('model.constants'))} bound (model.constants)"
    ctx.stages.setdefault("validate", {})["reference"] = reference_label
    cc = ctx.cfg.target.compute_capability
    gpu = trt_backend.gpu_for(cc) if ctx.cfg.validation.engine else None
    engine_reason = None if gpu else ("disabled (validation.engine=false)" if not ctx.cfg.validation.engine
                                      else trt_backend.no_gpu_reason(cc))
    segs = {s["index"]: s["onnx"] for s in trt_segments(ctx)}
    candidates = engines_of(cand)
    identical = "reference" not in ref.files and all(same_graph(o, segs[i]) for i, _, o in candidates)
    evidence = [w for w in (describe_thin(val),) if w]
    parts = {"reference": sha256_file(reference), "candidate": [sha256_file(o) for _, _, o in candidates],
             "plan": sha256_file(ctx.results["partition"].files["partition"]), "data": val.key,
             "min_cosine": ctx.cfg.accuracy.min_cosine, "precision": ctx.cfg.precision.name,  # in the result's labels
             "engines": [sha256_file(e) for _, e, _ in candidates] if engine_reason is None else None}
    label = f"{ctx.cfg.model.name} at {ctx.cfg.precision.name}"
    fix = accuracy_fix(prequantized(ctx) or {}, None, ctx.cfg.accuracy.min_cosine)

    def work(d: Path) -> StageResult:
        with contextlib.ExitStack() as runners:
            engine = candidate_runner(ctx, runners=runners) if engine_reason is None else None
            try:
                return validate_onnx(reference, candidate_runner(ctx), val.feeds, ctx.cfg.accuracy.min_cosine,
                                     val.source, d / "validation.json", engine=engine, engine_skip_reason=engine_reason,
                                     label=label, reference_label=reference_label, identical=identical,
                                     emulation=f"onnxruntime emulation of {ctx.cfg.precision.name}",
                                     engine_device=gpu and f"engine on {gpu.name} (sm {gpu.compute_capability})",
                                     reference_spread="reference" in ref.files, evidence=evidence, fix=fix)
            except TrtforgeError as e:  # the failed verdict is a result too: cached, gated below
                if getattr(e, "result", None) is None:
                    raise
                return e.result

    r = ctx.cached("validate", parts, work)
    if r.details.get("left_out"):  # shapes the fp32 model itself fails on: a property of the model, said once
        ctx.warn("validate", r.details["warnings"][0])
    for w in r.details.get("evidence", []):
        ctx.warn("validate", w)
    spread = r.details.get("reference_spread", {}).get("cosine_min")
    gate(r, label=label, fix=accuracy_fix(prequantized(ctx) or {}, spread, ctx.cfg.accuracy.min_cosine))
    return r


def benchmark(ctx: BuildContext) -> StageResult:
    from tasks.benchmark import benchmark_model, host_info, measure
    from tasks.inputs import batch_size, generated_feeds

    if not ctx.cfg.stages.benchmark:
        raise Skip("disabled (stages.benchmark=false)")
    ref, eng_r, cc = ctx.results["export"], deliverable(ctx), ctx.cfg.target.compute_capability
    opt = {n: {"min": r["opt"], "opt": r["opt"], "max": r["opt"]} for n, r in ctx.inputs.profiles[0].items()}
    feed = generated_feeds(ctx.inputs.inputs, [opt], 0, ctx.cfg.seed, recipe=ctx.c("model.images"))[0]
    gpu = trt_backend.gpu_for(cc)
    quantized = bool(ctx.cfg.precision.quantized)
    bench = ctx.c("benchmark")
    build_metrics = {k: ctx.metrics[k] for k in ("engine_bytes", "build_seconds", "baseline_engine_bytes",
                                                 "baseline_build_seconds") if k in ctx.metrics}
    parts = {"onnx": file_hash(ref, "onnx"), "bench": bench, "host": host_info(), "gpu": gpu and gpu.name,
             "shape": {n: list(a.shape) for n, a in feed.items()},
             "engines": [sha256_file(e) for _, e, _ in engines_of(eng_r)] if gpu else None}

    def time_engines(r: StageResult, runners: contextlib.ExitStack) -> dict:
        """One engine: CUDA-event timing of GPU compute apart from the copies. A hybrid model: host wall clock of the
        whole composed run (engines, ONNX Runtime segments and the copies between them)."""
        from tasks.runtime import EngineRunner, runtime_cache_file

        if ctx.results["partition"].details.get("hybrid"):
            composed = candidate_runner(ctx, runners=runners, stage="benchmark")
            return {"timer": "host wall clock: engines + ONNX Runtime segments + copies",
                    **measure(lambda: composed(feed), bench, batch_size(feed))}
        cache = runtime_cache_file(ctx.cfg.cache_dir, ctx.cfg.target.name, ctx.backend.version)
        runner = runners.enter_context(EngineRunner(Path(engines_of(r)[0][1]).read_bytes(), ctx.backend,
                                                    runtime_cache=cache, cuda_graph=bench["cuda_graph"], stage="benchmark"))
        t = runner.measure(feed, bench["warmup"], bench["iterations"], bench["repeats"])
        return {**t, "timer": "cuda events: p50_ms... is GPU compute (execute_async_v3); h2d/d2h copies apart"}

    def work(d: Path) -> StageResult:
        timing = None
        if gpu:  # engines on the GPU; a hybrid model end to end (engines + native segments + copies)
            timing = {"runtime": f"{ctx.backend.version} on {gpu.name} (sm {gpu.compute_capability})"}
            with contextlib.ExitStack() as runners:
                timing.update(time_engines(eng_r, runners))
                if quantized and not ctx.results["partition"].details.get("hybrid"):  # engine vs engine
                    timing["baseline_p50_ms"] = time_engines(ctx.results["build"], runners)["p50_ms"]
                    timing["quantized_but_slower"] = bool(timing["p50_ms"] > timing["baseline_p50_ms"])
        extra = {}
        if quantized:
            extra["quantized_vs_baseline"] = (
                f"{ctx.cfg.precision.name} engine vs the {ctx.cfg.precision.baseline} baseline: "
                + (("QUANTIZED BUT SLOWER" if timing.get("quantized_but_slower") else "quantized is faster")
                   if timing and "baseline_p50_ms" in timing else
                   "needs a GPU of compute capability " + cc + " to time both engines"))
        return benchmark_model(ref.files["onnx"], feed, bench, d / "benchmark.json", build_metrics, timing,
                               None if gpu else trt_backend.no_gpu_reason(cc) + "; engine timing needs that GPU", extra)

    return ctx.cached("benchmark", parts, work)
