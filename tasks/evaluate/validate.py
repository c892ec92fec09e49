"""Stage 5, validate: the precision-transformed graph (and the engine, on a supported GPU) against fp32."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from tasks.common.errors import AccuracyError, StageError
from tasks.common.memory import activity
from tasks.data.inputs import batch_size
from tasks.accuracy.metrics import compare, headline, summarize
from tasks.accuracy.nonfinite import DATA_HOW, finite_part_notes, nonfinite_reference, reference_warnings
from tasks.evaluate.fixes import failing_feeds_text, input_ranges
from tasks.onnxrt.ort import ort_run, ort_session
from tasks.common.util import StageResult, write_json

NEAR_ZERO = 1e-4  # reference outputs smaller than this everywhere make a cosine meaningless
SHOWN_VALUES = 4  # an input of at most this many elements is named with its values in a memory stop


def feed_text(feed: dict[str, np.ndarray]) -> str:
    """A feed in words: each input's shape, and the values of small ones (a scalar that sets a size)."""
    def shown(a: np.ndarray) -> list:
        return [round(float(v), 4) if isinstance(v, float) else v for v in np.asarray(a).ravel().tolist()]
    return ", ".join(f"{n}={shown(a)}" if np.asarray(a).size <= SHOWN_VALUES else f"{n} {list(np.shape(a))}"
                     for n, a in feed.items())


