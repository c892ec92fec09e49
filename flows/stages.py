"""The glue between the flow and the pure stages in tasks/: per stage, what its cache key holds (the stage table at the
end names its config values), which task function it calls, and what it records. Policy and the words a stage says
live in tasks/ (the data split in tasks/data/datasets.py, the search's goal in tasks/search/goal.py, the verdict in
tasks/evaluate/validate.py, control-flow fallback in tasks/partition/partition.py, segment composition in
tasks/partition/segments.py, the warnings and notes in each subject's notes.py); the context that runs a stage is
flows/context.py.
Over 400 lines by choice: the six stages' glue stays side by side with the table that declares their cache keys, so
a reader sees in one file what each stage's key holds and what it calls (the fallback's re-planning loop is apart, in
flows/replans.py)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flows.config import paddle_cache
from flows.context import BuildContext, Skip, sample_progress
from flows.replans import with_replans
from flows.runners import candidate_runner, deliverable
from tasks.trt import backend as trt_backend
from tasks.engines import engines_of, same_graph
from tasks.common import AccuracyError, SegmentBuildError, TrtforgeError
from tasks.common import StageResult, sha256_file
from tasks.schema import STAGES


def warn_all(ctx: BuildContext, stage: str, warnings: list[str]) -> None:
    """What a task function said (warnings come back from tasks/ as data), recorded on the stage's entry."""
    for w in warnings:
        ctx.warn(stage, w)


def file_hash(result: StageResult, name: str) -> str:
    return result.details.get(f"{name}_sha256") or sha256_file(result.files[name])


def prequantized(ctx: BuildContext) -> dict | None:
    """The quantization a model arrived with, if the graph TensorRT gets keeps some (dequantize_dynamic: none)."""
    q = ctx.results["export"].details.get("prequantized")
    return q if q and (q.get("computes") or q.get("dynamic_left")) else None


# --- the six stages ------------------------------------------------------------------------------------------

def export(ctx: BuildContext) -> StageResult:
    from tasks.sources import onnx_from_model, source_fingerprint

    m, profiles = ctx.c("model"), ctx.inputs.profiles
    parts = key_parts(ctx, "export", source=source_fingerprint(m, ctx.inputs.search),
                      profiles=profiles if m["format"] == "torch" else None)
    if m["constants"]:  # bound inputs; dims every profile fixes are pinned for the folds
        parts.update(constants=m["constants"], profiles=profiles)

    def work(d: Path) -> StageResult:
        r = onnx_from_model(m, profiles, d / "model.onnx", ctx.inputs.search, paddle_cache(ctx.cfg))
        r.details["onnx_sha256"] = sha256_file(r.files["onnx"])
        return r

    r = ctx.cached("export", parts, work)
    if m["format"] == "torch":  # the graph exists only now: the memory check and the inputs' domains preflight could not do
        from flows.config import after_export
        ctx.inputs = after_export(ctx.cfg, ctx.inputs, r.files["onnx"], ctx.memory.budget if ctx.memory else None)
    warn_all(ctx, "export", ctx.inputs.warnings)  # preflight's (a build near its memory budget)
    if r.details.get("weight_only"):
        from tasks.prequant import weight_only_note
        ctx.stages.setdefault("export", {})["note"] = weight_only_note(r.details["weight_only"])
    if m["constants"]:
        from tasks.sources import constants_warnings
        warn_all(ctx, "export", constants_warnings(m["constants"], r.details.get("constants", [])))
    return r


def partition(ctx: BuildContext, partition_cfg: dict | None = None) -> StageResult:
    from tasks.data import generated_feeds
    from tasks.partition import plan_from_onnx

    onnx_r, i = ctx.results["export"], ctx.inputs
    # dynamic quantization model.dequantize_dynamic=true left native, and why: its warning says so (keyed only when
    # there is some, so other builds keep their cache keys)
    left = (onnx_r.details.get("prequantized") or {}).get("dynamic_left_why")
    parts = key_parts(ctx, "partition", onnx=file_hash(onnx_r, "onnx"), backend=ctx.backend.version, profiles=i.profiles,
                      **({"partition": partition_cfg} if partition_cfg else {}),
                      **({"dynamic_left_why": left} if left is not None else {}))
    partition_cfg = parts["partition"]

    def work(d: Path) -> StageResult:
        # min/opt/max inputs per profile: running the native part on them gives the boundary tensors' profiles
        def feeds():
            return [generated_feeds(i.inputs, [p], 0, ctx.cfg.seed, rules=i.rules) for p in i.profiles]
        return plan_from_onnx(onnx_r.files["onnx"], partition_cfg, ctx.backend, d, feeds, left)

    r = ctx.cached("partition", parts, work)
    warn_all(ctx, "partition", r.details.get("warnings", []))
    return r


