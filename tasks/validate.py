"""Stage 5, validate: the precision-transformed graph (and the engine, on a supported GPU) against fp32."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import AccuracyError, StageError
from .runtime import ort_run, ort_session
from .util import StageResult, write_json

NEAR_ZERO = 1e-4  # reference outputs smaller than this everywhere make a cosine meaningless


def compare(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per output: max/mean absolute error and cosine similarity (float64, flattened)."""
    out = {}
    for name, ref in reference.items():
        got = candidate[name]
        a = ref.astype(np.float64).ravel()
        b = got.astype(np.float64).ravel()
        if a.shape != b.shape:
            out[name] = {"cosine": 0.0, "max_abs": float("inf"), "mean_abs": float("inf"), "ref_max_abs": float(np.abs(a).max(initial=0)),
                         "error": f"shape {list(got.shape)} != reference {list(ref.shape)}"}
            continue
        finite = bool(np.isfinite(b).all())
        diff = np.abs(a - b)
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        if na == 0 and nb == 0:
            cos = 1.0
        elif na == 0 or nb == 0 or not finite:
            cos = 0.0
        else:
            cos = float(np.dot(a, b) / (na * nb))
        out[name] = {"cosine": cos, "max_abs": float(diff.max(initial=0)) if finite else float("inf"),
                     "mean_abs": float(diff.mean()) if finite and diff.size else 0.0,
                     "ref_max_abs": float(np.abs(a).max(initial=0)),
                     "_dot": float(np.dot(a, b)) if finite else 0.0, "_na2": float(na * na), "_nb2": float(nb * nb) if finite else 0.0}
    return out


def summarize(per_feed: list[dict[str, dict]]) -> dict[str, dict]:
    """Per output over the whole validation set: the cosine of all its values together (what `cosine_min` gates on),
    the worst single feed's cosine, and the largest errors."""
    worst: dict[str, dict] = {}
    sums: dict[str, list[float]] = {}
    for res in per_feed:
        for name, m in res.items():
            w = worst.setdefault(name, {"cosine": 1.0, "cosine_worst_feed": 1.0, "max_abs": 0.0, "mean_abs": 0.0, "ref_max_abs": 0.0})
            w["cosine_worst_feed"] = min(w["cosine_worst_feed"], m["cosine"])
            w["max_abs"] = max(w["max_abs"], m["max_abs"])
            w["mean_abs"] = max(w["mean_abs"], m["mean_abs"])
            w["ref_max_abs"] = max(w["ref_max_abs"], m["ref_max_abs"])
            acc = sums.setdefault(name, [0.0, 0.0, 0.0])
            acc[0] += m.pop("_dot", 0.0)
            acc[1] += m.pop("_na2", 0.0)
            acc[2] += m.pop("_nb2", 0.0)
            if "error" in m:
                w["error"] = m["error"]
    for name, (dot, na2, nb2) in sums.items():
        if "error" in worst[name]:
            worst[name]["cosine"] = 0.0
        elif na2 == 0 and nb2 == 0:
            worst[name]["cosine"] = 1.0
        else:
            worst[name]["cosine"] = float(dot / np.sqrt(na2 * nb2)) if na2 > 0 and nb2 > 0 else 0.0
    return worst


def reference_outputs(ref_sess, feeds: list[dict[str, np.ndarray]]) -> tuple[list[dict], list[int], list[str]]:
    """fp32 outputs per feed. A shape on which the fp32 model itself fails is a property of the model (a stride it
    needs), not of the conversion: it is left out, with one warning naming the shapes and model.shape_multiple."""
    import re

    refs, kept, failed, why = [], [], [], ""
    for i, f in enumerate(feeds):
        try:
            refs.append(ort_run(ref_sess, f))
            kept.append(i)
        except StageError as e:
            failed.append({n: list(a.shape) for n, a in f.items()})
            node = re.search(r"running (\w+) node\. Name:'([^']*)'", e.message)
            why = why or (f"its {node.group(1)} node {node.group(2)!r} fails" if node else e.message.split("}: ", 1)[-1][:160])
    if not failed:
        return refs, kept, []
    name, a = max(feeds[0].items(), key=lambda kv: kv[1].ndim)
    k = min(2, max(0, a.ndim - 1))  # the trailing (spatial) dims
    example = "{" + f"{name}: [" + ", ".join(["1"] * (a.ndim - k) + ["32"] * k) + "]}"
    shown = ", ".join(str(s) for s in failed[:4]) + (f" and {len(failed) - 4} more" if len(failed) > 4 else "")
    warning = (f"the fp32 model itself fails on {len(failed)} of {len(feeds)} input shapes ({why}): {shown}; left out of "
               f"validation (a property of the model, not of the conversion): set model.shape_multiple to the model's "
               f"stride per input and dim (e.g. shape_multiple: {example} in the model YAML)")
    if not kept:
        raise StageError(f"the fp32 model fails on every validation input: {warning}", stage="validate",
                         fix="check model.profiles and model.shape_multiple against what the model accepts")
    return refs, kept, [warning]


def spread_note(report: dict, reference_label: str) -> str:
    """'; <reference> agrees with itself only to X ...' for a failed verdict with a measured reference spread."""
    spread = report.get("reference_spread")
    if not spread:
        return ""
    return (f"; {reference_label} itself gives cosine {spread['cosine_min']:.6f} between "
            f"{spread['between']}")


