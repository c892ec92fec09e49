"""Stage 3, build: the graph at the build precision, compiled to a strongly typed TensorRT engine."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from tasks.trt.backend import Backend, progress_monitor
from tasks.common.errors import SegmentBuildError, StageError
from tasks.common.native import quiet_native
from tasks.common.util import StageResult, sha256_file


SHIPPED_METRICS = ("build_seconds", "engine_bytes")  # always of the engines that ship


def as_baseline(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics of an engine built on the way to the shipped one (the fp16/fp32 baseline of an int8/fp8 build) under
    `baseline_*`, so `build_seconds`/`engine_bytes` always describe the engines that ship."""
    return {("baseline_" + k if k in SHIPPED_METRICS else k): v for k, v in metrics.items()}


def add_metrics(total: dict[str, Any], part: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Sum per-segment metrics; a key no segment measured stays absent (never a 0 that was not measured)."""
    for k in keys:
        if k in part:
            total[k] = total.get(k, 0) + part[k]


def engines_of(r: StageResult) -> list[tuple[int, Path, Path]]:
    """(segment index, engine file, precision ONNX file) of a build or calibrate result, in segment order."""
    return [(e["segment"], r.files[f"engine{e['segment']}"], r.files[f"onnx{e['segment']}"]) for e in r.details["engines"]]


def same_graph(a: Path, b: Path) -> bool:
    """Whether two ONNX files hold the same graph: byte for byte, or the same graph under other model metadata (weights
    in external-data files are compared only byte for byte: such graphs count as different)."""
    if sha256_file(a) == sha256_file(b):
        return True
    import onnx

    ga, gb = (onnx.load(str(p), load_external_data=False).graph for p in (a, b))
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in (*ga.initializer, *gb.initializer))
    return not external and ga.SerializeToString(deterministic=True) == gb.SerializeToString(deterministic=True)


def onnx_at_precision(fp32_path: Path, precision: str, out_path: Path, keep_fp32: dict[str, float] | None = None,
                      cancel_fp32: dict[str, float] | None = None, tiny_fp32: dict[str, float] | None = None,
                      search: dict | None = None) -> StageResult:
    """Precision is a property of the graph (strongly typed networks): "as_is" (a model that arrived quantized, as
    shipped), fp32 (a model that works in fp16 computed in fp32: its fp16 weights and casts upcast), fp16 converted
    (``keep_fp32``, ``cancel_fp32``, ``tiny_fp32``: values whose nodes stay fp32,
    tasks.fp16.hazards.fp16_hazards_from_data). ``search`` (fp16): {"feeds", "target", "samples_text", "budget",
    "metric" (tasks.accuracy.metric.SearchJudge, optional)}: the nodes to keep fp32 until the held-out samples meet the
    target (tasks.fp16.search)."""
    t0 = time.perf_counter()
    if precision == "as_is":
        shutil.copyfile(fp32_path, out_path)
        return StageResult(files={"onnx": out_path}, metrics={})
    import onnx

    from tasks.graph.models import save_onnx

    if precision == "fp32":
        from tasks.graph.edit import fp32_from_fp16

        model = onnx.load(str(fp32_path))
        upcast = fp32_from_fp16(model)
        if not upcast:
            shutil.copyfile(fp32_path, out_path)
            return StageResult(files={"onnx": out_path}, metrics={})
        save_onnx(model, out_path)
        return StageResult(files={"onnx": out_path}, metrics={"convert_seconds": time.perf_counter() - t0},
                           details={"fp32_from_fp16": upcast})
    if precision != "fp16":
        raise StageError(f"no graph conversion for precision {precision!r} in build (int8/fp8 come from calibrate)",
                         stage="build")
    from tasks.fp16.convert import fp16_from_onnx

    source = onnx.load(str(fp32_path))

    def convert(keep_nodes: dict[str, float]):
        try:
            return fp16_from_onnx(source, keep_fp32, cancel_fp32, tiny_fp32, keep_nodes)
        except Exception as e:
            raise StageError(f"fp16 conversion failed: {type(e).__name__}: {e}", stage="build",
                             file=str(fp32_path)) from e

    if search and search.get("feeds"):
        from tasks.fp16.search import fp16_within_budget

        r = fp16_within_budget(fp32_path, out_path, search["feeds"], search["target"], convert=convert,
                               metric=search.get("metric"), samples_text=search.get("samples_text", "held-out samples"),
                               budget=search.get("budget"))
        r.metrics["convert_seconds"] = time.perf_counter() - t0
        return r
    model, stats = convert({})
    save_onnx(model, out_path)
    return StageResult(files={"onnx": out_path}, metrics={"convert_seconds": time.perf_counter() - t0}, details=stats)


def check_types(path: Path, segment: int, stage: str) -> None:
    """Refuse a precision graph in which a node's float inputs of one type group have two types (TensorRT's "must be
    of same type"), naming the node and the two types."""
    import onnx

    from tasks.graph.types import mixed_input_types

    bad = mixed_input_types(onnx.load(str(path), load_external_data=False))
    if bad:
        node, op, a, ta, b, tb = bad[0]
        more = f" (and {len(bad) - 1} more nodes)" if len(bad) > 1 else ""
        raise SegmentBuildError(
            f"the precision graph gives node {node!r} ({op}) inputs of two types: {a!r} is {ta}, {b!r} is {tb}{more}; "
            f"TensorRT takes one type per node", segment=segment, stage=stage, file=str(path),
            fix=f"this is a conversion fault, please report it with the model; meanwhile precision=fp32 builds it, or "
                f"partition.exclude_ops=[{op}] runs {op} nodes in ONNX Runtime")


def build_error(model, profiles: list[dict], precision: str, compute_capability: str, build_cfg: Any,
                backend: Backend, seconds: float | None = None) -> str | None:
    """Whether a (sub)graph builds at ``precision`` as the build stage would build it: None, or the builder's words
    (tasks.partition.partition.TIMED_OUT when the build ran past ``seconds`` and was cancelled). For the fallback's bisection
    (tasks.partition.partition.failing_node)."""
    import tempfile

    import onnx

    from tasks.trt.backend import deadline_monitor
    from tasks.partition.partition import TIMED_OUT

    monitor = deadline_monitor(backend.trt, seconds) if seconds else None
    with tempfile.TemporaryDirectory(prefix="trtforge-reduce-") as d, quiet_native(None):
        path = Path(d) / "sub.onnx"
        onnx.save(model, str(path))
        try:
            graph = onnx_at_precision(path, precision if precision in ("fp16", "fp32") else "as_is",
                                      Path(d) / "sub.p.onnx").files["onnx"]
            backend.build_engine(str(graph), profiles, compute_capability, optimization_level=build_cfg["optimization_level"],
                                 workspace_mib=build_cfg["workspace_mib"], progress=monitor, stage="build")
        except StageError as e:
            return TIMED_OUT if monitor is not None and monitor.cancelled else e.message
    return None


def engine_from_onnx(onnx_path: Path, engine_path: Path, profiles: list[dict], compute_capability: str,
                     build_cfg: Any, backend: Backend, show_progress: bool = True, stage: str = "build") -> StageResult:
    """Build one engine from one ONNX file; GPU-less noise is captured, a Rich progress bar is drawn."""
    t0 = time.perf_counter()
    term: list = []
    with quiet_native(term if show_progress else None) as captured:
        monitor = progress_monitor(backend.trt, term[0]) if show_progress else None
        try:
            engine = backend.build_engine(str(onnx_path), profiles, compute_capability,
                                          optimization_level=build_cfg["optimization_level"],
                                          workspace_mib=build_cfg["workspace_mib"], progress=monitor, stage=stage)
        finally:
            if monitor is not None:
                monitor.progress.stop()
    seconds = time.perf_counter() - t0
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = engine_path.with_suffix(".partial")
    tmp.write_bytes(engine)
    tmp.replace(engine_path)
    return StageResult(
        files={"engine": engine_path},
        metrics={"build_seconds": seconds, "engine_bytes": len(engine)},
        details={"sha256": sha256_file(engine_path), "backend": backend.version, "compute_capability": compute_capability,
                 "native_log": captured.meaningful[-50:]},
    )


def engines_for_segments(segments: list[dict], graphs: dict[int, Path], stem: str, compute_capability: str,
                         build_cfg: Any, backend: Backend, out_dir: Path, stage: str, title: str,
                         show_progress: bool = True, label: str | None = None) -> StageResult:
    """One engine per TensorRT segment from its graph (`graphs`: segment index -> ONNX), named `<stem>[.sg<i>].engine`,
    with the precision profile of what was built (`flops_share`); build_seconds/engine_bytes summed over segments.
    ``label``: the precision the engines are named after; refused when the profile disagrees (tasks.trt.network)."""
    from tasks.trt.network import label_disagreement, precision_profile

    for s in segments:  # a node reading two float types is refused by TensorRT; say which, before it does
        check_types(Path(graphs[s["index"]]), s["index"], stage)
    # what the engines will compute, from the networks TensorRT parses, before the (longer) builds: the name must say it
    try:
        prof = precision_profile([graphs[s["index"]] for s in segments], [s["profiles"] for s in segments], backend,
                                 out_dir, title)
    except SegmentBuildError:
        raise
    except StageError as e:  # the parse of one segment's graph failed: the fallback narrows it down, as for a build
        seg = next((s["index"] for s in segments if str(graphs[s["index"]]) == e.file), None)
        if seg is None:
            raise
        raise SegmentBuildError(e.message, segment=seg, stage=e.stage, file=e.file, fix=e.fix) from e
    share = prof.metrics.get("flops_share")
    wrong = label and label_disagreement(label, share)
    if wrong:
        eight_bit = label in ("int8", "fp8") and not (share or {}).get(label)  # its Q/DQ reach no TensorRT layer
        raise StageError(f"an engine named {label} would compute {wrong}", stage=stage,
                         fix=(f"build it at precision=fp16: none of its {label} layers is in a TensorRT part (a model "
                              "that arrives quantized dynamically runs those layers in ONNX Runtime; "
                              f"model.dequantize_dynamic=true dequantizes them to calibrate them to {label})")
                         if eight_bit else
                         ("build it at the precision it computes (precision=fp32 when fp16 keeps every layer in "
                          "fp32: see the conversion's reasons; build.fp16_data_max decides range-kept layers)"))
    files, metrics, details = {}, {}, {"engines": [], "backend": backend.version, "compute_capability": compute_capability}
    for s in segments:
        try:
            eng = engine_from_onnx(graphs[s["index"]], out_dir / f"{stem}{s['name']}.engine", s["profiles"],
                                   compute_capability, build_cfg, backend, show_progress=show_progress, stage=stage)
        except SegmentBuildError:
            raise
        except StageError as e:  # which segment: the fallback (tasks.partition.partition.build_fallback) narrows it down
            raise SegmentBuildError(e.message, segment=s["index"], stage=e.stage, file=e.file, fix=e.fix) from e
        files[f"engine{s['index']}"] = eng.files["engine"]
        add_metrics(metrics, eng.metrics, SHIPPED_METRICS)
        details["engines"].append({"segment": s["index"], "engine": eng.files["engine"].name,
                                   "onnx": Path(graphs[s["index"]]).name, "sha256": eng.details["sha256"]})
    files.update(prof.files)
    metrics.update(prof.metrics)
    metrics.update(precision_boundaries(prof.metrics, [files[f"engine{s['index']}"] for s in segments],
                                        compute_capability, backend))
    details["precision_profile"] = prof.details
    if "reformat_layers" in metrics:
        from tasks.trt.boundaries import describe_boundaries
        details["precision_boundaries"] = describe_boundaries(metrics)
    return StageResult(files=files, metrics=metrics, details=details)


def precision_boundaries(profile: dict, engines: list[Path], compute_capability: str, backend: Backend) -> dict:
    """The precision boundaries a build reports (tasks/trt/boundaries.py): the estimate on the TensorRT network from
    ``profile``, and where a GPU of the target is present, the engines' own reformat layers (summed over segments)."""
    from tasks.trt.backend import gpu_for, no_gpu_reason
    from tasks.trt.boundaries import reformats_from_engine, reported

    if "network_reformat_layers" not in profile:
        return {}
    gpu = gpu_for(compute_capability)
    if gpu is None:
        return reported(profile, engine_reason=no_gpu_reason(compute_capability))
    device = f"{gpu.name} (sm {gpu.compute_capability})"
    read = [reformats_from_engine(Path(e).read_bytes(), backend, device) for e in engines]
    sizes = [r["reformat_bytes"] for r in read]
    return reported(profile, {"reformat_layers": sum(r["reformat_layers"] for r in read), "device": device,
                              "reformat_bytes": None if None in sizes else sum(sizes)})