def reference_outputs(ref_sess, feeds: list[dict[str, np.ndarray]]) -> tuple[list[dict], list[int], list[str]]:
    """fp32 outputs per feed. A shape on which the fp32 model itself fails is a property of the model (a stride it
    needs), not of the conversion: it is left out, with one warning naming the shapes and model.shape_multiple."""
    import re

    refs, kept, failed, why = [], [], [], ""
    for i, f in enumerate(feeds):
        try:
            with activity(f"running the fp32 reference on validation feed {i + 1} of {len(feeds)} ({feed_text(f)})"):
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
                  evidence: list[str] | None = None, fix: str | None = None, metric=None,
                  logits: dict | None = None, labels: list | None = None, random_inputs: bool = False) -> StageResult:
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

    ``metric`` (tasks/accuracy.Metric; default: cosine with ``min_cosine``) is what gates: its value per output and
    per sample is the report's ``accuracy``; the cosine statistics are reported whatever the metric.
    ``logits``: ``{"finals": tasks.accuracy.logits.final_activations(...), "reference": feed -> {logit tensor: array},
    "candidate": the same for the candidate}`` (or ``{"finals", "reason"}`` when the candidate's logits cannot be
    read): cosine and allclose on the logits of outputs from a final Softmax/Sigmoid/LogSoftmax, reported, and gating
    too with ``accuracy.gate_logits``.

    ``random_inputs``: the feeds were generated at random (no validation.data): a non-finite reference is blamed on
    them and the message asks for data. Non-finite values in the reference are reported before any judgement
    (``nonfinite``: per output, the count and the feeds; tasks/accuracy/nonfinite.py); outputs non-finite at the same
    places in both are compared on their finite part, and the verdict says so.

    Every session is exact (tasks/onnxrt/ort.py): Q/DQ and integer ops computed as written, the same on any x86-64 CPU."""
    from tasks.accuracy.metric import Metric

    metric = metric or Metric(min_cosine=min_cosine)
    t0 = time.perf_counter()
    ref_sess = ort_session(reference)
    refs, kept, warnings = reference_outputs(ref_sess, feeds)
    left_out = [{n: list(a.shape) for n, a in f.items()} for i, f in enumerate(feeds) if i not in set(kept)]
    feeds = [feeds[i] for i in kept]
    found = nonfinite_reference(refs)  # before any judgement: a reference that is not finite is no target
    origins = _origins(reference, found, feeds)  # the node that made them and the inputs that reach it
    found_text = reference_warnings(found, feeds, inputs_source, random_inputs, origins)
    warnings += found_text
    labels = [labels[i] for i in kept] if labels is not None else None  # validation.labels, per feed
    samples = sum(batch_size(f) for f in feeds)
    evidence = list(evidence or [])
    measured: dict[str, dict] | None = None  # per output, of what the gate judges
    source: str | None = None  # what measured it
    measured_outs: list[dict] = []
    metrics: dict = {"validate_feeds": len(feeds), "validate_samples": samples}
    emulation_report: dict = {"source": emulation, "status": "not measured",
                              "reason": "the candidate graph is the reference graph itself"}
    if not identical:
        emulation_report, measured_outs = _emulation_measured(candidate, feeds, refs, emulation)
        metrics["emulation_cosine_min"] = emulation_report["cosine_min"]
        measured, source = emulation_report["outputs"], emulation
    if engine is not None:
        engine, measured_outs = _engine_measured(engine, feeds, refs, engine_device)
        metrics["engine_cosine_min"] = engine["cosine_min"]
        measured, source = engine["outputs"], engine_device or "engine"  # the engine is what ships
    else:
        engine = {"status": "skipped", "reason": engine_skip_reason or "engine execution not requested"}
    _note_measurement(measured, source, metrics, warnings, evidence)
    finite_notes = finite_part_notes(measured or {})
    warnings += finite_notes
    accuracy = None
    if measured is not None:  # the user's metric on what the gate judges
        accuracy = _accuracy_of(metric, measured_outs, refs, feeds, labels, source, emulation, logits)
        metrics.update(accuracy_metric=metric.name, accuracy_score=accuracy["score"])
    passed = measured is None or accuracy["passed"]
    report = {
        "reference": reference_label, "inputs": inputs_source, "samples": samples,
        "feeds": [{n: list(a.shape) for n, a in f.items()} for f in feeds], "left_out": left_out,
        "feed_inputs": [input_ranges([f]) for f in feeds],  # per feed, each float input's [min, max]
        "min_cosine": min_cosine, "identical": identical, "measured": measured is not None,
        "cosine_min": metrics.get("cosine_min"), "cosine_source": metrics.get("cosine_source"),
        "outputs": measured or {}, "emulation": emulation_report, "engine": engine,
        "evidence": evidence, "warnings": warnings, "passed": passed, "accuracy": accuracy,
        "nonfinite": {"reference": found, "origins": origins, "warnings": found_text, "notes": finite_notes,
                      "random_inputs": random_inputs},
        "verdict": verdict_text(metrics, passed, min_cosine, reference_label, samples, inputs_source,
                                evidence + finite_notes, accuracy),
    }
    write_json(out_path, report)
    metrics["validate_seconds"] = time.perf_counter() - t0
    result = StageResult(files=_validation_files(report, out_path), metrics=metrics, details=report)
    gate(result, label=label or (None if callable(candidate) else str(candidate)), fix=fix)
    return result


def _origins(reference: Path, found: dict, feeds: list[dict[str, np.ndarray]]) -> dict[str, dict]:
    """tasks.onnxrt.origins.nonfinite_origins on the first feed with a non-finite reference (none: {})."""
    if not found:
        return {}
    from tasks.onnxrt.origins import nonfinite_origins

    first = min(w["feeds"][0] for w in found.values())
    return nonfinite_origins(reference, feeds[first], list(found))


def _emulation_measured(candidate: Path | Callable, feeds: list[dict[str, np.ndarray]], refs: list[dict],
                        emulation: str) -> tuple[dict, list[dict]]:
    """The candidate (an ONNX file run in ONNX Runtime, or a callable) on every feed against the references: the
    report's ``emulation`` entry (its outputs' statistics, overall and per feed) and the candidate's outputs."""
    run_candidate = candidate if callable(candidate) else (lambda f, s=ort_session(candidate): ort_run(s, f))
    emu_outs = []
    for i, f in enumerate(feeds):  # one feed at a time; a stop at the memory budget names the feed and its inputs
        with activity(f"running the candidate on validation feed {i + 1} of {len(feeds)} ({feed_text(f)})"):
            emu_outs.append(run_candidate(f))
    per_feed = [compare(r, o) for r, o in zip(refs, emu_outs)]
    emu = summarize(per_feed)
    return {"source": emulation, "status": "ok", "cosine_min": headline(emu)["cosine_min"], "outputs": emu,
            "per_feed": per_feed}, emu_outs