def trt_segments(ctx: BuildContext) -> list[dict]:
    from tasks.partition import trt_segments as segments

    plan = ctx.results["partition"]
    return segments(plan.details, plan.files, ctx.results["export"].files["onnx"], ctx.inputs.profiles)


def build(ctx: BuildContext) -> StageResult:
    """The baseline engine(s), one per TensorRT segment: fp32 or fp16 graph (int8/fp8: quantized ones in calibrate).
    A segment TensorRT cannot build runs what fails in ONNX Runtime, re-planned and said (tasks.partition.partition.build_fallback).
    int8/fp8: built only where the benchmark times the quantized engine against it (a GPU of the target's compute
    capability); elsewhere calibrate's engine build is the one that re-plans."""
    p = ctx.cfg.precision
    if p.quantized and not prequantized(ctx) and not baseline_timed(ctx):
        from tasks.engines import baseline_skip_reason
        raise Skip(baseline_skip_reason(p.name, p.baseline, ctx.cfg.target.compute_capability,
                                        bool(ctx.cfg.stages.benchmark), bool(ctx.results["partition"].details.get("hybrid"))))
    return with_replans(ctx, lambda: _build_engines(ctx), partition)


def baseline_timed(ctx: BuildContext) -> bool:
    """Whether the benchmark times a quantized engine against the baseline engine: a GPU of the target's compute
    capability on this host, the benchmark on, one TensorRT segment (a hybrid model is timed end to end)."""
    return bool(ctx.cfg.stages.benchmark and trt_backend.gpu_for(ctx.cfg.target.compute_capability) is not None
                and not ctx.results["partition"].details.get("hybrid"))


