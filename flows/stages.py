"""The glue between the flow and the pure stages in tasks/: per stage, what its cache key holds, which task function
it calls, and what it records. Policy lives in tasks/ (the data split in tasks/datasets.py, the search target in
tasks/search.py, the verdict in tasks/validate.py, control-flow fallback in tasks/partition.py, segment composition in
tasks/segments.py); the context that runs a stage is flows/context.py."""
from __future__ import annotations

import contextlib
from pathlib import Path

from flows.config import paddle_cache
from flows.context import BuildContext, Skip, sample_progress
from flows.runners import candidate_runner, deliverable
from tasks import backend as trt_backend
from tasks.build import engines_of, same_graph
from tasks.errors import StageError, TrtforgeError
from tasks.export import constants_text
from tasks.util import StageResult, sha256_file

STAGE_NAMES = ("export", "partition", "build", "calibrate", "validate", "benchmark")


def file_hash(result: StageResult, name: str) -> str:
    return result.details.get(f"{name}_sha256") or sha256_file(result.files[name])


def prequantized(ctx: BuildContext) -> dict | None:
    """The quantization a model arrived with, if the graph TensorRT gets keeps some (dequantize_dynamic: none)."""
    q = ctx.results["export"].details.get("prequantized")
    return q if q and (q.get("computes") or q.get("dynamic_left")) else None


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
        ctx.warn("export", f"the engine is specialised for {constants_text(m['constants'])} (model.constants): those inputs "
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


MAX_REPLANS = 4  # builds re-planned after a failure, at most


def build(ctx: BuildContext) -> StageResult:
    """The baseline engine(s), one per TensorRT segment: fp32 or fp16 graph (int8/fp8: quantized ones in calibrate).
    A segment TensorRT cannot build runs what fails in ONNX Runtime, re-planned and said (tasks.partition.build_fallback)."""
    from tasks.build import build_error
    from tasks.inputs import generated_feeds
    from tasks.partition import build_fallback

    i, notes, cfg, t = ctx.inputs, [], ctx.c("partition"), ctx.cfg.target
    for attempt in range(MAX_REPLANS + 1):
        try:
            r = _build_engines(ctx)
            break
        except StageError as e:
            replan = None if attempt == MAX_REPLANS else build_fallback(
                cfg, ctx.results["export"].files["onnx"], ctx.results["partition"].details, e,
                lambda: generated_feeds(i.inputs, i.profiles[:1], 0, ctx.cfg.seed, rules=i.rules),
                lambda m, p: build_error(m, p, ctx.cfg.precision.baseline, t.compute_capability, ctx.c("build"), ctx.backend))
            if replan is None:
                raise
            cfg, note = replan
            ctx.results["partition"] = plan = partition(ctx, cfg)
            ctx.metrics.update(plan.metrics)
            notes.append(note)
    if notes:
        ctx.stages["partition"]["note"] = "; ".join(notes)
    return r


def _build_engines(ctx: BuildContext) -> StageResult:
    from tasks.build import add_metrics, as_baseline, onnx_at_precision
    from tasks.graph import load_onnx
    from tasks.precision import fp16_hazards_from_data
    from tasks.prequant import precision_for

    t, q = ctx.cfg.target, prequantized(ctx)  # a quantized model keeps it; its float part is what precision says
    p = ctx.cfg.precision
    precision, label = (precision_for(q, p.name), p.name) if q else (p.baseline, p.baseline)
    segs = trt_segments(ctx)
    # fp16: what the user's data holds decides which nodes stay fp32 (values beyond fp16's safe range)
    ranged = (ctx.data.calibration or ctx.data.validation) if precision == "fp16" else None
    parts = {"segments": [(sha256_file(s["onnx"]), s["profiles"]) for s in segs], "precision": precision, "label": label,
             "build": ctx.c("build"), "backend": ctx.backend.version, "compute_capability": t.compute_capability,
             "range_data": ranged.key if ranged else None}

    def work(d: Path) -> StageResult:  # values beyond fp16's safe range: one run of the whole model (segments keep names)
        keep, cancel = fp16_hazards_from_data(load_onnx(ctx.results["export"].files["onnx"]), ranged.feeds,
                                              ctx.cfg.build.fp16_data_max) if ranged else (None, None)
        convs = {s["index"]: onnx_at_precision(s["onnx"], precision, d / f"{ctx.cfg.model.name}.{t.name}.{label}{s['name']}.onnx",
                                               keep, cancel) for s in segs}
        r = engines_for(ctx, segs, {i: c.files["onnx"] for i, c in convs.items()}, label, precision, d, "build")
        for i, c in convs.items():
            r.files[f"onnx{i}"] = c.files["onnx"]
            add_metrics(r.metrics, c.metrics, ("convert_seconds",))
        r.details.update(conversion=[c.details for c in convs.values()], precision=precision)
        return r

    r = ctx.cached("build", parts, work, data=ranged is not None)
    if ranged is not None and ranged.kind == "random":
        ctx.warn("build", "the fp16 range check (which nodes stay fp32) ran on random inputs inside the profiles: give "
                          "calibration.data or validation.data at the model's real input scale")
    kept = sum(len(c.get("data_range") or {}) for c in r.details.get("conversion", []))
    if kept:
        ctx.warn("build", f"{kept} nodes kept in fp32: their values exceed fp16's safe range (|x| > "
                          f"build.fp16_data_max={ctx.cfg.build.fp16_data_max:g}) on {ranged.source}")
    cancelled = [c.get("cancellation") or {} for c in r.details.get("conversion", [])]
    if any(cancelled):
        worst = max(v for c in cancelled for v in c.values())
        ctx.warn("build", f"{sum(map(len, cancelled))} nodes kept in fp32: they compute subtractions of nearly equal "
                          f"values (x - mean far from zero, a variance as E[x^2] - E[x]^2) that fp16 operands would "
                          f"leave up to {worst:.0%} off (estimated on {ranged.source})")
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
    from tasks.calibrate import low_share_warning, qdq_for_segments
    from tasks.search import search_target
    from tasks.segments import segment_feeds

    cal, held = ctx.data.calibration, ctx.data.search
    segs, plan, model = trt_segments(ctx), ctx.results["partition"].details, ctx.results["export"].files["onnx"]
    # the margin grows when few held-out samples judge the search (none held out: the calibration samples judge)
    target = search_target(ctx.cfg.accuracy.min_cosine, c.budget_margin, (held or cal).samples) if c.search else None
    q_parts = {"segments": [sha256_file(s["onnx"]) for s in segs], "calibration": cal.key,
               "search": held.key if held else None, "method": c.method, "precision": p.name, "min_cosine": target,
               "fp16_data_max": ctx.cfg.build.fp16_data_max}

    def quantize(d: Path) -> StageResult:
        def progress(seg: int):
            return sample_progress(f"calibrating ({c.method or 'default method'}, segment {seg})", ctx.show_progress)
        return qdq_for_segments(segs, lambda i: segment_feeds(model, plan, i, cal.feeds),
                                (lambda i: segment_feeds(model, plan, i, held.feeds)) if held else None, d,
                                method=c.method, precision=p.name, min_cosine=target, progress=progress,
                                data_max=ctx.cfg.build.fp16_data_max)

    q = ctx.cached("calibrate", q_parts, quantize, entry="calibrate-qdq", data=True)
    t = ctx.cfg.target
    e_parts = {"qdq": [sha256_file(q.files[f"qdq{s['index']}"]) for s in segs], "profiles": [s["profiles"] for s in segs],
               "build": ctx.c("build"), "backend": ctx.backend.version, "compute_capability": t.compute_capability}

    e = ctx.cached("calibrate", e_parts, lambda d: engines_for(ctx, segs, {s["index"]: q.files[f"qdq{s['index']}"]
                                                                       for s in segs}, p.name, p.name, d, "calibrate"),
                   entry="calibrate-engine")
    files = {**e.files, **{f"onnx{s['index']}": q.files[f"qdq{s['index']}"] for s in segs},
             **{k: v for k, v in q.files.items() if k.startswith("sensitivity")}}
    details = {"engines": [{**x, "onnx": q.files[f"qdq{x['segment']}"].name} for x in e.details["engines"]],
               "quantization": q.details}
    note = low_share_warning(q.details["segments"], p.name)
    if note:
        ctx.warn("calibrate", note)
    return StageResult(files=files, metrics={**q.metrics, **e.metrics}, details=details)


def engines_for(ctx: BuildContext, segs: list[dict], graphs: dict[int, Path], label: str, precision: str, d: Path,
                stage: str) -> StageResult:
    from tasks.build import engines_for_segments

    t = ctx.cfg.target
    return engines_for_segments(segs, graphs, f"{ctx.cfg.model.name}.{t.name}.{label}", t.compute_capability,
                                ctx.c("build"), ctx.backend, d, stage, f"{ctx.cfg.model.name} {t.name} {precision}",
                                ctx.show_progress, label=label)


def validate(ctx: BuildContext) -> StageResult:
    from tasks.datasets import describe_thin
    from tasks.calibrate import search_fix
    from tasks.emulate import emulation_label
    from tasks.prequant import accuracy_fix
    from tasks.validate import gate, validate_onnx

    if not ctx.cfg.stages.validate:
        raise Skip("disabled (stages.validate=false)")
    ref, cand, val = ctx.results["export"], deliverable(ctx), ctx.data.validation
    reference = ref.files.get("reference", ref.files["onnx"])  # a pre-quantized model: as shipped, in ONNX Runtime
    reference_label = "the model as shipped" if "reference" in ref.files else "fp32"
    if ctx.cfg.model.constants:
        reference_label += f" with {constants_text(ctx.c('model.constants'))} bound (model.constants)"
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
    cal = ctx.results.get("calibrate")
    fix = accuracy_fix(prequantized(ctx) or {}) if prequantized(ctx) or cal is None else \
        search_fix(cal.metrics, val.samples, ctx.cfg.calibration.budget_margin)

    def work(d: Path) -> StageResult:
        with contextlib.ExitStack() as runners:
            engine = candidate_runner(ctx, runners=runners) if engine_reason is None else None
            try:
                return validate_onnx(reference, candidate_runner(ctx), val.feeds, ctx.cfg.accuracy.min_cosine,
                                     val.source, d / "validation.json", engine=engine, engine_skip_reason=engine_reason,
                                     label=label, reference_label=reference_label, identical=identical,
                                     emulation=emulation_label(ctx.cfg.precision.name),
                                     engine_device=gpu and f"engine on {gpu.name} (sm {gpu.compute_capability})",
                                     evidence=evidence, fix=fix)
            except TrtforgeError as e:  # the failed verdict is a result too: cached, gated below
                if getattr(e, "result", None) is None:
                    raise
                return e.result

    r = ctx.cached("validate", parts, work, data=True)
    if r.details.get("left_out"):  # shapes the fp32 model itself fails on: a property of the model, said once
        ctx.warn("validate", r.details["warnings"][0])
    for w in r.details.get("evidence", []):
        ctx.warn("validate", w)
    gate(r, label=label, fix=fix)
    return r


def benchmark(ctx: BuildContext) -> StageResult:
    from tasks.benchmark import baseline_note, benchmark_model, engine_timing, host_info
    from tasks.inputs import generated_feeds
    from tasks.runtime import EngineRunner, runtime_cache_file

    if not ctx.cfg.stages.benchmark:
        raise Skip("disabled (stages.benchmark=false)")
    ref, eng_r, cc, p = ctx.results["export"], deliverable(ctx), ctx.cfg.target.compute_capability, ctx.cfg.precision
    opt = {n: {"min": r["opt"], "opt": r["opt"], "max": r["opt"]} for n, r in ctx.inputs.profiles[0].items()}
    feed = generated_feeds(ctx.inputs.inputs, [opt], 0, ctx.cfg.seed, recipe=ctx.c("model.images"))[0]
    gpu, bench, hybrid = trt_backend.gpu_for(cc), ctx.c("benchmark"), ctx.results["partition"].details.get("hybrid")
    build_metrics = {k: ctx.metrics[k] for k in ("engine_bytes", "build_seconds", "baseline_engine_bytes",
                                                 "baseline_build_seconds") if k in ctx.metrics}
    parts = {"onnx": file_hash(ref, "onnx"), "bench": bench, "host": host_info(), "gpu": gpu and gpu.name,
             "shape": {n: list(a.shape) for n, a in feed.items()},
             "engines": [sha256_file(e) for _, e, _ in engines_of(eng_r)] if gpu else None}
    cache = runtime_cache_file(ctx.cfg.cache_dir, ctx.cfg.target.name, ctx.backend.version)

    def work(d: Path) -> StageResult:
        timing = None
        if gpu:  # engines on the GPU; a hybrid model end to end (engines + native segments + copies)
            with contextlib.ExitStack() as runners:
                def open_engine(path: Path):
                    return runners.enter_context(EngineRunner(Path(path).read_bytes(), ctx.backend, runtime_cache=cache,
                                                              cuda_graph=bench["cuda_graph"], stage="benchmark",
                                                              pci_bus_id=gpu.pci_bus_id))
                baseline = engines_of(ctx.results["build"])[0][1] if p.quantized and not hybrid else None
                timing = engine_timing(feed, bench, f"{ctx.backend.version} on {gpu.name} (sm {gpu.compute_capability})",
                                       open_engine, engines_of(eng_r)[0][1], baseline,
                                       composed=candidate_runner(ctx, runners, "benchmark") if hybrid else None)
        extra = {"quantized_vs_baseline": baseline_note(p.name, p.baseline, cc, timing)} if p.quantized else {}
        return benchmark_model(ref.files["onnx"], feed, bench, d / "benchmark.json", build_metrics, timing,
                               None if gpu else trt_backend.no_gpu_reason(cc) + "; engine timing needs that GPU", extra)

    return ctx.cached("benchmark", parts, work)