def validate_onnx(reference: Path, candidate: Path | Callable, feeds: list[dict[str, np.ndarray]], min_cosine: float,
                  inputs_source: str, out_path: Path, engine: Callable | None = None,
                  engine_skip_reason: str | None = None, label: str | None = None,
                  emulation: str = "onnxruntime emulation", engine_device: str | None = None,
                  reference_label: str = "fp32", reference_spread: bool = False) -> StageResult:
    """Compare candidate (an ONNX file, or a callable such as a composed hybrid model) to the fp32 reference in
    ONNX Runtime on every feed; gate on min_cosine; write a JSON report.

    `cosine_min` is the gate's number and `cosine_source` says what it measured: the engine's outputs when an `engine`
    runner is given (run only on the inputs the reference accepts; `engine_device`, e.g. "engine on NVIDIA L4 (sm 8.9)"), else the candidate graph in ONNX Runtime
    (`emulation`, e.g. "onnxruntime emulation of int8"). Both are also kept under their own names:
    `emulation_cosine_min` and, when the engine ran, `engine_cosine_min`.

    ``reference_spread`` (a quantized reference, e.g. a model as shipped quantized): the reference is also run with
    ONNX Runtime's graph optimizations off (Q/DQ emulated in float instead of fused into integer kernels) and
    `reference_spread_cosine_min` says how far two correct executions of it already differ: the agreement any other
    implementation, a TensorRT engine included, can be expected to reach. It informs; it does not move the gate."""
    t0 = time.perf_counter()
    ref_sess = ort_session(reference)
    if callable(candidate):
        run_candidate = candidate
    else:
        cand_sess = ort_session(candidate)
        def run_candidate(f):
            return ort_run(cand_sess, f)
    refs, kept, warnings = reference_outputs(ref_sess, feeds)
    left_out = [{n: list(a.shape) for n, a in f.items()} for i, f in enumerate(feeds) if i not in set(kept)]
    feeds = [feeds[i] for i in kept]
    per_feed = [compare(r, run_candidate(f)) for r, f in zip(refs, feeds)]
    worst = summarize(per_feed)
    cosine_min = min(m["cosine"] for m in worst.values())
    near_zero = [n for n, m in worst.items() if m["ref_max_abs"] < NEAR_ZERO]
    if near_zero:
        warnings.append(f"reference outputs {near_zero} are ~0 on these inputs (max |x| < {NEAR_ZERO}); their cosine compares "
                        f"rounding noise: give validation.data or model.images for a meaningful check")
    if inputs_source == "random":
        warnings.append("validated on random inputs inside the profiles (no validation.data, calibration data or model.images)")
    spread = None
    if reference_spread:
        plain = ort_session(reference, optimize=False)
        spread = {"between": "ONNX Runtime with all graph optimizations and with none",
                  "cosine_min": min(m["cosine"] for m in summarize([compare(r, ort_run(plain, f))
                                                                     for r, f in zip(refs, feeds)]).values())}
    emulation_cosine_min, emulation_outputs, source = cosine_min, worst, emulation
    if engine is not None:
        eng = summarize([compare(r, engine(f)) for r, f in zip(refs, feeds)])
        engine = {"status": "ok", "device": engine_device, "outputs": eng,
                  "cosine_min": min(m["cosine"] for m in eng.values())}
        cosine_min, source, worst = engine["cosine_min"], engine_device or "engine", eng  # the engine is what ships
    else:
        engine = {"status": "skipped", "reason": engine_skip_reason or "engine execution not requested"}
    report = {
        "reference": reference_label, "inputs": inputs_source,
        "feeds": [{n: list(a.shape) for n, a in f.items()} for f in feeds], "left_out": left_out,
        "min_cosine": min_cosine, "cosine_min": cosine_min, "cosine_source": source, "outputs": worst,
        "emulation": {"source": emulation, "cosine_min": emulation_cosine_min, "outputs": emulation_outputs},
        "per_feed": per_feed,
        "engine": engine, "warnings": warnings, "passed": cosine_min >= min_cosine,
    }
    if spread is not None:
        report["reference_spread"] = spread
    write_json(out_path, report)
    metrics = {"cosine_min": cosine_min, "cosine_source": source, "emulation_cosine_min": emulation_cosine_min,
               "cosine_worst_feed": min(m["cosine_worst_feed"] for m in worst.values()),
               "max_abs_err": max(m["max_abs"] for m in worst.values()),
               "mean_abs_err": max(m["mean_abs"] for m in worst.values()), "validate_feeds": len(feeds),
               "validate_seconds": time.perf_counter() - t0}
    if engine.get("cosine_min") is not None:
        metrics["engine_cosine_min"] = engine["cosine_min"]
    if spread is not None:
        metrics["reference_spread_cosine_min"] = spread["cosine_min"]
    result = StageResult(files={"validation": out_path}, metrics=metrics, details=report)
    if cosine_min < min_cosine:
        worst_name = min(worst, key=lambda n: worst[n]["cosine"])
        err = AccuracyError(
            f"output {worst_name!r} has cosine {cosine_min:.6f} to {reference_label} ({source}), below "
            f"accuracy.min_cosine={min_cosine}{spread_note(report, reference_label)}",
            stage="validate", file=label or (None if callable(candidate) else str(candidate)),
            fix="use a higher precision, or lower accuracy.min_cosine if that loss is acceptable")
        err.result = result
        raise err
    return result