def _build_engines(ctx: BuildContext) -> StageResult:
    from tasks.engines import add_metrics, as_baseline, onnx_at_precision
    from tasks.fp16 import fp16_or_fp32, searched_segments
    from tasks.graph import load_onnx
    from tasks.fp16 import fp16_hazards_from_data
    from tasks.prequant import precision_for
    from tasks.partition import all_segment_feeds

    t, q = ctx.cfg.target, prequantized(ctx)  # a quantized model keeps it; its float part is what precision says
    p = ctx.cfg.precision
    precision, label = (precision_for(q, p.name), p.name) if q else (p.baseline, p.baseline)
    segs = trt_segments(ctx)
    # fp16: what the user's data holds decides which nodes stay fp32 (values beyond fp16's safe range)
    ranged = (ctx.data.calibration or ctx.data.validation) if precision == "fp16" else None
    # fp16 under the accuracy budget: nodes kept fp32 until the search's held-out samples meet its target; only once the
    # graph as converted missed the budget in validate (fp16_search_due), so builds that meet it pay nothing for it
    held = ctx.data.search if ctx.fp16_search else None  # fp16_search_due decided the search may run
    # judged by accuracy.metric as the int8 search judges (cosine: pooled, less one standard error, which already widens
    # for few samples): the margin as given (calibration.budget_margin, else FIXED_MARGIN), not grown for few samples
    # nor derived (a static profile's generated search set is one sample: the grown margin asked for cosine 1.0)
    goal = search_goal(ctx, segs, None, stage="build", margin=fixed_margin(ctx)) if held is not None else None
    target = goal.target if goal is not None else None
    parts = key_parts(ctx, "build", segments=[(sha256_file(s["onnx"]), s["profiles"]) for s in segs], precision=precision,
                      label=label, backend=ctx.backend.version, range_data=ranged.key if ranged else None,
                      search=held.key if held else None, target=target)
    if goal is not None and goal.by_metric:  # the user's metric decides the stopping point
        parts["metric"] = metric_part(ctx, goal.judge.metric, target=goal.judge.target)

    def work(d: Path) -> StageResult:  # values beyond fp16's safe range: one run of the whole model (segments keep names)
        keep, cancel, tiny = fp16_hazards_from_data(load_onnx(ctx.results["export"].files["onnx"]), ranged.feeds,
                                                    ctx.cfg.build.fp16_data_max, underflow=True) \
            if ranged else (None, None, None)
        plan, model = ctx.results["partition"].details, ctx.results["export"].files["onnx"]
        held_feeds = all_segment_feeds(model, plan, held.feeds) if held is not None else {}

        def search(i: int) -> dict | None:
            if held is None:
                return None
            return {"feeds": held_feeds.get(i, []), "target": target, "samples_text":
                    f"held-out samples ({held.source})", "budget": ctx.cfg.accuracy.min_cosine, "metric": goal.judge}

        def convert(s: dict):
            return onnx_at_precision(s["onnx"], precision, d / f"{ctx.cfg.model.name}.{t.name}.{label}{s['name']}.onnx",
                                     keep, cancel, tiny, search(s["index"]))

        split = held is not None and plan.get("hybrid")  # a split model's segments are judged whole below
        convs = fp16_or_fp32(segs, convert, lambda s: _segment_fp32(ctx, s, d)) if split else \
            {s["index"]: convert(s) for s in segs}
        whole = _fp16_judged_whole(ctx, segs, convs, held, d) if split else None
        r = engines_for(ctx, segs, {i: c.files["onnx"] for i, c in convs.items()}, label, precision, d, "build")
        if whole is not None:
            r.details["fp16_whole_model"] = whole
            r.metrics["fp16_segments_fp32"] = len(whole["kept"])
        for i, c in convs.items():
            r.files[f"onnx{i}"] = c.files["onnx"]
            add_metrics(r.metrics, c.metrics, ("convert_seconds",))
        searched = searched_segments(convs, d)  # the search's figures over the segments, its sensitivity report
        r.metrics.update(searched.metrics)
        r.files.update(searched.files)
        r.details.update(conversion=[c.details for c in convs.values()], precision=precision)
        return r

    r = ctx.cached("build", parts, work, data=ranged is not None)
    _say_fp16(ctx, r, ranged, goal, held)
    if ctx.cfg.precision.quantized and not prequantized(ctx):  # the entry is shared with the fp16/fp32 build
        r = StageResult(files=r.files, metrics=as_baseline(r.metrics), details=r.details, origin=r.origin)
    return r


def _fp16_judged_whole(ctx: BuildContext, segs: list[dict], convs: dict, held, d: Path) -> dict:
    """fp16 of a hybrid model: its converted segments judged together with the native parts on the model's outputs
    by accuracy.metric (tasks/fp16/composed.py); the segments it keeps fp32 are converted at fp32 in ``convs``."""
    from tasks.fp16 import segments_kept_fp32
    from tasks.search import search_goal as goal_of

    whole = goal_of(accuracy_metric(ctx), ctx.cfg.accuracy.min_cosine, fixed_margin(ctx).share, None)
    error = {i: 1.0 - c.metrics.get("search_cosine", 1.0) for i, c in convs.items()}
    found = segments_kept_fp32(ctx.results["export"].files["onnx"], ctx.results["partition"].details,
                               ctx.results["partition"].files, [o["name"] for o in ctx.results["export"].details["outputs"]],
                               held.feeds, {i: c.files["onnx"] for i, c in convs.items()}, error, whole.judge,
                               whole.target)
    for s in segs:
        if s["index"] in found["kept"]:
            convs[s["index"]] = _segment_fp32(ctx, s, d)
    refused = [i for i, c in convs.items() if c.details.get("fp16_search_refused")]
    return {**found, "target": whole.target, "metric": whole.judge.name, "samples": len(held.feeds),
            "fp32_by_own_search": refused}


def _segment_fp32(ctx: BuildContext, s: dict, d: Path):
    from tasks.engines import onnx_at_precision

    return onnx_at_precision(s["onnx"], "fp32", d / f"{ctx.cfg.model.name}.{ctx.cfg.target.name}.fp32{s['name']}.onnx")