def _engine_measured(engine: Callable, feeds: list[dict[str, np.ndarray]], refs: list[dict],
                     engine_device: str | None) -> tuple[dict, list[dict]]:
    """The engine runner on every feed against the references: the report's ``engine`` entry and the engine's
    outputs."""
    eng_outs = [engine(f) for f in feeds]
    eng = summarize([compare(r, o) for r, o in zip(refs, eng_outs)])
    return {"status": "ok", "device": engine_device, "outputs": eng, "cosine_min": headline(eng)["cosine_min"]}, eng_outs


def _note_measurement(measured: dict | None, source: str | None, metrics: dict, warnings: list[str],
                      evidence: list[str]) -> None:
    """The cosine headline of what was ``measured`` into ``metrics``, with a warning for reference outputs ~0
    everywhere; nothing measured (an identical graph): why, first in ``evidence``."""
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


def _accuracy_of(metric, measured_outs: list[dict], refs: list[dict], feeds: list[dict[str, np.ndarray]],
                 labels: list | None, source: str, emulation: str, logits: dict | None) -> dict:
    """The report's ``accuracy``: the user's metric on the measured outputs, with the logits of outputs from a final
    Softmax/Sigmoid/LogSoftmax (measured in the emulation only) and what gated (``gated_by``)."""
    from tasks.accuracy.logits import logit_report

    accuracy = {**metric.evaluate(measured_outs, refs, feeds, labels), "source": source}
    accuracy["gated_by"] = "outputs"
    finals = (logits or {}).get("finals") or {}
    if finals and logits.get("candidate") is not None and source == emulation:
        logit_outs = [logits["candidate"](f) for f in feeds]
        logit_refs = [logits["reference"](f) for f in feeds]
        accuracy["logits"] = logit_report(metric, finals, logit_outs, logit_refs)
    elif finals:
        accuracy["logits_not_measured"] = (logits or {}).get("reason") or "the engine's logits are not graph outputs"
    failed_logits = [n for n, row in (accuracy.get("logits") or {}).items() if row.get("passed") is False]
    if metric.gate_logits and failed_logits and accuracy["passed"]:
        accuracy.update(passed=False, gated_by=f"logits of {failed_logits[0]!r} (the input of its "
                                               f"{accuracy['logits'][failed_logits[0]]['op']})")
    elif metric.gate_logits and accuracy.get("logits"):
        accuracy["gated_by"] = "outputs and logits"
    return accuracy


def _validation_files(report: dict, out_path: Path) -> dict[str, Path]:
    """The validation report's files: its JSON (``out_path``, written) and the accuracy plot beside it, when drawn."""
    from tasks.report.plots import accuracy_plot

    files = {"validation": out_path}
    plot = accuracy_plot(report, out_path.with_name("accuracy.png"))  # kept with the verdict (a cached one needs no redraw)
    if plot:
        files["accuracy_plot"] = plot
    return files


def verdict_text(metrics: dict, passed: bool, min_cosine: float, reference_label: str, samples: int, inputs: str,
                 evidence: list[str], accuracy: dict | None = None) -> str:
    """The verdict in words a user reads before shipping: the metric that gated, its value and rule, what measured
    it, and (outputs from a final Softmax/Sigmoid/LogSoftmax) the logits and which level gated."""
    if "cosine_min" not in metrics:
        head = "not measured"
    elif accuracy is not None and accuracy["metric"] != "cosine":
        head = (f"{'passed' if passed else 'FAILED'}: accuracy.metric={accuracy['metric']} "
                f"{'worst score' if accuracy['metric'] not in ('allclose', 'top1') else 'lowest output'} "
                f"{accuracy['score']:.6g} ({accuracy['rule']}) vs {reference_label}, measured by "
                f"{metrics['cosine_source']}; cosine_min {metrics['cosine_min']:.6f} (reported, not gating)")
    else:
        head = (f"{'passed' if passed else 'FAILED'}: cosine_min {metrics['cosine_min']:.6f} "
                f"{'>=' if passed else '<'} accuracy.min_cosine={min_cosine} vs {reference_label}, measured by "
                f"{metrics['cosine_source']}")
    text = f"{head} on {samples} samples of {inputs}"
    if accuracy is not None and accuracy.get("logits"):
        rows = ", ".join(f"{n} = {r['op']}({r['logits']}): cosine {r['cosine']:.6f}, allclose within "
                         f"{r['allclose_within']:.4f}" for n, r in accuracy["logits"].items())
        gating = accuracy["settings"].get("gate_logits")
        text += (f"; gated by the {accuracy['gated_by']}; logits"
                 f"{'' if gating else ' (reported, not gating: accuracy.gate_logits=true gates them)'}: {rows}")
    if evidence:
        text += "; " + "; ".join(evidence)
    return text


