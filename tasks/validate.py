"""Stage 5, validate: the precision-transformed graph (and the engine, on a supported GPU) against fp32."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import AccuracyError, StageError
from .inputs import batch_size
from .metrics import compare, headline, summarize
from .ort import ort_run, ort_session
from .util import StageResult, write_json

NEAR_ZERO = 1e-4  # reference outputs smaller than this everywhere make a cosine meaningless


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


def validate_onnx(reference: Path, candidate: Path | Callable, feeds: list[dict[str, np.ndarray]], min_cosine: float,
                  inputs_source: str, out_path: Path, engine: Callable | None = None,
                  engine_skip_reason: str | None = None, label: str | None = None,
                  emulation: str = "onnxruntime emulation", engine_device: str | None = None,
                  reference_label: str = "fp32", identical: bool = False,
                  evidence: list[str] | None = None, fix: str | None = None) -> StageResult:
    """Compare candidate (an ONNX file, or a callable such as a composed hybrid model) to the fp32 reference in
    ONNX Runtime on every feed; gate on min_cosine (``gate``); write a JSON report.

    `cosine_min` is the gate's number and `cosine_source` says what it measured: the engine's outputs when an `engine`
    runner is given (run only on the inputs the reference accepts; `engine_device`, e.g. "engine on NVIDIA L4 (sm
    8.9)"), else the candidate graph in ONNX Runtime (`emulation`, e.g. "onnxruntime emulation of int8"). Both are also
    kept under their own names: `emulation_cosine_min` and, when the engine ran, `engine_cosine_min`.

    ``identical``: the candidate graph is the reference graph itself (fp32 on a host without the GPU, a model passed
    through as it is): comparing it with itself measures nothing, so no emulation cosine is reported and the gate does
    not apply ("identical graph, not measured"); an engine, when it runs, is still measured.

    ``evidence``: why the inputs are weak evidence (random values, few samples), said in the verdict and warnings.

    Every session is exact (tasks/ort.py): Q/DQ and integer ops computed as written, the same on any x86-64 CPU."""
    t0 = time.perf_counter()
    ref_sess = ort_session(reference)
    refs, kept, warnings = reference_outputs(ref_sess, feeds)
    left_out = [{n: list(a.shape) for n, a in f.items()} for i, f in enumerate(feeds) if i not in set(kept)]
    feeds = [feeds[i] for i in kept]
    samples = sum(batch_size(f) for f in feeds)
    evidence = list(evidence or [])
    measured: dict[str, dict] | None = None  # per output, of what the gate judges
    metrics: dict = {"validate_feeds": len(feeds), "validate_samples": samples}
    emulation_report: dict = {"source": emulation, "status": "not measured",
                              "reason": "the candidate graph is the reference graph itself"}
    if not identical:
        run_candidate = candidate if callable(candidate) else (lambda f, s=ort_session(candidate): ort_run(s, f))
        per_feed = [compare(r, run_candidate(f)) for r, f in zip(refs, feeds)]
        emu = summarize(per_feed)
        emulation_report = {"source": emulation, "status": "ok", "cosine_min": headline(emu)["cosine_min"],
                            "outputs": emu, "per_feed": per_feed}
        metrics["emulation_cosine_min"] = emulation_report["cosine_min"]
        measured, source = emu, emulation
    if engine is not None:
        eng = summarize([compare(r, engine(f)) for r, f in zip(refs, feeds)])
        engine = {"status": "ok", "device": engine_device, "outputs": eng, "cosine_min": headline(eng)["cosine_min"]}
        metrics["engine_cosine_min"] = engine["cosine_min"]
        measured, source = eng, engine_device or "engine"  # the engine is what ships
    else:
        engine = {"status": "skipped", "reason": engine_skip_reason or "engine execution not requested"}
    if measured is not None:
        metrics.update(headline(measured), cosine_source=source)
        near_zero = [n for n, m in measured.items() if m["ref_max_abs"] < NEAR_ZERO]
        if near_zero:
            warnings.append(f"reference outputs {near_zero} are ~0 on these inputs (max |x| < {NEAR_ZERO}); their cosine "
                            "compares rounding noise: give validation.data or model.images for a meaningful check")
    else:
        evidence.insert(0, "identical graph, not measured: the graph TensorRT builds is the reference graph itself, "
                           "so ONNX Runtime can only compare it with itself; the engine's own accuracy needs a GPU of the "
                           "target's compute capability")
    passed = measured is None or metrics["cosine_min"] >= min_cosine
    report = {
        "reference": reference_label, "inputs": inputs_source, "samples": samples,
        "feeds": [{n: list(a.shape) for n, a in f.items()} for f in feeds], "left_out": left_out,
        "min_cosine": min_cosine, "identical": identical, "measured": measured is not None,
        "cosine_min": metrics.get("cosine_min"), "cosine_source": metrics.get("cosine_source"),
        "outputs": measured or {}, "emulation": emulation_report, "engine": engine,
        "evidence": evidence, "warnings": warnings, "passed": passed,
        "verdict": verdict_text(metrics, passed, min_cosine, reference_label, samples, inputs_source, evidence),
    }
    write_json(out_path, report)
    metrics["validate_seconds"] = time.perf_counter() - t0
    result = StageResult(files={"validation": out_path}, metrics=metrics, details=report)
    gate(result, label=label or (None if callable(candidate) else str(candidate)), fix=fix)
    return result


def verdict_text(metrics: dict, passed: bool, min_cosine: float, reference_label: str, samples: int, inputs: str,
                 evidence: list[str]) -> str:
    """The verdict in words a user reads before shipping."""
    if "cosine_min" not in metrics:
        head = "not measured"
    else:
        head = (f"{'passed' if passed else 'FAILED'}: cosine_min {metrics['cosine_min']:.6f} "
                f"{'>=' if passed else '<'} accuracy.min_cosine={min_cosine} vs {reference_label}, measured by "
                f"{metrics['cosine_source']}")
    text = f"{head} on {samples} samples of {inputs}"
    if evidence:
        text += "; " + "; ".join(evidence)
    return text


def gate(result: StageResult, label: str | None = None, fix: str | None = None) -> None:
    """Raise the AccuracyError of a failed verdict (a fresh one or one served from the cache): the one place its
    message is written."""
    r = result.details
    if r["passed"]:
        return
    worst = min(r["outputs"], key=lambda n: r["outputs"][n]["cosine"])
    err = AccuracyError(
        f"output {worst!r} has cosine {r['cosine_min']:.6f} to {r['reference']} ({r['cosine_source']}), below "
        f"accuracy.min_cosine={r['min_cosine']}",
        stage="validate", file=label,
        fix=fix or "use a higher precision, or lower accuracy.min_cosine if that loss is acceptable")
    err.result = result
    raise err