def _say_fp16(ctx: BuildContext, r: StageResult, ranged, goal, held) -> None:
    """The build's fp16 warnings and the note on what its accuracy search kept (tasks/fp16/notes.py)."""
    from tasks.fp16 import fp16_build_warnings, fp16_cancellation_warning, fp16_search_note, fp16_whole_model_note

    conversions = r.details.get("conversion", [])
    warn_all(ctx, "build", fp16_build_warnings(conversions, ranged, ctx.cfg.build.fp16_data_max))
    note = fp16_search_note(conversions, r.metrics, goal and goal.target, goal and goal.judge.name, held and held.source)
    whole = fp16_whole_model_note(r.details.get("fp16_whole_model"))
    if note or whole:
        ctx.stages.setdefault("build", {})["note"] = "; ".join(n for n in (note, whole) if n)
    cancelled = fp16_cancellation_warning(conversions, ranged)
    if cancelled:
        ctx.warn("build", cancelled)


def fp16_searchable(ctx: BuildContext) -> bool:
    """Whether this build may search the nodes to keep fp32 at fp16 (tasks/fp16/search.py): fp16 from a float model
    (or one quantized dynamically only, or whose Q/DQ reach no TensorRT layer: its engines as built compute no 8-bit
    FLOPs, Kokoro's 4 weight-only Gathers run in ONNX Runtime), calibration.search on, held-out samples for it."""
    from tasks.prequant import float_engines

    p, q = ctx.cfg.precision, prequantized(ctx)
    built = ctx.results.get("build")
    share = built.metrics.get("flops_share") if built is not None else None
    float_built = bool(share) and not share.get("int8") and not share.get("fp8")
    return (p.name == "fp16" and (not q or float_engines(q) or float_built) and bool(ctx.cfg.calibration.search)
            and ctx.data.search is not None)


def fp16_search_due(ctx: BuildContext) -> bool:
    """The fp16 graph as converted was validated and missed the budget (a verdict, not a crash), and the search may
    run and has not: the flow then runs build (with the search) and validate again. Judged by validate first so that a
    build that meets the budget pays nothing for the search; the search itself judges only its held-out samples."""
    r = ctx.results.get("validate")
    return (not ctx.fp16_search and ctx.failed == "validate" and r is not None and r.details.get("passed") is False
            and fp16_searchable(ctx))


def calibrate(ctx: BuildContext) -> StageResult | None:
    """int8/fp8: the Q/DQ graph of each TensorRT segment (target-independent, cached across targets), then its engine."""
    p = ctx.cfg.precision
    if not p.quantized:
        raise Skip(f"precision {p.name} needs no calibration")
    if prequantized(ctx):
        from tasks.prequant import describe
        raise Skip(f"the model is already quantized ({describe(prequantized(ctx))})")
    # only the engine build re-plans (an accuracy or calibration failure is not the plan's)
    return with_replans(ctx, lambda: _calibrate(ctx), partition, on=SegmentBuildError)