def gate(result: StageResult, label: str | None = None, fix: str | None = None,
         calibration_ranges: dict | None = None) -> None:
    """Raise the AccuracyError of a failed verdict (a fresh one or one served from the cache): the one place its
    message is written. A cosine verdict names the failing validation feeds and, given ``calibration_ranges``
    (tasks.evaluate.fixes.input_ranges of the calibration samples), whether their inputs reach outside that range."""
    r = result.details
    if r["passed"]:
        return
    acc = r.get("accuracy") or {"metric": "cosine"}
    if acc["metric"] == "cosine" and acc.get("gated_by", "outputs") == "outputs":
        worst = min(r["outputs"], key=lambda n: r["outputs"][n]["cosine"])
        msg = (f"output {worst!r} has cosine {r['cosine_min']:.6f} to {r['reference']} ({r['cosine_source']}), below "
               f"accuracy.min_cosine={r['min_cosine']}")
        default_fix = "use a higher precision, or lower accuracy.min_cosine if that loss is acceptable"
        failing = failing_feeds_text(r, calibration_ranges)
        if failing:
            msg += f"; {failing}"
        ref_bad = ((r.get("nonfinite") or {}).get("reference") or {}).get(worst)
        if r["outputs"][worst].get("error"):  # a size the model computes from values came out otherwise
            msg += (f": on some feeds its shape differs from the reference's ({r['outputs'][worst]['error']}): the "
                    "model computes that size from values (a predicted duration, a decode that stops, a threshold), "
                    "so a cosine of 0 says the build took another discrete decision there, not how close its values are")
            default_fix = ("judge the output with a metric that compares outputs of different lengths "
                           "(accuracy.metric=module:function, docs/accuracy.md), or use a higher precision")
        elif ref_bad and r["outputs"][worst].get("nonfinite_mismatch"):  # no precision makes the NaN/inf line up
            random_inputs = r["nonfinite"].get("random_inputs")
            msg += (f": its fp32 reference holds {ref_bad['count']} non-finite values and the build is non-finite at "
                    f"other places ({r['outputs'][worst]['nonfinite_mismatch']} elements differ), so the cosine "
                    f"compares NaN/inf, not precision"
                    + (f" (the generated random values of {_inputs_of(r['nonfinite'], worst)} caused it)"
                       if random_inputs else ""))
            fix = None  # a higher precision cannot help: the inputs can
            default_fix = (DATA_HOW if random_inputs else
                           "check the inputs: the fp32 model itself gives NaN/inf on them (validation.data)")
    else:
        if acc.get("gated_by", "outputs") != "outputs":
            what = f"the {acc['gated_by']} fail(s) it: " + ", ".join(
                f"{n}: cosine {row['cosine']:.6f}, allclose within {row['allclose_within']:.4f}"
                for n, row in acc["logits"].items() if row.get("passed") is False)
        elif acc.get("outputs"):
            worst = min(acc["outputs"], key=acc["outputs"].get)
            what = f"output {worst!r} scores {acc['outputs'][worst]:.6g}"
        else:
            what = (f"worst score {acc['score']:.6g}; batches {acc.get('failed_batches')} of "
                    f"{len(acc.get('per_sample', []))} fail")
        msg = (f"accuracy.metric={acc['metric']} fails ({acc['rule']}): {what}, vs {r['reference']} "
               f"({r['cosine_source']}; cosine_min {r['cosine_min']:.6f})")
        default_fix = (f"use a higher precision, or relax accuracy.metric={acc['metric']}'s settings if that loss is "
                       f"acceptable")
    err = AccuracyError(msg, stage="validate", file=label, fix=fix or default_fix)
    err.result = result
    raise err


def _inputs_of(nonfinite: dict, output: str) -> str:
    """The inputs that reach the node making ``output`` non-finite (validate's ``nonfinite`` report), in words."""
    origin = (nonfinite.get("origins") or {}).get(output) or {}
    return "input(s) " + ", ".join(origin["inputs"]) if origin.get("inputs") else "the inputs"