def _calibrate(ctx: BuildContext) -> StageResult:
    """calibrate on the current plan (flows.replans.with_replans tries again on a new plan where TensorRT cannot build a segment)."""
    from tasks.quantization import judge_feeds_of, low_share_warning, qdq_for_segments, unreached_warning
    from tasks.accuracy import judged_samples
    from tasks.partition import Rest, segment_feeds
    from tasks.prequant import float_weight_segments, restore_weight_scales, weight_only_weights, weight_scales_note
    from tasks.evaluate import input_ranges

    p, c = ctx.cfg.precision, ctx.cfg.calibration
    cal, held = ctx.data.calibration, ctx.data.search
    segs, plan, model = trt_segments(ctx), ctx.results["partition"].details, ctx.results["export"].files["onnx"]
    # the margin from the held-out and judged samples (tasks.accuracy.budget.judged_samples), the candidates the search
    # may judge and validation's samples (tasks/accuracy/budget.py), unless calibration.budget_margin is given
    judged = judged_samples(held.distinct if held else 0, cal.distinct, len(held.feeds) if held else 0)
    from tasks.quantization.qdq import QUANT_OPS
    margin = margin_of(ctx, segs, held.distinct if held else 0, judged, QUANT_OPS) if c.search else None
    goal = search_goal(ctx, segs, judged, margin=margin) if c.search else None
    target = goal.target if goal is not None else None
    q_parts = key_parts(ctx, "calibrate-qdq", segments=[sha256_file(s["onnx"]) for s in segs], calibration=cal.key,
                        search=held.key if held else None, min_cosine=target)
    if goal is not None and goal.by_metric:  # the user's metric decides the stopping point
        q_parts["metric"] = metric_part(ctx, goal.judge.metric, target=goal.judge.target)
    through = bool(plan.get("hybrid")) and c.search  # a split model: candidates judged through the rest of it
    if through:
        q_parts["through"] = sha256_file(ctx.results["partition"].files["partition"])

    def quantize(d: Path) -> StageResult:
        def progress(seg: int):
            return sample_progress(f"calibrating ({c.method or 'default method'}, segment {seg})", ctx.show_progress)
        # weight-only quantized weights: calibration quantizes float weights, then the model's own codes and scales
        # go back where a layer's weight was quantized per output channel (tasks.prequant.weight_only)
        shipped = float_weight_segments(segs, d) if weight_only_weights(ctx.results["export"].details) else {}
        rest = Rest(model, plan, ctx.results["partition"].files, [o["name"] for o in ctx.results["export"].details["outputs"]],
                    judge_feeds_of(cal.feeds, held.feeds if held else None)) if through else None
        try:
            r = qdq_for_segments([{**s, "onnx": shipped[s["index"]][0]} if s["index"] in shipped else s for s in segs],
                                 lambda i: segment_feeds(model, plan, i, cal.feeds),
                                 (lambda i: segment_feeds(model, plan, i, held.feeds)) if held else None, d,
                                 method=c.method, precision=p.name, min_cosine=target, progress=progress,
                                 data_max=ctx.cfg.build.fp16_data_max, metric=goal and goal.judge, rest=rest,
                                 random_inputs=cal.kind == "random")
        except AccuracyError as e:  # the refusal is a result too (its sensitivity report, the search's figures):
            if getattr(e, "result", None) is None:  # cached, raised below
                raise
            return e.result
        if shipped:
            r.details["weight_scales_kept"] = restore_weight_scales(r.files, shipped)
        r.details["input_ranges"] = input_ranges(cal.feeds)  # what a failed validation's samples are compared with
        return r

    q = ctx.cached("calibrate", q_parts, quantize, entry="calibrate-qdq", data=True)
    # a search reference that is not finite (tasks/accuracy/nonfinite.py), refused or not
    warn_all(ctx, "calibrate", [w for d in q.details.get("segments", []) for w in (d.get("nonfinite") or {}).get(
        "warnings", [])])
    refused = q.details.get("refused")
    if refused:  # the failed result keeps the sensitivity report and the search's figures
        err = AccuracyError(refused["message"], stage="calibrate", file=refused.get("file"), fix=refused.get("fix"))
        err.result = StageResult(files={k: v for k, v in q.files.items() if k.startswith("sensitivity")},
                                 metrics=q.metrics, details={"quantization": q.details})
        raise err
    e_parts = key_parts(ctx, "calibrate-engine", qdq=[sha256_file(q.files[f"qdq{s['index']}"]) for s in segs],
                        profiles=[s["profiles"] for s in segs], backend=ctx.backend.version)

    e = ctx.cached("calibrate", e_parts, lambda d: engines_for(ctx, segs, {s["index"]: q.files[f"qdq{s['index']}"]
                                                                       for s in segs}, p.name, p.name, d, "calibrate"),
                   entry="calibrate-engine")
    kept = q.details.get("weight_scales_kept")
    if kept:
        ctx.stages.setdefault("calibrate", {})["note"] = weight_scales_note(kept)
    files = {**e.files, **{f"onnx{s['index']}": q.files[f"qdq{s['index']}"] for s in segs},
             **{k: v for k, v in q.files.items() if k.startswith("sensitivity")}}
    details = {"engines": [{**x, "onnx": q.files[f"qdq{x['segment']}"].name} for x in e.details["engines"]],
               "quantization": q.details, **({"search_margin": margin.words} if margin is not None else {})}
    warn_all(ctx, "calibrate", [w for w in (low_share_warning(q.details["segments"], p.name),
                                            unreached_warning(q.details["segments"])) if w])
    aim = {"search_target": target, **margin.metrics()} if goal is not None and "search_runs" in q.metrics else {}
    return StageResult(files=files, metrics={**q.metrics, **e.metrics, **aim}, details=details)


def margin_of(ctx: BuildContext, segs: list[dict], held: int, judged: int, ops: tuple[str, ...] | None = None):
    """The search's margin (tasks.search.search_margin): the layers it chooses among counted as the ``ops`` nodes
    (every node: None) of the largest segment."""
    from tasks.graph.load import load_onnx
    from tasks.search import search_margin

    layers = max((sum(1 for n in load_onnx(Path(s["onnx"])).graph.node if ops is None or n.op_type in ops)
                  for s in segs), default=1)
    val = ctx.data.validation
    return search_margin(ctx.cfg.calibration.budget_margin, held, judged, layers, val.distinct if val else None)


def fixed_margin(ctx: BuildContext):
    """fp16's search margin: calibration.budget_margin, else tasks.accuracy.budget.FIXED_MARGIN, as given."""
    from tasks.accuracy.budget import FIXED_MARGIN
    from tasks.search import search_margin

    m = ctx.cfg.calibration.budget_margin
    return search_margin(FIXED_MARGIN if m is None else m, 0, 0, 1, None)


def accuracy_metric(ctx: BuildContext):
    """The metric of ``accuracy`` (tasks/accuracy/metric.py): a user function imported from the working or config dir."""
    from tasks.accuracy import from_config

    return from_config(ctx.cfg.accuracy, ctx.inputs.search)


def metric_part(ctx: BuildContext, metric, **extra) -> dict:
    """The part of a cache key for the metric that decides: its settings (and ``extra``: the search's target) and, for
    a user function, its module's fingerprint."""
    from tasks.accuracy import fingerprint

    return {"settings": metric.settings(), **extra, **(fingerprint(ctx.cfg.accuracy, ctx.inputs.search) or {})}


def search_goal(ctx: BuildContext, segs: list[dict], samples: int | None, stage: str = "calibrate", margin=None):
    """The judge and target of the accuracy search (int8's in calibrate, fp16's in build; tasks/search/goal.py);
    ``samples``: how many judge it (None: the margin as given); ``margin`` (``margin_of``): the margin, derived or
    calibration.budget_margin's. What it says is said once by ``stage``."""
    from tasks.search import search_goal as goal_of

    if margin is None:
        margin = margin_of(ctx, segs, samples or 0, samples or 0)
    goal = goal_of(accuracy_metric(ctx), ctx.cfg.accuracy.min_cosine, margin.share, None if margin.derived else samples,
                   segs if stage == "build" else None, [o["name"] for o in ctx.results["export"].details["outputs"]],
                   bool(ctx.results["partition"].details.get("hybrid")))
    if goal.warning:
        ctx.warn(stage, goal.warning)
    return goal


def engines_for(ctx: BuildContext, segs: list[dict], graphs: dict[int, Path], label: str, precision: str, d: Path,
                stage: str) -> StageResult:
    from tasks.engines import engines_for_segments

    t = ctx.cfg.target
    return engines_for_segments(segs, graphs, f"{ctx.cfg.model.name}.{t.name}.{label}", t.compute_capability,
                                ctx.c("build"), ctx.backend, d, stage, f"{ctx.cfg.model.name} {t.name} {precision}",
                                ctx.show_progress, label=label)


def validate(ctx: BuildContext) -> StageResult:
    from tasks.data import describe_thin
    from tasks.onnxrt import emulation_label
    from tasks.evaluate import gate, logit_runners, validate_onnx, validation_fix, validation_reference

    if not ctx.cfg.stages.validate:
        raise Skip("disabled (stages.validate=false)")
    ref, cand, val = ctx.results["export"], deliverable(ctx), ctx.data.validation
    against = validation_reference(ref.files, ref.details, ctx.cfg.model.reference, ctx.c("model.constants"))
    reference, reference_label, shipped, dequantized = against.path, against.label, against.shipped, against.dequantized
    ctx.stages.setdefault("validate", {})["reference"] = reference_label
    cc = ctx.cfg.target.compute_capability
    gpu = trt_backend.gpu_for(cc) if ctx.cfg.validation.engine else None
    engine_reason = None if gpu else ("disabled (validation.engine=false)" if not ctx.cfg.validation.engine
                                      else trt_backend.no_gpu_reason(cc))
    segs = {s["index"]: s["onnx"] for s in trt_segments(ctx)}
    candidates = engines_of(cand)
    identical = not shipped and all(same_graph(o, segs[i]) for i, _, o in candidates)
    hybrid = bool(ctx.results["partition"].details.get("hybrid"))
    parts = key_parts(ctx, "validate", reference=sha256_file(reference), candidate=[sha256_file(o) for _, _, o in candidates],
                      plan=sha256_file(ctx.results["partition"].files["partition"]), data=val.key,
                      engines=[sha256_file(e) for _, e, _ in candidates] if engine_reason is None else None,
                      dequantized=file_hash(ref, "onnx") if shipped and dequantized else None)
    metric = accuracy_metric(ctx)
    if metric.name != "cosine" or metric.gate_logits:  # what decides the verdict (a user function: its module too)
        parts["metric"] = metric_part(ctx, metric)
    if ctx.cfg.validation.labels:  # the user function's labels=, per validation batch
        parts["labels"] = sha256_file(ctx.cfg.validation.labels)
    label = f"{ctx.cfg.model.name} at {ctx.cfg.precision.name}"
    cal = ctx.results.get("calibrate")
    fix = validation_fix(prequantized(ctx), None if cal is None else cal.metrics, val.samples,
                         ctx.cfg.calibration.budget_margin, ctx.cfg.calibration.search, metric.name)

    def work(d: Path) -> StageResult:  # the data is made (rendered, read) here: a cached verdict needs none of it
        evidence = [w for w in (describe_thin(val),) if w]
        labels = None
        if ctx.cfg.validation.labels:
            from tasks.accuracy import labels_per_feed, load_labels
            from tasks.data import batch_size
            labels = labels_per_feed(load_labels(ctx.cfg.validation.labels, sum(batch_size(f) for f in val.feeds)),
                                     val.feeds)
        with contextlib.ExitStack() as runners:
            engine = candidate_runner(ctx, runners=runners) if engine_reason is None else None
            try:
                r = validate_onnx(reference, candidate_runner(ctx), val.feeds, ctx.cfg.accuracy.min_cosine,
                                  val.source, d / "validation.json", engine=engine, engine_skip_reason=engine_reason,
                                  label=label, reference_label=reference_label, identical=identical,
                                  emulation=emulation_label(ctx.cfg.precision.name),
                                  engine_device=gpu and f"engine on {gpu.name} (sm {gpu.compute_capability})",
                                  evidence=evidence, fix=fix, metric=metric,
                                  logits=logit_runners(reference, candidates, identical, hybrid), labels=labels,
                                  random_inputs=val.kind == "random")
            except TrtforgeError as e:  # the failed verdict is a result too: cached, gated below
                if getattr(e, "result", None) is None:
                    raise
                r = e.result
            if shipped and dequantized:  # how far the float model the engine computes is from the model as shipped
                from tasks.prequant import dequantized_vs_shipped
                apart, judged = dequantized_vs_shipped(ref.files["onnx"], reference, val.feeds, metric)
                r.metrics["dequantized_vs_shipped_cosine_min"] = apart
                if judged is not None:  # the user's metric decides what the fix says
                    r.metrics["dequantized_vs_shipped_score"] = judged["score"]
                    r.details["dequantized_vs_shipped"] = judged
            return r

    r = ctx.cached("validate", parts, work, data=True)
    if r.details.get("left_out"):  # shapes the fp32 model itself fails on: a property of the model, said once
        ctx.warn("validate", r.details["warnings"][0])
    for w in r.details.get("evidence", []):
        ctx.warn("validate", w)
    nonfinite = r.details.get("nonfinite") or {}
    for w in nonfinite.get("warnings", []) + nonfinite.get("notes", []):
        ctx.warn("validate", w)  # a reference that is not finite, and outputs compared on their finite part
    apart = r.metrics.get("dequantized_vs_shipped_cosine_min")
    if apart is not None:
        from tasks.prequant import dequantized_fix
        fix = dequantized_fix(apart, val.kind == "random", ctx.cfg.accuracy.min_cosine,
                              r.details.get("dequantized_vs_shipped"))
        if not r.details["passed"]:
            ctx.warn("validate", fix)
    gate(r, label=label, fix=fix,
         calibration_ranges=None if cal is None else (cal.details.get("quantization") or {}).get("input_ranges"))
    return r


def benchmark(ctx: BuildContext) -> StageResult:
    from tasks.evaluate import baseline_note, benchmark_model, engine_timing, host_info
    from tasks.data import generated_feeds
    from tasks.trt import EngineRunner, runtime_cache_file

    if not ctx.cfg.stages.benchmark:
        raise Skip("disabled (stages.benchmark=false)")
    ref, eng_r, cc, p = ctx.results["export"], deliverable(ctx), ctx.cfg.target.compute_capability, ctx.cfg.precision
    opt = {n: {"min": r["opt"], "opt": r["opt"], "max": r["opt"]} for n, r in ctx.inputs.profiles[0].items()}
    gpu, bench, hybrid = trt_backend.gpu_for(cc), ctx.c("benchmark"), ctx.results["partition"].details.get("hybrid")
    build_metrics = {k: ctx.metrics[k] for k in ("engine_bytes", "build_seconds", "baseline_engine_bytes",
                                                 "baseline_build_seconds") if k in ctx.metrics}
    parts = key_parts(ctx, "benchmark", onnx=file_hash(ref, "onnx"), host=host_info(), gpu=gpu and gpu.name,
                      shape={n: list(r["opt"]) for n, r in opt.items()},
                      engines=[sha256_file(e) for _, e, _ in engines_of(eng_r)] if gpu else None)
    cache = runtime_cache_file(ctx.cfg.cache_dir, ctx.cfg.target.name, ctx.backend.version)

    def work(d: Path) -> StageResult:  # the input is made here: a cached timing needs none
        feed = generated_feeds(ctx.inputs.inputs, [opt], 0, ctx.cfg.seed, recipe=ctx.c("model.images"),
                               each_image_once=False)[0]
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


# --- the stage table ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """A row of the stage table: the stage's name, per cache entry it keeps the config values its key holds (the key's
    part -> the config key; the rest of the key is what the stage computes), and the function that runs it."""
    name: str
    keys: dict[str, dict[str, str]]
    run: Callable[[BuildContext], StageResult | None]


_ENGINE_KEYS = {"build": "build", "compute_capability": "target.compute_capability"}
TABLE: dict[str, Stage] = {s.name: s for s in (
    Stage("export", {"export": {"format": "model.format", "factory": "model.factory", "inputs": "model.inputs",
                                "opset": "model.opset", "dequantize_dynamic": "model.dequantize_dynamic",
                                "asymmetric": "model.asymmetric"}}, export),
    Stage("partition", {"partition": {"partition": "partition"}}, partition),  # a re-plan keys its own settings
    Stage("build", {"build": _ENGINE_KEYS}, build),
    Stage("calibrate", {"calibrate-qdq": {"method": "calibration.method", "precision": "precision.name",
                                          "fp16_data_max": "build.fp16_data_max"},
                        "calibrate-engine": _ENGINE_KEYS}, calibrate),
    Stage("validate", {"validate": {"min_cosine": "accuracy.min_cosine",
                                    "precision": "precision.name"}}, validate),  # precision: in the result's labels
    Stage("benchmark", {"benchmark": {"bench": "benchmark"}}, benchmark),
)}
assert tuple(TABLE) == STAGES, "the stage table runs the stages of tasks/schema.py in their order"
_ENTRY_KEYS = {entry: keys for s in TABLE.values() for entry, keys in s.keys.items()}


def key_parts(ctx: BuildContext, entry: str, **computed) -> dict:
    """The key of a cache entry: its config values by the stage table, and what the stage computed (which wins)."""
    return {**{part: ctx.c(key) for part, key in _ENTRY_KEYS[entry].items()}, **computed}
